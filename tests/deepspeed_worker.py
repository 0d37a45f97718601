"""What test_deepspeed.py checks, run in one torchrun with 2 CPU processes (gloo, ``DS_ACCELERATOR=cpu``).

Every shipped DeepSpeed config of recipes/accelerate/ runs here as ``accelerate launch --config_file FILE`` would
run it: accelerate's own launch code turns the file into the environment its launched processes read
(``prepare_deepspeed_cmd_env``), the worker takes that environment, and the Trainer builds accelerate's DeepSpeed
plugin from it. One process pair serves every config (accelerate's state is reset between them): a launch costs
more than the training it runs.

Usage (from the repository root): torchrun --nproc_per_node 2 tests/deepspeed_worker.py OUT_FILE WORK_DIR
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "accelerate"
ACCELERATE_KEYS = ("ACCELERATE_", "FSDP_")  # what a launch sets for its processes (cleared between configs)


def without_jit_ops() -> None:
    """DeepSpeed's CPU backend compiles a shared-memory collective op the first time it starts (a JIT C++ build
    of a minute or more); gloo does the same collectives. Marking every op as not buildable keeps DeepSpeed on
    gloo and makes any op that would need a build fail instead of compiling."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def launch_env(config_file: Path) -> dict[str, str]:
    """The ACCELERATE_* environment ``accelerate launch --config_file FILE --num_processes 2`` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--num_processes", "2",
                                               "worker.py"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate.commands.launch.launch_command does before its deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    env = prepare_deepspeed_cmd_env(args)[1] if args.use_deepspeed else prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(ACCELERATE_KEYS)}


@contextlib.contextmanager
def launched_with(config_file: Path | None, edit=None):
    """The environment of a launch with ``config_file`` (``edit`` changes the DeepSpeed JSON it names first; None:
    plain torchrun, no accelerate config), with accelerate's process-wide state reset before and after."""
    from accelerate.state import AcceleratorState

    env = launch_env(config_file) if config_file is not None else {}
    if edit is not None:
        key = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
        config = json.loads((ROOT / env[key]).read_text())
        edit(config)
        edited = Path(os.environ["WORK_DIR"]) / f"edited-{config_file.stem}.json"
        if dist.get_rank() == 0:
            edited.write_text(json.dumps(config))
        dist.barrier()
        env[key] = str(edited)
    saved = {k: v for k, v in os.environ.items() if k.startswith(ACCELERATE_KEYS)}
    for key in saved:
        del os.environ[key]
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)
        dist.barrier()


def make_trainer(out: Path, name: str, *, bf16: bool, seed: int = 0, max_steps: int = 4, **overrides):
    """A Trainer on a 1-layer tiny Llama, saving every 2 steps (weight decay on, so AdamW's decoupled decay
    matters), as tests/trainer_helpers.checkpointing_trainer, with ``bf16`` as the config's mixed precision."""
    from trainer_helpers import common_args, token_dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_optim.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    settings = dict(max_steps=max_steps, save_strategy="steps", save_steps=2, lr_scheduler_type="linear",
                    warmup_steps=1, per_device_train_batch_size=2, weight_decay=0.01, bf16=bf16)
    args = TrainingArguments(**common_args(out, name, **{**settings, **overrides}))
    return Trainer(model=tiny_llama(seed=seed, layers=1), args=args, train_dataset=token_dataset(tokenizer, 16),
                   data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))


def master_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master copy, gathered from the ZeRO partitions (a collective at ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in trainer.model.named_parameters()}


