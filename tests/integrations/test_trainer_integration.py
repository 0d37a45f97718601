"""`import hf_optim` makes the Trainer's `optim=` names build hf_optim's optimizers (issue 3), plain transformers.

TRL's trainers, configs and parser are covered in test_trl_integration.py; this file needs only transformers, so
it also runs at the lowest supported transformers version.
"""

from __future__ import annotations

import inspect
import logging
import pickle
import subprocess
import sys

import pytest
import torch
from trainer_helpers import check_state, common_args, inner_optimizer, losses, token_dataset
from transformers import DataCollatorForLanguageModeling, HfArgumentParser, Trainer, TrainingArguments

import hf_optim
from hf_optim.integrations import transformers as integration
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.integrations.optim_args import OptimArgsError
from hf_optim.optim.adafactor import RelativeStepSchedule
from hf_optim.tiny import tiny_llama, tiny_tokenizer

TAKEN_OVER = [e.name for e in hf_optim.available_optimizers() if e.takes_over]


def collator(tokenizer):
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)


@pytest.mark.parametrize("name", ["paged_adamw_8bit", "lamb_8bit", "adamw_torch_4bit"])
def test_plain_trainer(tmp_path, name):
    tokenizer = tiny_tokenizer()
    model = tiny_llama()
    args = TrainingArguments(**common_args(tmp_path, name))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(tokenizer), data_collator=collator(tokenizer))
    trainer.train()
    assert type(inner_optimizer(trainer)) is OPTIMIZER_NAMES[name].cls
    check_state(inner_optimizer(trainer), model, name)
    history = losses(trainer)
    assert sum(history[-2:]) < sum(history[:2]), history


def test_parser_command_line(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--optim", "paged_lamb_8bit",
         "--optim_args", "beta1=0.85,use_nvlamb=true"]
    )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is hf_optim.PagedLAMB8bit
    assert kwargs["betas"] == (0.85, args.adam_beta2) and kwargs["use_nvlamb"] is True


