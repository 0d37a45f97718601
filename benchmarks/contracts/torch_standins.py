"""hf_optim's classes as entries of PyTorch's ``optim_db``, so that PyTorch's own generic optimizer tests
(``test/test_optim.py``'s ``TestOptimRenewed``, from a PyTorch checkout) run over them unmodified.

``TestOptimRenewed`` is written against ``torch.testing._internal.common_optimizers.optim_db``: one
``OptimizerInfo`` per torch.optim algorithm, with its sample inputs (constructor arguments), error inputs, lr
schedulers and per-test decorators. :func:`standin_infos` builds one ``OptimizerInfo`` per public hf_optim
optimizer class from the info of the torch.optim algorithm it stands in for (:data:`STANDS_IN_FOR`), its inputs
mapped to hf_optim's arguments; ``hf_optim_peer_plugin`` puts them in ``optim_db``'s place before the test file is
imported. Nothing of PyTorch's is copied here: the infos, inputs and decorators are read from the installed torch.

Every input or test that cannot apply to hf_optim is left out by one of the rules below, each with its reason, and
:func:`report` prints what each rule left out; nothing is dropped without a rule. A rule is decided from the
arguments alone, never from what a run gave.
"""

from __future__ import annotations

import inspect
import re
import unittest
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import hf_optim

# ---------------------------------------------------------------------------------------------------------------
# Which torch.optim algorithm each hf_optim algorithm stands in for (every twin of a base class: 32-bit, 8-bit,
# 4-bit, rank-1 4-bit, fp8, paged, stands in with it). Lion, LAMB and AdEMAMix have no torch.optim namesake: they
# take torch's AdamW inputs (their nearest relative: betas, decoupled weight decay), so the contracts the tests
# check (direction of the loss, param groups, lr schedulers, state dicts, hooks, errors, deepcopy) cover them too.
STANDS_IN_FOR: dict[type, str] = {
    hf_optim.AdamW: "AdamW",
    hf_optim.RMSprop: "RMSprop",
    hf_optim.Adafactor: "Adafactor",
    hf_optim.Muon: "Muon",
    hf_optim.Lion: "AdamW",
    hf_optim.LAMB: "AdamW",
    hf_optim.AdEMAMix: "AdamW",
}

# torch's implementation flags: hf_optim has none of them (its PyTorch, compiled and Triton paths are compared bit
# for bit by its own tests), so the stand-ins declare no supported_impls, and the tests built on a flag
# (test_foreach_matches_forloop, test_fused_*, test_set_default_dtype_works_with_foreach, test_peak_memory_foreach,
# test_defaults_changed_to_foreach, test_mixed_device_dtype, test_cpu_load_state_dict) are not generated for them.
IMPL_FLAGS = ("foreach", "fused", "differentiable", "capturable")

NOT_GENERATED = (
    "test_foreach_matches_forloop, test_fused_matches_forloop, test_fused_error_on_params_on_meta, "
    "test_fused_large_tensor, test_cpu_load_state_dict, test_set_default_dtype_works_with_foreach, "
    "test_peak_memory_foreach, test_foreach_large_tensor, test_defaults_changed_to_foreach, "
    "test_mixed_device_dtype: not generated for hf_optim's classes (they declare no foreach/fused/differentiable "
    "implementation: hf_optim has no such flags; tests/kernels/test_multi_tensor.py compares its PyTorch, compiled "
    "and Triton paths bit for bit instead); test_rosenbrock_sparse: not generated (no sparse gradients, as torch's "
    "AdamW, RMSprop, Adafactor and Muon); test_second_order_optims_return_consistent_types: LBFGS only"
)


@dataclass(frozen=True)
class Rule:
    """One reason an input of torch's cannot be given to an hf_optim class."""

    name: str
    reason: str
    applies: Callable[[type, dict[str, Any]], bool]


def _has_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)
    )


def _accepts(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "params"}


