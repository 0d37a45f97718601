"""Every kind of bad input in one place: each case is a clear error (type and message checked, raised by a check,
never from inside a kernel) or a documented safe behaviour (checked by the case itself).

Some cases call the same checks as the focused tests (test_robustness.py, test_state_dict.py,
test_trainer_integration.py); this file is the one list of all of them. Recipe files that are not mappings are
checked where the recipe loader lives.
"""

from __future__ import annotations

import json
import struct
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from helpers import make_params, run_steps, set_grads
from transformers import Trainer, TrainingArguments

import hf_optim
from hf_optim import StateDictError
from hf_optim.checkpoints import checkpoint_problems, last_complete_checkpoint
from hf_optim.integrations.optim_args import OptimArgsError
from hf_optim.optim.base import QUANT_STATE_KEY

FAMILIES_8BIT = [
    (hf_optim.AdamW8bit, {}), (hf_optim.AdEMAMix8bit, {}), (hf_optim.LAMB8bit, {}), (hf_optim.Lion8bit, {}),
    (hf_optim.RMSprop8bit, {}), (hf_optim.Adafactor, {"beta1": 0.9, "optim_bits": 8}),
]


@dataclass(frozen=True)
class Case:
    """``run(tmp_path)`` with the bad input; ``raises`` and ``match`` the error it must give, or None when the
    behaviour is safe and documented (``run`` then checks it)."""

    id: str
    run: Callable[[Path], object]
    raises: type[BaseException] | None = None
    match: str = ""