def optimizer_chain(trainer) -> list[str]:
    chain, optimizer = [], trainer.optimizer
    while optimizer is not None and len(chain) < 5:
        chain.append(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def stepped_state(trainer) -> dict:
    """What the hf_optim optimizer under ZeRO steps and keeps: its parameters' shapes and its state tensors."""
    from hf_optim.monitor.accounting import unwrap_optimizer

    inner = unwrap_optimizer(trainer.optimizer)
    # keyed by the partitions themselves: ZeRO-3 empties param_groups between its steps
    stepped = list(inner.state)
    state = {f"{i}.{key}": value.clone() for i, p in enumerate(stepped) for key, value in inner.state[p].items()
             if isinstance(value, torch.Tensor)}
    return {"class": type(inner).__name__, "shapes": [tuple(p.shape) for p in stepped], "state": state}


def zero_run(config: str, bf16: bool) -> dict:
    """Train 4 steps (checkpoints at 2 and 4); a fresh Trainer (other initial weights) resumes from checkpoint-2
    and trains steps 3-4. Both ends are recorded for the test to compare."""
    from trainer_helpers import losses

    from hf_optim.tiny import tiny_llama

    out = Path(os.environ["WORK_DIR"]) / config
    with launched_with(CONFIGS / config):
        straight = make_trainer(out, "adamw_8bit", bf16=bf16)
        straight.train()
        result = {"chain": optimizer_chain(straight), "losses": losses(straight),
                  "weights": master_weights(straight), "stepped": stepped_state(straight),
                  "model_parameters": sum(p.numel() for p in tiny_llama(layers=1).parameters()),
                  "checkpoints": sorted(p.name for p in (out / "out").glob("checkpoint-*"))}
        resumed = make_trainer(out, "adamw_8bit", bf16=bf16, seed=1)
        resumed.train(resume_from_checkpoint=str(out / "out" / "checkpoint-2"))
        result.update(resumed_losses=losses(resumed), resumed_weights=master_weights(resumed),
                      resumed_stepped=stepped_state(resumed))
    return result


def same_math() -> dict:
    """AdamW32bit under ZeRO-2 (the offload config: fp32, the optimizer on CPU) against the same Trainer under DDP
    (plain torchrun). No clipping: DeepSpeed and the Trainer compute the global norm in other orders. With 2 ranks
    the averaged gradients are the same numbers (one addition, a halving), and AdamW is elementwise, so the flat
    partitions must step to the very weights DDP's whole tensors step to."""
    from hf_optim.tiny import tiny_llama

    work = Path(os.environ["WORK_DIR"])
    runs = {}
    for key, config in (("zero2_offload", CONFIGS / "deepspeed_zero2_offload.yaml"), ("ddp", None)):
        with launched_with(config):
            trainer = make_trainer(work / f"math-{key}", "adamw_32bit", bf16=False, max_grad_norm=0.0,
                                   save_strategy="no")
            trainer.train()
            if key == "ddp":
                weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            else:
                weights = master_weights(trainer)
            runs[key] = {"weights": weights, "chain": optimizer_chain(trainer)}
    runs["initial"] = {n: p.detach().clone() for n, p in tiny_llama(seed=0, layers=1).named_parameters()}
    return runs


REFUSED = ["lamb_8bit", "adafactor", "muon_8bit", "adamw_4bit_rank1"]


def refusals() -> dict:
    """Under ZeRO-2 the optimizers that need whole tensors stop before any step; under ZeRO-2 offload without
    ``zero_force_ds_cpu_optimizer: false`` so does AdamW8bit (before accelerate builds DeepSpeed's CPU Adam)."""
    out = Path(os.environ["WORK_DIR"]) / "refused"
    results = {}
    with launched_with(CONFIGS / "deepspeed_zero2.yaml"):
        for name in REFUSED:
            results[name] = attempt(make_trainer(out, name, bf16=True))
    with launched_with(CONFIGS / "deepspeed_zero2_offload.yaml", edit=lambda c: c.pop("zero_force_ds_cpu_optimizer")):
        results["offload_replaced"] = attempt(make_trainer(out, "adamw_8bit", bf16=False))
    return results


def attempt(trainer) -> dict:
    """Train, and record the error that stopped it and how many steps had run."""
    try:
        trainer.train()
        return {"steps": trainer.state.global_step}
    except ValueError as error:
        return {"error": str(error), "type": type(error).__name__, "steps": trainer.state.global_step}


def cli(argv: list[str]) -> dict:
    """``hf-optim ARGV`` in this process (as ``accelerate launch ... -m hf_optim.cli ARGV`` runs it): exit status
    and what this rank printed."""
    from hf_optim.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(argv)
    return {"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def cli_runs() -> dict:
    """The recipe CLI under the ZeRO-2 offload config (what the issue's user ran): a smoke run of a full
    fine-tune, and the same run with a LAMB optimizer that ZeRO cannot run; under the ZeRO-2 config (bf16) a
    recipe without bf16; and under the FSDP2 config, which accelerate does not apply to CPU processes."""
    work = Path(os.environ["WORK_DIR"])
    results = {}
    with launched_with(CONFIGS / "deepspeed_zero2_offload.yaml"):
        results["train"] = cli(["train", "llama-3.2-1b-full", "--smoke", "--output-dir", str(work / "cli-run")])
        summary = work / "cli-run" / "summary.json"
        results["summary"] = json.loads(summary.read_text()) if summary.exists() else None
        results["lamb"] = cli(["train", "llama-3.2-1b-full", "--smoke", "training.optim=lamb_8bit",
                               "--output-dir", str(work / "cli-lamb")])
    with launched_with(CONFIGS / "deepspeed_zero2.yaml"):  # mixed_precision: bf16 against training.bf16: false
        results["bf16"] = cli(["train", "llama-3.2-1b-full", "--smoke", "training.bf16=false",
                               "--output-dir", str(work / "cli-bf16")])
    with launched_with(CONFIGS / "fsdp2.yaml"):
        results["fsdp"] = cli(["train", "llama-3.2-1b-full", "--smoke", "training.max_steps=1",
                               "--output-dir", str(work / "cli-fsdp")])
    return results


def main(out_file: str, work_dir: str) -> None:
    started = time.perf_counter()
    os.environ["WORK_DIR"] = work_dir
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    without_jit_ops()
    from deepspeed.ops.op_builder.builder import OpBuilder

    import hf_optim  # noqa: F401  (patches the Trainer's optim= names)

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    parts = {
        "zero1": lambda: zero_run("deepspeed_zero1.yaml", bf16=True),
        "zero2": lambda: zero_run("deepspeed_zero2.yaml", bf16=True),
        "zero2_offload": lambda: zero_run("deepspeed_zero2_offload.yaml", bf16=False),
        "zero3": lambda: zero_run("deepspeed_zero3.yaml", bf16=True),
        "same_math": same_math,
        "refused": refusals,
        "cli": cli_runs,
    }
    results, seconds = {}, {"start": time.perf_counter() - started}  # start: imports and process group
    for key, part in parts.items():
        begun = time.perf_counter()
        results[key] = part()
        seconds[key] = time.perf_counter() - begun
    results.update({
        "seconds": seconds,  # where a run's time goes (printed by the test's fixture)
        "rank": dist.get_rank(),
        "built_ops": sorted(OpBuilder._loaded_ops),  # DeepSpeed ops compiled or loaded: none may be needed
    })
    gathered = [None, None] if dist.get_rank() == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if dist.get_rank() == 0:
        torch.save(gathered, out_file)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
