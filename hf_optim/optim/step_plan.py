"""The step plan of an :class:`~hf_optim.optim.base.HfOptimizer`: what a step will update, checked before anything
changes, and the numbering that bf16 stochastic rounding's random bits depend on.

A plan lists, per param group, every parameter with a gradient, its local tensors and its per-parameter overrides
(bitsandbytes' manager or the parameter's attribute; also recorded by position, see :class:`Positions`). Every entry
is checked first, so a refused step changes no parameter, state or step counter.
"""

from __future__ import annotations

import torch

from hf_optim.formats import with_overrides
from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.torch_path import cpu_compile
from hf_optim.numerics import rounding
from hf_optim.optim.overrides import (
    PARAM_OVERRIDES_ATTR,
    bitsandbytes_config,
    bitsandbytes_manager,
    check_override_keys,
    module_overrides,
)
from hf_optim.optim.sharding import local_tensor

SR_KEY, SR_SEED_KEY = "bf16_stochastic_round", "bf16_stochastic_round_seed"
"""Param-group keys of bf16 stochastic rounding: on or off, and the seed of its random bits (default 0)."""

Plan = list[tuple[int, dict, list[tuple]]]
"""``[(group index, group, [(param, local param, local grad, overrides)])]``."""


class Positions:
    """Per-parameter attributes recorded by position in ``param_groups`` when a group is added: overrides
    (:data:`PARAM_OVERRIDES_ATTR`) and a hybrid's route mark. accelerate's FSDP2 preparation swaps each parameter for
    a new DTensor parameter at the same place, and the attributes stay behind on the old one.

    A recorded attribute passes only to a parameter of the recorded shape (a DTensor's shape is the whole
    tensor's): DeepSpeed's ZeRO puts one flat partition of many tensors where a group's first parameter was, and
    that parameter's settings (an embedding's 32-bit state) would otherwise cover every tensor of the partition."""

    def __init__(self, mark_attr: str | None = None) -> None:
        self.mark_attr = mark_attr
        self.overrides: dict[tuple[int, int], dict] = {}
        self.marks: dict[tuple[int, int], str] = {}
        self.shapes: dict[tuple[int, int], tuple[int, ...]] = {}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("shapes", {})  # pickled before shapes were recorded: no shape check for those

    def record(self, group_index: int, params: list) -> None:
        for index, p in enumerate(params):
            overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
            if overrides:
                self.overrides[group_index, index] = dict(overrides)
            mark = getattr(p, self.mark_attr, None) if self.mark_attr else None
            if mark is not None:
                self.marks[group_index, index] = mark
            if overrides or mark is not None:
                self.shapes[group_index, index] = tuple(p.shape)

    def holds(self, group_index: int, index: int, p) -> bool:
        """Whether ``p`` may take what was recorded at its place: it has the recorded parameter's shape."""
        shape = self.shapes.get((group_index, index))
        return shape is None or tuple(p.shape) == shape

    def restore_marks(self, param_groups: list[dict]) -> None:
        """Mark parameters that replaced marked ones (same group, same index, same shape) with the recorded mark."""
        for (group_index, index), mark in self.marks.items():
            params = param_groups[group_index]["params"] if group_index < len(param_groups) else []
            if index < len(params) and getattr(params[index], self.mark_attr, None) is None \
                    and self.holds(group_index, index, params[index]):
                setattr(params[index], self.mark_attr, mark)