def build(cls, params, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged-on-CPU notice
        return cls(params, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Names and optim_args (the Trainer path)


def trainer_optimizer(tmp_path, name, optim_args=None):
    """Resolve a Trainer name and build the optimizer as the Trainer does."""
    args = TrainingArguments(output_dir=str(tmp_path), optim=name, optim_args=optim_args, use_cpu=True)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return cls(make_params([(8, 8)]), **kwargs)


NAME_CASES = [
    Case("unknown optimizer name", lambda t: trainer_optimizer(t, "lamb8bit"), ValueError,
         r"'lamb8bit' is not a valid optimizer name.*'lamb_8bit'"),
    Case("unknown optim_args key", lambda t: trainer_optimizer(t, "lamb_8bit", "max_trust=10"), OptimArgsError,
         r"'max_trust'.*did you mean 'max_trust_ratio'"),
    Case("optim_args value of the wrong type", lambda t: trainer_optimizer(t, "ademamix", "t_alpha=soon"),
         OptimArgsError, r"t_alpha='soon'.*expected an integer"),
    Case("optim_args value out of range", lambda t: trainer_optimizer(t, "lion_8bit", "beta1=1.5"), ValueError,
         r"Invalid beta parameter at index 0: 1.5 \(beta1\); expected a value in \[0.0, 1.0\)"),
    Case("optim_args not key=value", lambda t: trainer_optimizer(t, "lamb", "0.9"), OptimArgsError,
         r"'0.9' is not 'key=value'"),
    Case("unknown constructor keyword", lambda t: hf_optim.AdamW(make_params([(3,)]), betta1=0.9), TypeError,
         r"unexpected keyword argument 'betta1'"),
]

# ------------------------------------------------------------------------------------------------------------
# Hyperparameters: wrong types and out-of-range values

HYPER_CASES = [
    Case(f"{cls.__name__}({kwargs})", lambda t, cls=cls, kwargs=kwargs: cls(make_params([(4,)]), **kwargs), error,
         match)
    for cls, kwargs, error, match in [
        (hf_optim.AdamW, {"lr": "1e-3"}, TypeError, r"lr must be a real number, got '1e-3' \(str\)"),
        # a 1-element tensor lr is valid (torch's contract); others are refused the torch way, with a ValueError
        (hf_optim.AdamW, {"lr": torch.tensor([1e-3, 1e-3])}, ValueError, r"Tensor lr must be 1-element"),
        (hf_optim.AdamW, {"lr": torch.tensor(float("nan"))}, ValueError, r"Invalid learning rate: nan \(lr\)"),
        (hf_optim.AdamW, {"lr": -1.0}, ValueError, r"Invalid learning rate: -1.0 \(lr\)"),
        (hf_optim.AdamW, {"weight_decay": float("inf")}, ValueError, r"Invalid weight_decay value: inf"),
        (hf_optim.AdamW8bit, {"eps": 0.0}, ValueError, r"Invalid epsilon value: 0.0 \(eps\)"),
        (hf_optim.AdamW, {"betas": 0.9}, ValueError, r"betas must be a tuple of 2 floats, got 0.9"),
        (hf_optim.AdamW, {"optim_bits": 16}, ValueError, r"Invalid optim_bits: 16; expected 4, 8 or 32"),
        (hf_optim.Adafactor, {"optim_bits": 4}, ValueError,
         r"Invalid optim_bits: 4; expected 8 or 32 \(the state widths Adafactor"),
        (hf_optim.AdamW, {"min_8bit_size": 4096.0}, ValueError, r"Invalid min_8bit_size: 4096.0"),
        (hf_optim.AdEMAMix, {"t_beta3": 0}, ValueError, r"Invalid t_beta3: 0"),
        (hf_optim.AdEMAMix, {"alpha": float("nan")}, ValueError, r"Invalid alpha: nan"),
        (hf_optim.LAMB, {"max_trust_ratio": -1.0}, ValueError, r"Invalid max_trust_ratio: -1.0"),
        (hf_optim.Lion8bit, {"betas": (0.9, -0.5)}, ValueError, r"Invalid beta parameter at index 1: -0.5 \(beta2\)"),
        (hf_optim.RMSprop, {"alpha": 1.5}, ValueError, r"Invalid alpha value: 1.5"),
        (hf_optim.Adafactor, {"decay_rate": 0.5}, ValueError, r"Invalid decay_rate: 0.5"),
        (hf_optim.Adafactor, {"clip_threshold": 0}, ValueError, r"Invalid clip_threshold: 0; expected"),
        (hf_optim.Adafactor, {"eps": 1e-3}, ValueError, r"eps must be a tuple of two floats \(eps1, eps2\), got 0.001"),
        (hf_optim.Adafactor, {"relative_step": False}, ValueError, r"relative_step=False needs an explicit lr"),
    ]
] + [
    Case("bad value in an added param group",
         lambda t: hf_optim.AdamW(make_params([(4,)])).add_param_group({"params": make_params([(3,)]),
                                                                        "optim_bits": 16}),
         ValueError, r"Invalid optim_bits: 16"),
]

# ------------------------------------------------------------------------------------------------------------
# Gradients and parameters


def non_finite_gradients_are_skipped(_, value):
    """Documented: an element whose gradient is NaN or +-Inf keeps its value and state; the rest trains; the state
    stays finite (8-bit absmax included)."""
    for cls, kwargs in FAMILIES_8BIT:
        params = make_params([(80, 70)])
        opt = build(cls, params, **kwargs)
        run_steps(opt, params, 2)
        set_grads(params, 2)
        params[0].grad[3, :] = value  # a whole row, spanning two 256-blocks
        before = params[0].detach().clone()
        opt.step()
        assert torch.equal(params[0][3], before[3]), cls.__name__
        assert not torch.equal(params[0][4], before[4]), cls.__name__
        for key, state in opt.state[params[0]].items():
            if isinstance(state, torch.Tensor) and state.is_floating_point():
                assert torch.isfinite(state).all(), (cls.__name__, key)


def all_gradients_non_finite(_):
    """Documented: a tensor whose every gradient is NaN does not move and its state stays finite."""
    for cls, kwargs in FAMILIES_8BIT:
        params = make_params([(80, 70)])
        opt = build(cls, params, **kwargs)
        run_steps(opt, params, 1)
        before = params[0].detach().clone()
        params[0].grad = torch.full_like(params[0], float("nan"))
        opt.step()
        assert torch.equal(params[0], before), cls.__name__
        assert all(torch.isfinite(v).all() for v in opt.state[params[0]].values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point()), cls.__name__


def missing_and_frozen_gradients(_):
    """Documented: parameters without a gradient (unused this step, or frozen) are left alone and get no state."""
    for cls, kwargs in FAMILIES_8BIT:
        used, unused, frozen = make_params([(80, 70), (80, 70), (80, 70)])
        frozen.requires_grad_(False)
        opt = build(cls, [used, unused, frozen], **kwargs)
        before = [unused.detach().clone(), frozen.detach().clone()]
        used.grad = torch.randn_like(used)
        opt.step()
        assert torch.equal(unused, before[0]) and torch.equal(frozen, before[1])
        assert unused not in opt.state and frozen not in opt.state and used in opt.state


def zero_size_tensors(_):
    """Documented: empty parameters get (empty) state, count steps, and never fail."""
    for cls, kwargs in FAMILIES_8BIT:
        params = make_params([(0,), (0, 5), (5000,)])
        opt = build(cls, params, **kwargs)
        run_steps(opt, params, 2)
        assert all(opt.state[p]["step"] == 2 for p in params), cls.__name__


def mixed_dtypes_in_one_group(_):
    """Documented: fp32, bf16, fp16 and fp64 parameters in one group each keep their dtype; the state is fp32 or
    uint8 for all of them (never the parameter's dtype), and each trains like its fp32 twin (to its precision)."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    for cls, kwargs in FAMILIES_8BIT:
        mixed = [torch.nn.Parameter(p.detach().to(d)) for p, d in zip(make_params([(80, 70)] * 4), dtypes)]
        reference = make_params([(80, 70)] * 4)
        mixed_opt, reference_opt = build(cls, mixed, **kwargs), build(cls, reference, **kwargs)
        for step in range(2):
            set_grads(reference, step)
            for p, r in zip(mixed, reference):
                p.grad = r.grad.to(p.dtype)
            mixed_opt.step(), reference_opt.step()
        for p, r, dtype in zip(mixed, reference, dtypes):
            assert p.dtype == dtype
            state_dtypes = {v.dtype for v in mixed_opt.state[p].values() if isinstance(v, torch.Tensor)}
            assert state_dtypes <= {torch.float32, torch.uint8}, (cls.__name__, dtype, state_dtypes)
            tolerance = {torch.bfloat16: 5e-2, torch.float16: 5e-3}.get(dtype, 1e-5)
            assert (p.float() - r).abs().max() <= tolerance * r.abs().max(), (cls.__name__, dtype)


def with_gradient(param, grad):
    param.grad = grad
    return param


GRADIENT_CASES = [
    Case("NaN gradients", lambda t: non_finite_gradients_are_skipped(t, float("nan"))),
    Case("+Inf gradients", lambda t: non_finite_gradients_are_skipped(t, float("inf"))),
    Case("-Inf gradients", lambda t: non_finite_gradients_are_skipped(t, -float("inf"))),
    Case("all gradients NaN", all_gradients_non_finite),
    Case("parameters without gradients, frozen parameters", missing_and_frozen_gradients),
    Case("zero-size tensors", zero_size_tensors),
    Case("mixed dtypes in one group", mixed_dtypes_in_one_group),
    Case("complex parameters",
         lambda t: hf_optim.AdamW8bit([with_gradient(torch.nn.Parameter(torch.randn(5000, dtype=torch.complex64)),
                                                     torch.randn(5000, dtype=torch.complex64))]).step(),
         RuntimeError, r"AdamW8bit does not support complex parameters"),
    Case("sparse gradients",
         lambda t: hf_optim.LAMB([with_gradient(torch.nn.Parameter(torch.randn(100, 8)),
                                                torch.randn(100, 8).to_sparse())]).step(),
         RuntimeError, r"LAMB does not support sparse gradients"),
]

# ------------------------------------------------------------------------------------------------------------
# State dicts


def trained_state_dict(cls, shape=(80, 70)):
    params = make_params([shape])
    opt = build(cls, params)
    run_steps(opt, params, 2)
    return opt.state_dict()


def load_into(cls, state_dict, shape=(80, 70)):
    build(cls, make_params([shape])).load_state_dict(state_dict)


def bitsandbytes_lion_state_dict():
    params = make_params([(80, 70)])
    opt = bnb.optim.Lion8bit(params)
    run_steps(opt, params, 2)
    return opt.state_dict()


def with_old_block_size(state_dict):
    quant = state_dict["state"][0][QUANT_STATE_KEY]
    blocks_2048 = -(-80 * 70 // 2048)
    quant["absmax1"], quant["absmax2"] = torch.ones(blocks_2048), torch.ones(blocks_2048)
    return state_dict


STATE_DICT_CASES = [
    Case("state dict of another hf_optim algorithm",
         lambda t: load_into(hf_optim.AdamW8bit, trained_state_dict(hf_optim.Lion8bit)), StateDictError,
         r"saved by hf_optim's 'lion' optimizer; AdamW8bit runs 'adamw'"),
    Case("bitsandbytes state dict of another algorithm",
         lambda t: load_into(hf_optim.AdamW8bit, bitsandbytes_lion_state_dict()), StateDictError,
         r"has slots \['state1'\], but AdamW8bit \(adamw\) keeps \['state1', 'state2'\]"),
    Case("state dict of another parameter layout",
         lambda t: load_into(hf_optim.LAMB8bit, trained_state_dict(hf_optim.LAMB8bit), shape=(70, 80)),
         StateDictError, r"state1 has shape \(80, 70\), expected \(70, 80\)"),
    Case("state dict with the old 2048-element blocks",
         lambda t: load_into(hf_optim.AdamW8bit, with_old_block_size(trained_state_dict(hf_optim.AdamW8bit))),
         StateDictError, r"2048-element blocks of bitsandbytes <= 0.43"),
    Case("a model's state dict given to the optimizer",
         lambda t: load_into(hf_optim.AdamW8bit, torch.nn.Linear(80, 70).state_dict()), StateDictError,
         r"not an optimizer state dict .*got \['bias', 'weight'\]"),
]

# ------------------------------------------------------------------------------------------------------------
# Truncated checkpoint files


def fake_checkpoint(folder: Path, step: int) -> Path:
    """A checkpoint folder with the files the Trainer writes (small, but the real formats)."""
    from safetensors.torch import save_file

    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"weight": torch.randn(64, 64)}, path / "model.safetensors")
    torch.save(trained_state_dict(hf_optim.AdamW8bit), path / "optimizer.pt")
    torch.save({"last_epoch": step}, path / "scheduler.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
    return path


def truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def truncated_checkpoint_file(tmp_path: Path, name: str, expected: str) -> None:
    """Documented: a checkpoint with a truncated file is reported and skipped by last_complete_checkpoint."""
    older, newer = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    if name.endswith("/"):  # a torch.distributed.checkpoint folder whose .metadata was never written
        (newer / name).mkdir()
        (newer / name / "__0_0.distcp").write_bytes(b"\0" * 64)
    else:
        truncate(newer / name)
    assert any(expected in problem for problem in checkpoint_problems(newer)), checkpoint_problems(newer)
    assert checkpoint_problems(older) == []
    assert last_complete_checkpoint(tmp_path) == str(older)


CHECKPOINT_CASES = [
    Case(f"truncated {name}", lambda t, name=name, expected=expected: truncated_checkpoint_file(t, name, expected))
    for name, expected in [
        ("optimizer.pt", "optimizer.pt: not a complete torch.save archive"),
        ("model.safetensors", "model.safetensors: truncated safetensors data"),
        ("trainer_state.json", "trainer_state.json is not valid JSON"),
        ("optimizer_0/", "optimizer_0/ has shards but no .metadata"),
    ]
]

# ------------------------------------------------------------------------------------------------------------
# Recipes (the hf-optim CLI's input)


def load_recipe_text(folder: Path, text: str):
    from hf_optim.recipes import load_recipe

    path = folder / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path)


def recipe_error():
    from hf_optim.recipes import RecipeError

    return RecipeError


RECIPE_CASES = [
    Case("recipe that is a list", lambda t: load_recipe_text(t, "- a\n- b\n"), recipe_error(), r"must be a mapping"),
    Case("recipe that is a scalar", lambda t: load_recipe_text(t, "42\n"), recipe_error(), r"must be a mapping"),
    Case("recipe section that is not a mapping", lambda t: load_recipe_text(t, "training: 3\n"), recipe_error(),
         r"training"),
]

CASES = NAME_CASES + HYPER_CASES + GRADIENT_CASES + STATE_DICT_CASES + CHECKPOINT_CASES + RECIPE_CASES


def assert_raised_by_a_check(info: pytest.ExceptionInfo) -> None:
    """The error comes from validation code, not from inside a compute path or its math (hf_optim's or torch's
    ops). A state format's own checks of a loaded state dict (``hf_optim/formats``) are validation code."""
    innermost = Path(traceback.extract_tb(info.tb)[-1].filename).as_posix()
    assert "hf_optim/kernels/" not in innermost and "hf_optim/numerics/" not in innermost, innermost
    assert "torch/_ops" not in innermost and "torch/_tensor" not in innermost, innermost


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input(case: Case, tmp_path):
    if case.raises is None:
        case.run(tmp_path)
        return
    with pytest.raises(case.raises, match=case.match) as info:
        case.run(tmp_path)
    assert_raised_by_a_check(info)


def test_every_case_has_a_unique_id():
    assert len({case.id for case in CASES}) == len(CASES)


def test_safetensors_header_check_reads_the_real_format(tmp_path):
    """The safetensors check above is only meaningful if a whole file passes: the header arithmetic is right."""
    from safetensors.torch import save_file

    save_file({"a": torch.randn(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    assert struct.unpack("<Q", data[:8])[0] > 0
    assert checkpoint_problems(tmp_path) == ["trainer_state.json is missing (the Trainer writes it last)"]