INPUT_RULES: tuple[Rule, ...] = (
    Rule("implementation flag", "hf_optim has no foreach / fused / differentiable / capturable argument",
         lambda cls, kw: any(flag in kw for flag in IMPL_FLAGS)),
    Rule("maximize", "hf_optim's classes take bitsandbytes' arguments: there is no maximize",
         lambda cls, kw: bool(kw.get("maximize", False))),
    Rule("amsgrad=True", "refused by hf_optim (AMSGrad needs a third state): `amsgrad=True is not supported`",
         lambda cls, kw: bool(kw.get("amsgrad", False))),
    Rule("RMSprop centered / momentum", "refused by hf_optim's RMSprop (not implemented, nor in bitsandbytes)",
         lambda cls, kw: issubclass(cls, hf_optim.RMSprop)
         and (bool(kw.get("centered", False)) or kw.get("momentum", 0) != 0)),
    Rule("tensor betas", "hf_optim takes betas as numbers (torch's tensor betas serve capturable/compiled steps)",
         lambda cls, kw: _has_tensor(kw.get("betas"))),
    Rule("no such argument", "the hf_optim class has no argument of that name",
         lambda cls, kw: bool(set(kw) - _accepts(cls))),
)

# error inputs whose message hf_optim words for its own argument or does not raise on purpose
ERROR_RULES: tuple[tuple[str, str, Callable[[type, Any], bool]], ...] = (
    ("Muon 1-D parameters",
     "hf_optim's Muon steps non-2-D parameters with its AdamW rule (use_muon=None routes them; "
     "docs/guide/optimizers.md#muon) where torch.optim.Muon refuses them",
     lambda cls, err: "only supports 2D parameters" in err.error_regex),
    ("renamed argument",
     "the input names torch's argument (Adafactor's d, beta2_decay), and torch's message names it too; hf_optim "
     "checks the same value under its own name (clip_threshold, decay_rate) in its own words",
     lambda cls, err: bool(set(err.optimizer_error_input.kwargs) & set(RENAMES.get(_base(cls), {})))),
)

# torch's argument -> hf_optim's, per algorithm
RENAMES: dict[type, dict[str, str]] = {
    hf_optim.Adafactor: {"beta2_decay": "decay_rate", "d": "clip_threshold"},
}

# inputs of hf_optim's own, added to torch's (labelled "(hf_optim)" in the test's messages): the settings that
# switch on a state or a schedule torch's inputs never reach
EXTRA_INPUTS: dict[type, list[tuple[str, dict[str, Any]]]] = {
    hf_optim.AdEMAMix: [("(hf_optim) scheduled alpha and beta3", {"t_alpha": 20, "t_beta3": 20})],
    hf_optim.Adafactor: [("(hf_optim) first moment, 8-bit where the class has it",
                          {"beta1": 0.9, "optim_bits": 8, "relative_step": False, "lr": 1e-2})],
}

# tests generated but skipped, by rule, with the reason pytest prints (-rs)
SKIPPED_TESTS: tuple[tuple[str, str], ...] = (
    ("test_complex", "hf_optim refuses complex parameters (RuntimeError before anything changes, "
                     "docs/guide/optimizers.md: 'A refused step changes nothing')"),
    ("test_complex_2d", "hf_optim refuses complex parameters (as test_complex)"),
)


def _base(cls: type) -> type:
    return next(base for base in STANDS_IN_FOR if issubclass(cls, base))


