"""An algorithm added from outside the package, as docs/guide/extending.md's "Adding an algorithm" shows: the Signum of
``examples/custom_algorithm.py`` (one PyTorch rule, a Triton twin, one ``register_algorithm`` call) run through its
32-bit and 8-bit classes against a hand-written reference, its paged class, its Triton twin (Triton's interpreter on
CPU), a state-dict round trip, the memory estimator and a Trainer run by ``optim=`` name."""

from __future__ import annotations

import importlib.util
import io
import re
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from format_helpers import reference_codes
from helpers import make_params, set_grads

import hf_optim
from hf_optim.formats.dynamic_map import dynamic_map

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_algorithm.py"
SHAPES = [(70, 100), (33,)]  # 7000 elements: 8-bit state with a partial last block; 33: fp32 state
STEPS = 4
SETTINGS = dict(lr=1e-2, beta=0.8, weight_decay=0.1)


@pytest.fixture(scope="module")
def example():
    """The example module, imported once per process (it registers the algorithm)."""
    name = "hf_optim_custom_algorithm_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_readme_example_is_the_file_this_test_runs():
    readme = (ROOT / "docs" / "guide" / "extending.md").read_text()
    section = readme.split("## Adding an algorithm", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "README's 'Adding an algorithm' has no python block"
    source = EXAMPLE.read_text()
    for block in blocks:
        assert block in source, "README's 'Adding an algorithm' code differs from examples/custom_algorithm.py"


def f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)  # the rule's scalars arrive as fp32, as here


def reference_step(param: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, step_settings: dict):
    """Signum by hand (fp32): m = beta*m + (1-beta)*g; p = p*(1 - lr*wd) - lr*sign(m)."""
    lr, beta, wd = step_settings["lr"], step_settings["beta"], step_settings["weight_decay"]
    momentum = f32(beta) * momentum + f32(1.0 - beta) * grad
    param = param * f32(1.0 - lr * wd) - f32(lr) * torch.sign(momentum)
    return param, momentum


def quantize_by_hand(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' blockwise format: absmax per 256 elements, nearest signed-map code (brute force)."""
    flat = values.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % 256))
    absmax = padded.view(-1, 256).abs().amax(-1)
    return reference_codes(flat, signed=True), absmax


def dequantize_by_hand(codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
    return dynamic_map(True)[codes.long()] * absmax.repeat_interleave(256)[:numel]


@pytest.mark.parametrize("bits", [32, 8])
def test_classes_match_a_hand_written_reference(example, bits):
    params = make_params(SHAPES)
    cls = example.signum[f"Signum{bits}bit"]
    optimizer = cls(params, **SETTINGS)
    expected = [p.detach().clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    codes: list = [None] * len(params)
    for step in range(STEPS):
        set_grads(params, step)
        optimizer.step()
        for i, p in enumerate(params):
            eight_bit = bits == 8 and p.numel() >= 4096
            old = dequantize_by_hand(*codes[i], p.numel()).view_as(p) if eight_bit and step else momenta[i]
            expected[i], momenta[i] = reference_step(expected[i], old, p.grad, SETTINGS)
            if eight_bit:
                codes[i] = quantize_by_hand(momenta[i])
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), expected[i]), f"parameter {i} differs from the reference"
        state = optimizer.state[p]
        if bits == 8 and p.numel() >= 4096:
            assert state["state1"].dtype == torch.uint8 and torch.equal(state["qmap1"], dynamic_map(True))
            assert torch.equal(state["state1"].view(-1), codes[i][0])
            assert torch.equal(state["absmax1"], codes[i][1])
        else:
            assert state["state1"].dtype == torch.float32 and torch.equal(state["state1"], momenta[i])


def run(cls, params, **kwargs):
    optimizer = cls(params, **SETTINGS, **kwargs)
    for step in range(STEPS):
        set_grads(params, step)
        optimizer.step()
    return optimizer


def test_paged_class_runs_as_the_unpaged_one(example):
    params, paged_params = make_params(SHAPES), make_params(SHAPES)
    reference = run(example.Signum8bit, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU state cannot be paged: it says so, and runs as Signum8bit
        paged = run(example.PagedSignum8bit, paged_params)
    assert paged.is_paged and not reference.is_paged
    for p, q in zip(params, paged_params):
        assert torch.equal(p, q)
        for key, value in reference.state[p].items():
            assert torch.equal(value, paged.state[q][key]) if isinstance(value, torch.Tensor) else value == \
                paged.state[q][key]


def test_triton_twin_matches_the_pytorch_rule(example, monkeypatch):
    pytest.importorskip("triton")

    params, triton_params = make_params(SHAPES), make_params(SHAPES)
    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    reference = run(example.Signum8bit, params)
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    optimizer = run(example.Signum8bit, triton_params)
    assert "backend=triton" in repr(optimizer)
    assert all(optimizer._rules.main.triton_eligible(p, sharded=False) for p in triton_params)
    for p, q in zip(params, triton_params):
        assert torch.equal(p, q)  # the same fp32 operations in the same order
        for key in ("state1", "absmax1"):
            if key in reference.state[p]:
                assert torch.equal(reference.state[p][key], optimizer.state[q][key]), key


def test_state_dict_round_trip_with_weights_only(example):
    params, resumed_params = make_params(SHAPES), make_params(SHAPES)
    optimizer = run(example.Signum8bit, params)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    for p, q in zip(params, resumed_params):
        q.data.copy_(p.data)
    resumed = example.Signum8bit(resumed_params, **SETTINGS)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.state_dict()["param_groups"][0]["hf_optim_algorithm"] == "signum"
    for opt, ps in ((optimizer, params), (resumed, resumed_params)):
        set_grads(ps, STEPS)
        opt.step()
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)