def test_parser_built_before_import_is_updated_with_a_warning(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    action = next(a for a in parser._actions if "--optim" in a.option_strings)
    action.choices = [c for c in action.choices if c not in OPTIMIZER_NAMES]  # as if built before the import
    with pytest.warns(UserWarning, match="built before `import hf_optim`"):
        integration._update_existing_parsers()
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--optim", "lamb_8bit"])
    assert args.optim == "lamb_8bit"


def test_training_args_bin_unpickles_without_hf_optim(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lamb_8bit", report_to=[], use_cpu=True)
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    code = (
        "import sys, torch; a = torch.load(sys.argv[1], weights_only=False); "
        "assert 'hf_optim' not in sys.modules, 'hf_optim was imported'; print(str(a.optim))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "lamb_8bit"
    assert pickle.loads(pickle.dumps(args.optim)) == "lamb_8bit"


def test_unknown_name_suggests_closest_from_both_libraries():
    with pytest.raises(ValueError, match="'paged_adamw_8bt' is not a valid optimizer name") as error:
        TrainingArguments(output_dir="unused", optim="paged_adamw_8bt")
    assert "'paged_adamw_8bit'" in str(error.value)
    with pytest.raises(ValueError, match="'lamb8bit'.*'lamb_8bit' \\(hf_optim\\)"):
        TrainingArguments(output_dir="unused", optim="lamb8bit", use_cpu=True)
    with pytest.raises(ValueError, match="'adamw_torch_fusd'.*'adamw_torch_fused' \\(transformers\\)"):
        TrainingArguments(output_dir="unused", optim="adamw_torch_fusd")


def test_optim_args_are_typed_and_validated(tmp_path):
    def resolve(name, optim_args):
        return Trainer.get_optimizer_cls_and_kwargs(
            TrainingArguments(output_dir=str(tmp_path), optim=name, optim_args=optim_args, adam_epsilon=1e-7)
        )

    cls, kwargs = resolve("paged_ademamix_8bit", "beta1=0.8,beta3=0.999,alpha=8,t_alpha=100,t_beta3=200")
    assert cls is hf_optim.PagedAdEMAMix8bit
    assert kwargs["betas"] == (0.8, 0.999, 0.999) and kwargs["alpha"] == 8.0
    assert kwargs["t_alpha"] == 100 and kwargs["t_beta3"] == 200 and kwargs["eps"] == 1e-7
    cls, kwargs = resolve("lion_8bit", "weight_decay=0.1,min_8bit_size=100")
    assert cls is hf_optim.Lion8bit and kwargs["min_8bit_size"] == 100 and isinstance(kwargs["min_8bit_size"], int)
    with pytest.raises(OptimArgsError, match="'betta1'.*did you mean 'beta1'.*Valid keys:"):
        resolve("adamw_8bit", "betta1=0.9")
    with pytest.raises(OptimArgsError, match="use_nvlamb='maybe'.*expected true or false"):
        resolve("lamb", "use_nvlamb=maybe")
    with pytest.raises(OptimArgsError, match="t_alpha='1.5'.*expected an integer"):
        resolve("ademamix", "t_alpha=1.5")
    with pytest.raises(OptimArgsError, match="is not 'key=value'"):
        resolve("lamb", "beta1")


def test_adafactor_defaults_follow_the_trainer_and_honour_optim_args(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="adafactor", learning_rate=1e-3)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is hf_optim.Adafactor
    assert kwargs == {"lr": 1e-3, "scale_parameter": False, "relative_step": False}
    args = TrainingArguments(output_dir=str(tmp_path), optim="adafactor",
                             optim_args="scale_parameter=true,relative_step=true,warmup_init=true,clip_threshold=2")
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["lr"] is None and kwargs["relative_step"] and kwargs["warmup_init"]
    assert kwargs["clip_threshold"] == 2.0
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path),
                                                                      optim="adafactor_8bit"))
    assert kwargs["state_format"] == "blockwise8" and kwargs["beta1"] == 0.9


def test_adafactor_relative_step_runs_under_the_trainer(tmp_path):
    """relative_step=True holds no lr for the Trainer's scheduler: hf_optim gives it RelativeStepSchedule, which
    reports the step size Adafactor computes (warmup_init: 1e-6 * t)."""
    tokenizer = tiny_tokenizer()
    args = TrainingArguments(**common_args(tmp_path, "adafactor", max_steps=3, lr_scheduler_type="linear",
                                           optim_args="relative_step=true,scale_parameter=true,warmup_init=true"))
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_dataset(tokenizer, 32),
                      data_collator=collator(tokenizer))
    trainer.train()
    assert isinstance(trainer.lr_scheduler, RelativeStepSchedule)
    assert trainer.lr_scheduler.get_last_lr() == pytest.approx([4e-6, 4e-6])  # both groups: the next step's size
    # transformers < 5 logs the lr after the scheduler step, newer versions the one used: either way 1e-6 apart.
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert logged in (pytest.approx([1e-6, 2e-6, 3e-6]), pytest.approx([2e-6, 3e-6, 4e-6]))
    assert all(torch.isfinite(torch.tensor(losses(trainer))))


def test_takeover_can_be_turned_off(tmp_path):
    import bitsandbytes

    integration.set_takeover(False)
    try:
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path),
                                                                        optim="paged_adamw_8bit"))
        assert cls.__module__.startswith("bitsandbytes") and cls is bitsandbytes.optim.AdamW
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim="lamb_8bit"))
        assert cls is hf_optim.LAMB8bit  # hf_optim's own names still resolve
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim="adamw_4bit"))
        assert cls is hf_optim.AdamW4bit
    finally:
        integration.set_takeover(True)
    # With the takeover on, transformers' torchao-backed names run hf_optim's AdamW in torchao's 4-bit format
    # (blockwise4) and in bitsandbytes' 8-bit format.
    for name, expected in (("adamw_torch_4bit", hf_optim.AdamW4bitBlockwise), ("adamw_torch_8bit", hf_optim.AdamW8bit)):
        cls, _ = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim=name))
        assert cls is expected, (name, cls)