def map_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch's sample kwargs as hf_optim's arguments (renames, Adafactor's explicit lr, AdEMAMix's third beta,
    quantized state on the tests' tiny tensors)."""
    base = _base(cls)
    out = {RENAMES.get(base, {}).get(key, key): value for key, value in kwargs.items()}
    if base is hf_optim.Adafactor and "lr" in out:
        out.setdefault("relative_step", False)  # torch's Adafactor takes an lr; hf_optim's then needs this
    if base is hf_optim.AdEMAMix and isinstance(out.get("betas"), (tuple, list)) and len(out["betas"]) == 2:
        out["betas"] = (*out["betas"], inspect.signature(cls).parameters["betas"].default[2])
    if "min_8bit_size" in _accepts(cls):
        out.setdefault("min_8bit_size", 0)  # the tests' tensors have 2 to 50 elements: give them the class's format
    return out


@dataclass
class Ledger:
    """What each rule left out (each test asks for the inputs again: each input is counted once)."""

    dropped: dict[str, set[tuple[str, str]]] = field(default_factory=dict)

    def note(self, rule: str, cls: type, what: str) -> None:
        self.dropped.setdefault(rule, set()).add((cls.__name__, what))


LEDGER = Ledger()


def _first_rule(cls: type, kwargs: dict[str, Any]) -> Rule | None:
    # the rules judge the mapped arguments, but the implementation flags and maximize are torch's own keys
    return next((rule for rule in INPUT_RULES if rule.applies(cls, kwargs)), None)


def _inputs_func(cls: type, torch_info: Any) -> Callable[..., list]:
    from torch.testing._internal.common_optimizers import OptimizerInput

    def optim_inputs_func(device: Any, dtype: Any = None) -> list:
        inputs = []
        for sample in torch_info.optim_inputs_func(device=device, dtype=dtype):
            kwargs = map_kwargs(cls, sample.kwargs)
            rule = _first_rule(cls, kwargs)
            if rule is not None:
                LEDGER.note(rule.name, cls, f"{sample.desc}: {sample.kwargs}")
                continue
            inputs.append(OptimizerInput(params=None, kwargs=kwargs, desc=sample.desc))
        for desc, kwargs in EXTRA_INPUTS.get(_base(cls), []):
            kwargs = {key: value for key, value in kwargs.items() if key in _accepts(cls)}
            inputs.append(OptimizerInput(params=None, kwargs=map_kwargs(cls, kwargs), desc=desc))
        return inputs

    return optim_inputs_func


def _error_inputs_func(cls: type, torch_info: Any) -> Callable[..., list] | None:
    if torch_info.optim_error_inputs_func is None:
        return None
    from torch.testing._internal.common_optimizers import ErrorOptimizerInput, OptimizerInput

    torch_name = torch_info.optim_cls.__name__

    def optim_error_inputs_func(device: Any, dtype: Any) -> list:
        inputs = []
        for err in torch_info.optim_error_inputs_func(device=device, dtype=dtype):
            skip = next((name for name, _, applies in ERROR_RULES if applies(cls, err)), None)
            kwargs = map_kwargs(cls, err.optimizer_error_input.kwargs)
            rule = _first_rule(cls, kwargs)
            if skip is None and rule is not None:
                skip = rule.name
            if skip is not None:
                LEDGER.note(skip, cls, f"error input {err.error_regex!r}: {err.optimizer_error_input.kwargs}")
                continue
            # a message that names the optimizer names hf_optim's class ("Muon8bit does not support complex ...")
            regex = re.sub(rf"^{torch_name}\b", re.escape(cls.__name__), err.error_regex)
            sample = OptimizerInput(params=err.optimizer_error_input.params, kwargs=kwargs,
                                    desc=err.optimizer_error_input.desc)
            inputs.append(ErrorOptimizerInput(sample, error_type=err.error_type, error_regex=regex,
                                              error_on=err.error_on))
        return inputs

    return optim_error_inputs_func


def _default_weight_decay(cls: type) -> float:
    return inspect.signature(cls).parameters["weight_decay"].default


# test_step_is_noop_for_zero_grads expects a zero gradient to leave the parameter unchanged, skipping only inputs
# that name a weight_decay != 0, and gives the class named "AdamW" (torch's, which decays by default) lr=1e-5 so that
# its decay stays under the comparison's tolerance: a class whose own default weight_decay is not 0 decays the
# parameter, as its algorithm says, and fails by its name
ZERO_GRAD_TEST = "test_step_is_noop_for_zero_grads"


def _skips(cls: type) -> list:
    from torch.testing._internal.opinfo.core import DecorateInfo

    skips = [DecorateInfo(unittest.skip(reason), "TestOptimRenewed", test) for test, reason in SKIPPED_TESTS]
    decay = _default_weight_decay(cls)
    if decay != 0:
        reason = (f"{cls.__name__} decays by default (weight_decay={decay}) as its algorithm says; the test skips "
                  f"only inputs that name weight_decay and exempts the class named AdamW by name (lr=1e-5)")
        skips.append(DecorateInfo(unittest.skip(reason), "TestOptimRenewed", ZERO_GRAD_TEST))
    return skips


# The default selection: every algorithm at 32 bits and quantized (8-bit), every other state format once (on AdamW),
# and paging once per Adam-like family; the twins of a class share its algorithm and differ by state format, an
# independent axis, so this covers each algorithm and each format. About 40 tests a class: all 53 classes are some
# 2,200 tests, an hour and more on a shared 2-core machine (``--classes all``).
REPRESENTATIVE = (
    "AdamW32bit", "AdamW8bit", "AdamW4bit", "AdamW4bitRank1", "AdamWFp8", "PagedAdamW8bit",
    "AdEMAMix32bit", "AdEMAMix8bit", "PagedAdEMAMix8bit", "LAMB32bit", "LAMB8bit", "Lion32bit", "Lion8bit",
    "RMSprop32bit", "RMSprop8bit", "Muon32bit", "Muon8bit", "Adafactor",
)


def hf_optim_classes(selection: str = "representative") -> list[type]:
    """The public optimizer classes to run, in hf_optim.__all__'s order: ``representative`` (REPRESENTATIVE),
    ``all``, or names separated by commas."""
    classes = (getattr(hf_optim, name) for name in hf_optim.__all__)
    every = [cls for cls in classes if isinstance(cls, type) and issubclass(cls, tuple(STANDS_IN_FOR))]
    if selection == "all":
        return every
    wanted = REPRESENTATIVE if selection == "representative" else tuple(n.strip() for n in selection.split(","))
    known = {cls.__name__ for cls in every}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise SystemExit(f"error: unknown hf_optim class {', '.join(unknown)}; valid: all, representative, or "
                         f"names among {', '.join(sorted(known))}")
    return [cls for cls in every if cls.__name__ in wanted]


def standin_infos(torch_db: list, selection: str = "representative") -> list:
    """One OptimizerInfo per hf_optim class, built from the info of the torch algorithm it stands in for."""
    from torch.testing._internal.common_optimizers import OptimizerInfo

    by_name = {info.optim_cls.__name__: info for info in torch_db}
    infos = []
    for cls in hf_optim_classes(selection):
        torch_info = by_name[STANDS_IN_FOR[_base(cls)]]
        infos.append(OptimizerInfo(
            cls,
            optim_inputs_func=_inputs_func(cls, torch_info),
            optim_error_inputs_func=_error_inputs_func(cls, torch_info),
            scheduler_inputs=torch_info.scheduler_inputs,
            supported_impls=(),
            not_og_supported_flags=torch_info.not_og_supported_flags,
            supports_sparse=False,
            has_capturable_arg=False,
            supports_complex=True,  # generated, then skipped by SKIPPED_TESTS with the reason
            supports_fused_on=(),
            decorators=(*(torch_info.decorators or ()), *_skips(cls)),
        ))
    return infos


def plain_infos(torch_db: list) -> list:
    """torch's own infos of the algorithms hf_optim's classes stand in for: the baseline (--plain)."""
    wanted = set(STANDS_IN_FOR.values())
    return [info for info in torch_db if info.optim_cls.__name__ in wanted]


def rules_text() -> list[str]:
    pairs = ", ".join(f"{base.__name__} (and twins) for torch.optim.{name}" for base, name in STANDS_IN_FOR.items())
    lines = [f"stand-ins: {pairs}"]
    lines.append("mapping: torch's inputs get hf_optim's argument names (Adafactor: beta2_decay->decay_rate, "
                 "d->clip_threshold, an lr adds relative_step=False), AdEMAMix a third beta (its default), every "
                 "class with min_8bit_size gets 0 so the tests' tiny tensors hold the class's own state format")
    lines += [f"input rule '{r.name}': {r.reason}" for r in INPUT_RULES]
    lines += [f"error-input rule '{name}': {reason}" for name, reason, _ in ERROR_RULES]
    lines += [f"skipped test {test}: {reason}" for test, reason in SKIPPED_TESTS]
    lines.append(f"skipped test {ZERO_GRAD_TEST} for each class whose default weight_decay is not 0: the test "
                 "skips only inputs that name weight_decay, and exempts by name the class called AdamW")
    lines += [f"extra input for {b.__name__} (and twins): {desc} {kw}" for b, extra in EXTRA_INPUTS.items()
              for desc, kw in extra]
    lines.append(NOT_GENERATED)
    return lines


def report() -> list[str]:
    """What each rule left out in this run (per rule: how many inputs, of which classes, one example)."""
    lines = []
    for rule, dropped in sorted(LEDGER.dropped.items()):
        classes = sorted({cls for cls, _ in dropped})
        whats = sorted({what for _, what in dropped})
        lines.append(f"'{rule}': {len(dropped)} inputs left out, over {len(classes)} classes: {'; '.join(whats)}")
    return lines