def test_estimator_counts_its_slots(example):
    from hf_optim.recipes.estimate import TensorCount, state_bytes

    params = make_params(SHAPES)
    optimizer = run(example.Signum8bit, params)
    counts = [TensorCount(p.numel(), 4, tuple(p.shape), False) for p in params]
    assert state_bytes("signum_8bit", counts) == hf_optim.state_memory(optimizer).total_bytes


def test_trainer_builds_it_by_name(example, tmp_path):
    from trainer_helpers import check_state, common_args, inner_optimizer, losses, token_dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_optim.tiny import tiny_llama, tiny_tokenizer

    names = {entry.name: entry for entry in hf_optim.available_optimizers()}
    assert {"signum", "signum_8bit", "paged_signum_8bit"} <= set(names)
    assert names["paged_signum_8bit"].cls is example.PagedSignum8bit and not names["signum_8bit"].takes_over
    tokenizer = tiny_tokenizer()
    model = tiny_llama(layers=1)
    args = TrainingArguments(**common_args(tmp_path, "signum_8bit", max_steps=4, learning_rate=1e-3,
                                           optim_args="beta=0.5"))
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(tokenizer, 32),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    optimizer = inner_optimizer(trainer)
    assert type(optimizer) is example.Signum8bit
    assert all(group["beta"] == 0.5 and group["lr"] == 1e-3 for group in optimizer.param_groups)
    check_state(optimizer, model, "signum_8bit")  # uint8 state but for the embedding and small tensors
    assert all(torch.isfinite(torch.tensor(losses(trainer))))
    wrong = TrainingArguments(**common_args(tmp_path, "signum_8bit", optim_args="betta=0.5"))
    with pytest.raises(ValueError, match="'betta'.*did you mean 'beta'"):
        hf_optim.integrations.transformers.optimizer_cls_and_kwargs(wrong)


class _Hyper(NamedTuple):
    lr: float


def _description(name: str, **overrides) -> hf_optim.Algorithm:
    fields = dict(name=name, class_name="Throwaway", slots=(hf_optim.StateSpec("state1", signed=True),),
                  hyper=_Hyper, hyper_at=lambda group, step: _Hyper(group["lr"]),
                  rule=lambda param, grad, states, h: (param - h.lr * grad, states))
    return hf_optim.Algorithm(**{**fields, **overrides})


def test_registry_refuses_bad_registrations(example):
    with pytest.raises(hf_optim.UnknownAlgorithmError, match="'signun'.*Did you mean 'signum'"):
        hf_optim.lookup_algorithm("signun")
    assert hf_optim.lookup_algorithm("signum").algorithm is example.SIGNUM
    assert hf_optim.register_algorithm(example.SIGNUM) is example.signum  # the same description again: a no-op
    with pytest.raises(ValueError, match="'signum' is already registered"):
        hf_optim.register_algorithm(_description("signum"), defaults={"lr": 0.1})
    with pytest.raises(ValueError, match="'adamw_8bit' .* already 'adamw'"):
        hf_optim.register_algorithm(_description("throwaway_names", trainer=hf_optim.TrainerMapping(
            names=("adamw_8bit",))), defaults={"lr": 0.1})
    with pytest.raises(ValueError, match="'lr' among the hyperparameters"):
        hf_optim.register_algorithm(_description("throwaway_no_lr"), defaults={"beta": 0.1})
    with pytest.raises(TypeError, match="hyper must be a typing.NamedTuple"):
        _description("throwaway_dict", hyper=dict)
    with pytest.raises(ValueError, match="lower-case Python identifier"):
        _description("Bad-Name")
    with pytest.raises(hf_optim.UnknownAlgorithmError):
        hf_optim.lookup_algorithm("throwaway_names")  # a refused registration leaves nothing behind


def test_relative_references_resolve_in_the_package_that_made_the_description():
    """``".triton_rule:adamw"`` names the module beside the description, whoever asks for it."""
    pytest.importorskip("triton")
    import importlib

    from hf_optim.core.algorithm import resolve
    from hf_optim.optim.adamw import ADAMW

    assert ADAMW.package == "hf_optim.optim.adamw"
    assert ADAMW.triton_rule.startswith(".")
    assert ADAMW.resolve(ADAMW.triton_rule) is importlib.import_module("hf_optim.optim.adamw.triton_rule").adamw
    with pytest.raises(ValueError, match=r"'\.triton_rule:adamw' is relative"):
        resolve(".triton_rule:adamw")
