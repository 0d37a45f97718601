"""Stepping an :class:`~hf_optim.optim.base.HfOptimizer`: planning a step, running the plan, per-parameter
overrides, bf16 stochastic rounding streams and gradient release's hooks.

:class:`Stepping` is a mixin of ``HfOptimizer``. A step is planned first (every parameter with a gradient is checked
before anything changes), then run group by group: the state of new parameters is created lazily, all at once, and
each group's parameters go through the dispatch (:mod:`hf_optim.optim.dispatch`).
"""

from __future__ import annotations

import torch

from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.formats import with_overrides
from hf_optim.kernels.torch_path import cpu_compile, rounding
from hf_optim.optim import sharding
from hf_optim.optim.overrides import (
    PARAM_OVERRIDES_ATTR,
    bitsandbytes_config,
    bitsandbytes_manager,
    check_override_keys,
    module_overrides,
    update_overrides,
)
from hf_optim.optim.release import GradientRelease, release_unsupported_reason
from hf_optim.optim.sharding import local_tensor

SR_KEY, SR_SEED_KEY = "bf16_stochastic_round", "bf16_stochastic_round_seed"
"""Param-group keys of bf16 stochastic rounding: on or off, and the seed of its random bits (default 0)."""


def _override_key(hyper: dict):
    """A key that puts parameters with equal hyperparameter overrides in one update call."""
    key = tuple(sorted(hyper.items()))
    try:
        hash(key)
    except TypeError:  # an unhashable value: this parameter gets a call of its own
        return object()
    return key