@pytest.mark.skipif("optimizer_cls_and_kwargs" not in inspect.signature(Trainer.__init__).parameters,
                    reason="Trainer(optimizer_cls_and_kwargs=) exists since transformers 4.47")
def test_optimizer_cls_and_kwargs_path_without_patching(tmp_path):
    """Trainer(optimizer_cls_and_kwargs=...), usable with HF_OPTIM_PATCH=0."""
    tokenizer = tiny_tokenizer()
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=2))
    model = tiny_llama()
    pair = integration.optimizer_cls_and_kwargs(args, model, name="lion_8bit")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(tokenizer, 32),
                      data_collator=collator(tokenizer), optimizer_cls_and_kwargs=pair)
    trainer.train()
    assert type(inner_optimizer(trainer)) is hf_optim.Lion8bit
    check_state(inner_optimizer(trainer), model, "lion_8bit")


def test_mixin_path_without_patching(tmp_path):
    """HfOptimTrainerMixin resolves its name itself (works with HF_OPTIM_PATCH=0 and every transformers)."""
    tokenizer = tiny_tokenizer()
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=2))

    class LambTrainer(integration.HfOptimTrainerMixin, Trainer):
        hf_optim_name = "lamb_8bit"

    model = tiny_llama()
    trainer = LambTrainer(model=model, args=args, train_dataset=token_dataset(tokenizer, 32),
                          data_collator=collator(tokenizer))
    trainer.train()
    assert type(inner_optimizer(trainer)) is hf_optim.LAMB8bit
    check_state(inner_optimizer(trainer), model, "lamb_8bit")


def test_patch_env_zero_patches_nothing():
    code = (
        "import os; os.environ['HF_OPTIM_PATCH'] = '0'; import hf_optim; "
        "from transformers import TrainingArguments, Trainer\n"
        "try:\n    TrainingArguments(output_dir='x', optim='lamb_8bit')\nexcept ValueError as e: print('refused')\n"
        "print(getattr(Trainer.get_optimizer_cls_and_kwargs, '__hf_optim__', False))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["refused", "False"]


def test_one_log_line_says_what_runs(tmp_path):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_optim").addHandler(handler)
    try:
        Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=str(tmp_path), optim="paged_adamw_8bit"))
    finally:
        logging.getLogger("hf_optim").removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert lines == ["optim='paged_adamw_8bit' -> hf_optim.PagedAdamW8bit (8-bit blockwise, paged, backend="
                     + ("torch-compile on CPU)" if hf_optim.kernels.torch_path.multi_tensor.compile_enabled()
                        else "torch)")]


def test_available_optimizers_lists_the_names_transformers_has():
    table = {e.name: e for e in hf_optim.available_optimizers()}
    transformers_bnb = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "ademamix",
                        "ademamix_8bit", "paged_ademamix_8bit", "paged_ademamix_32bit", "lion_8bit", "lion_32bit",
                        "paged_lion_8bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_bnb_8bit",
                        "rmsprop_bnb_32bit", "adafactor"}
    transformers_torchao = {"adamw_torch_4bit", "adamw_torch_8bit"}
    assert transformers_bnb | transformers_torchao == set(TAKEN_OVER) <= set(table)
    # the names transformers gives other meanings to (the registry-derived names are checked by
    # tests/algorithms/test_algorithm_conformance.py)
    assert table["adamw_torch_4bit"].cls is hf_optim.AdamW4bitBlockwise and table["adamw_torch_4bit"].optim_bits == 4
    assert table["adamw_torch_8bit"].cls is hf_optim.AdamW8bit
    assert table["ademamix"].optim_bits == 32 and table["rmsprop_bnb"].optim_bits == 32