class StepPlan:
    """Plans steps and numbers states for an optimizer (see the module). ``check_group(group)``: the optimizer's
    validation, also applied to every group with a parameter's overrides."""

    def __init__(self, owner: str, check_group, positions: Positions) -> None:
        self.owner = owner
        self.check_group = check_group
        self.positions = positions
        self.ordinals: dict[int, int] = {}  # during a step with stochastic rounding: id(state) -> param ordinal
        self.chunk_bases: dict = {}

    def plan(self, param_groups: list[dict], only: tuple[int, int] | None = None) -> Plan:
        """The plan for every parameter with a gradient (``only``: the one at ``(group index, index)``)."""
        if self.positions.mark_attr:
            self.positions.restore_marks(param_groups)
        manager = bitsandbytes_manager()
        by_module = module_overrides(manager) if manager is not None else {}
        groups = list(enumerate(param_groups)) if only is None else [(only[0], param_groups[only[0]])]
        plan = []
        for group_index, group in groups:
            members = enumerate(group["params"]) if only is None else [(only[1], group["params"][only[1]])]
            entries = []
            checked = bool(self.positions.overrides) or manager is not None or group[SR_KEY]
            for index, p in members:
                if p.grad is None:
                    continue
                param, grad = local_tensor(p), local_tensor(p.grad)
                overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
                if checked or overrides or grad.is_sparse or param.is_complex():
                    # the rare cases, in a function of their own; a plain tensor (most of them) costs no call
                    overrides = self._checked(p, param, grad, overrides, group, group_index, index, manager,
                                              by_module)
                entries.append((p, param, grad, overrides))
            plan.append((group_index, group, entries))
        # HF_OPTIM_BACKEND and HF_OPTIM_COMPILE are checked now, not when the first group is already updated: a bad
        # value raises here, and a forced Triton backend that cannot run on some device raises for that device.
        cpu_compile.compile_mode()
        if kernel_backend.forced_backend() == "triton":
            for device in {param.device for _, _, entries in plan for _, param, _, _ in entries}:
                kernel_backend.uses_triton(device)
        return plan

    def _checked(self, p, param, grad, overrides, group: dict, group_index: int, index: int, manager,
                 by_module) -> dict | None:
        """A parameter's overrides, checked, and the checks of its tensors: what a step refuses before it changes
        anything."""
        where = f"parameter {index} of param group {group_index}"
        if grad.is_sparse:
            raise RuntimeError(f"{self.owner} does not support sparse gradients")
        if param.is_complex():
            raise RuntimeError(f"{self.owner} does not support complex parameters")
        if (overrides is None and self.positions.overrides) or manager is not None:
            overrides = self.overrides(p, group_index, index, manager, by_module)
        if overrides:
            check_override_keys(overrides, group, self.owner, where)
            try:
                self.check_group(with_overrides(group, overrides))
            except (TypeError, ValueError) as error:
                raise type(error)(f"{where}, per-parameter override {overrides!r}: {error}") from error
        if (overrides or {}).get(SR_KEY, group[SR_KEY]):
            check_stochastic_param(param, where)
        return overrides

    def overrides(self, p: torch.Tensor, group_index: int, index: int, manager=None, by_module=None):
        """``p``'s per-parameter settings (see :mod:`hf_optim.optim.overrides`): its attribute, else those recorded
        at its position when the optimizer was built; then bitsandbytes' manager's, if it has any."""
        overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
        if overrides is None and self.positions.overrides and self.positions.holds(group_index, index, p):
            overrides = self.positions.overrides.get((group_index, index))
        if manager is None:
            return overrides
        managed = bitsandbytes_config(manager, by_module, p, (group_index, index))
        return {**overrides, **managed} if overrides and managed else managed or overrides

    # bf16 stochastic rounding (hf_optim.numerics.rounding)
    def number_states(self, param_groups: list[dict], states: dict) -> None:
        """Number every parameter's state by the parameter's place in torch's state-dict order (the ordinal in
        the counters of its random bits), when some group rounds stochastically."""
        self.ordinals = {}
        if not any(group.get(SR_KEY) for group in param_groups):
            return
        params = [p for group in param_groups for p in group["params"]]
        for ordinal, p in enumerate(params):
            state = states.get(p)
            if state is not None:
                self.ordinals.setdefault(id(state), ordinal)

    def stream(self, group: dict, state: dict, param: torch.Tensor) -> rounding.Stream | None:
        """The stochastic rounding of ``param``'s new values at this step, or None (rounding to nearest): only
        for bf16 parameters of groups with ``bf16_stochastic_round``; fp32 parameters need no rounding."""
        if not group[SR_KEY] or param.dtype != torch.bfloat16:
            return None
        return rounding.Stream(rounding.key_tensor(group[SR_SEED_KEY], state["step"]),
                               ordinal=self.ordinals[id(state)])

    def flat_stream(self, group: dict, step: int, param: torch.Tensor, ordinals: dict[int, int]):
        """:meth:`stream` for a multi-tensor batch, ``ordinals`` by member index (chunk bases are cached)."""
        if not group[SR_KEY] or param.dtype != torch.bfloat16:
            return None
        return rounding.Stream(rounding.key_tensor(group[SR_SEED_KEY], step), ordinals=ordinals,
                               cache=self.chunk_bases)


def check_stochastic_param(param: torch.Tensor, where: str) -> None:
    if param.dtype == torch.float16:
        raise ValueError(
            f"bf16_stochastic_round rounds into bfloat16 parameters; {where} is float16, which would still be "
            "rounded to nearest. Keep float16 parameters in a param group with bf16_stochastic_round=False, or "
            "train them in bfloat16 or float32"
        )
    rounding.check_index_range(param.numel(), where)