class Stepping:
    """Mixin of :class:`~hf_optim.optim.base.HfOptimizer`: planning and running a step (see the module)."""

    # ----------------------------------------------------------------------------------------------------
    # Planning and running a step
    def _run_plan(self, plan: list[tuple[int, dict, list[tuple]]]) -> None:
        """Step the parameters of a :meth:`_plan_step` plan."""
        if self.is_paged:
            self._allocate.begin_step()
        for group_index, group, entries in plan:
            # State is created lazily, for all of a step's new parameters at once (flat buffers hold them together).
            fresh = [(p, param, overrides) for p, param, _, overrides in entries if not self.state[p]]
            self._create_states(group, fresh)
            if group_index == 0 or fresh:
                self._number_states()
            items, overridden = [], {}
            for p, param, grad, overrides in entries:
                state = self.state[p]
                state["step"] += 1
                if p.numel() == 0:  # an empty local shard still joins its shard group's reductions
                    continue
                if self.is_paged:
                    self._allocate.prefetch(state, param.device)  # only right after a memory shortage: no sync
                hyper = update_overrides(overrides) if overrides else None
                if hyper:  # per-parameter hyperparameters (bitsandbytes' manager): updated with its own group
                    overridden.setdefault(_override_key(hyper), ({**group, **hyper}, []))[1].append(
                        (param, grad, state, p)
                    )
                else:
                    items.append((param, grad, state, p))
            self._update_group(group, group_index, items)
            for effective_group, group_items in overridden.values():
                self._update_group(effective_group, group_index, group_items)

    def _plan_step(self, only: tuple[int, int] | None = None) -> list[tuple[int, dict, list[tuple]]]:
        """``(group index, group, [(param, local param, local grad, overrides)])`` for every parameter with a
        gradient (``only``: the one parameter at ``(group index, index)``), after checking all of them, so that a
        refused step changes nothing: no parameter, state or step counter."""
        manager = bitsandbytes_manager()
        by_module = module_overrides(manager) if manager is not None else {}
        plan = []
        if only is None:
            groups = list(enumerate(self.param_groups))
        else:
            groups = [(only[0], self.param_groups[only[0]])]
        for group_index, group in groups:
            entries = []
            members = enumerate(group["params"]) if only is None else [(only[1], group["params"][only[1]])]
            for index, p in members:
                grad = p.grad
                if grad is None:
                    continue
                param, grad = local_tensor(p), local_tensor(grad)
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if param.is_complex():
                    raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
                overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
                if (overrides is None and self._overrides_by_position) or manager is not None:
                    overrides = self._param_overrides(p, group_index, index, manager, by_module)
                if overrides:
                    self._check_overrides(overrides, group, f"parameter {index} of param group {group_index}")
                if (overrides or {}).get(SR_KEY, group[SR_KEY]):
                    self._check_stochastic_param(param, f"parameter {index} of param group {group_index}")
                entries.append((p, param, grad, overrides))
            plan.append((group_index, group, entries))
        # HF_OPTIM_BACKEND and HF_OPTIM_COMPILE are checked now, not when the first group is already updated: a bad
        # value raises here, and a forced Triton backend that cannot run on some device raises for that device.
        cpu_compile.compile_mode()
        if kernel_backend.forced_backend() == "triton":
            for device in {param.device for _, _, entries in plan for _, param, _, _ in entries}:
                kernel_backend.uses_triton(device)
        return plan

    def _param_overrides(self, p: torch.Tensor, group_index: int, index: int, manager=None, by_module=None):
        """``p``'s per-parameter settings (see :mod:`hf_optim.optim.overrides`): its attribute, else those recorded
        at its position when the optimizer was built; then bitsandbytes' manager's, if it has any."""
        overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
        if overrides is None and self._overrides_by_position:
            overrides = self._overrides_by_position.get((group_index, index))
        if manager is None:
            return overrides
        managed = bitsandbytes_config(manager, by_module, p, (group_index, index))
        return {**overrides, **managed} if overrides and managed else managed or overrides

    def _check_overrides(self, overrides: dict, group: dict, where: str) -> None:
        check_override_keys(overrides, group, type(self).__name__, where)
        try:
            self._check_group(with_overrides(group, overrides))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}, per-parameter override {overrides!r}: {error}") from error

    # ----------------------------------------------------------------------------------------------------
    # bf16 stochastic rounding (hf_optim.kernels.torch_path.rounding)
    def _stream(self, group: dict, state: dict, param: torch.Tensor) -> rounding.Stream | None:
        """The stochastic rounding of ``param``'s new values at this step, or None (rounding to nearest): only
        for bf16 parameters of groups with ``bf16_stochastic_round``; fp32 parameters need no rounding."""
        if not group[SR_KEY] or param.dtype != torch.bfloat16:
            return None
        return rounding.Stream(rounding.key_tensor(group[SR_SEED_KEY], state["step"]),
                               ordinal=self._ordinals[id(state)])

    def _flat_stream(self, group: dict, step: int, param: torch.Tensor, ordinals: dict[int, int]):
        """:meth:`_stream` for a multi-tensor batch, ``ordinals`` by member index (chunk bases are cached)."""
        if not group[SR_KEY] or param.dtype != torch.bfloat16:
            return None
        return rounding.Stream(rounding.key_tensor(group[SR_SEED_KEY], step), ordinals=ordinals,
                               cache=self.__dict__.setdefault("_chunk_bases", {}))

    @staticmethod
    def _check_stochastic_param(param: torch.Tensor, where: str) -> None:
        if param.dtype == torch.float16:
            raise ValueError(
                f"bf16_stochastic_round rounds into bfloat16 parameters; {where} is float16, which would still be "
                "rounded to nearest. Keep float16 parameters in a param group with bf16_stochastic_round=False, or "
                "train them in bfloat16 or float32"
            )
        rounding.check_index_range(param.numel(), where)

    def _number_states(self) -> None:
        """Number every parameter's state by the parameter's place in torch's state-dict order (the ordinal in
        the counters of its random bits), when some group rounds stochastically."""
        self._ordinals = {}
        if not any(group.get(SR_KEY) for group in self.param_groups):
            return
        params = [p for group in self.param_groups for p in group["params"]]
        for ordinal, p in enumerate(params):
            state = self.state.get(p)
            if state is not None:
                self._ordinals.setdefault(id(state), ordinal)

    # ----------------------------------------------------------------------------------------------------
    # Gradient release (hf_optim.optim.release)
    def _start_release(self) -> None:
        """Hook every trainable parameter, after refusing what gradient release cannot run correctly."""
        reason = release_unsupported_reason()
        if reason is not None:
            raise ValueError(f"{type(self).__name__}: {reason}")
        for group in self.param_groups:
            for p in group["params"]:
                if sharding.is_dtensor(p):
                    raise ValueError(
                        f"{type(self).__name__}: release_gradients does not support sharded (DTensor) parameters: "
                        "FSDP2 reduce-scatters their gradients outside the hooks. Turn release_gradients off"
                    )
        self._release = GradientRelease(self)
        for group in self.param_groups:
            self._release.watch(group["params"])

    @torch.no_grad()
    def _step_released(self, group_index: int, index: int) -> None:
        """Step the one parameter at ``(group_index, index)`` (called by its gradient-release hook)."""
        if any(group[SR_KEY] for group in self.param_groups):
            self._number_states()  # a loaded state dict may have replaced the states the ordinals name
        self._run_plan(self._plan_step(only=(group_index, index)))

    @property
    def released_grad_norm(self) -> torch.Tensor | None:
        """With ``release_gradients``: the global 2-norm of the gradients released since the last ``step()``
        (what the Trainer logs as ``grad_norm``), or None."""
        return self._release.grad_norm() if self._release is not None else None

    def remove_release_hooks(self) -> None:
        """Stop releasing gradients: remove the hooks; ``step()`` steps every gradient again."""
        if self._release is not None:
            self._release.remove()
        self._release = None
        self.release_gradients = False
