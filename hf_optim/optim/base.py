"""The base class of every hf_optim optimizer: lazy state creation, dispatch, and bitsandbytes-format state dicts.

Subclasses set ``definition``, the algorithm's description (:class:`hf_optim.kernels.algorithm.Algorithm`: its
state slots, elementwise ``rule`` and scalars), and override ``_init_state`` / ``_update`` when the algorithm is
not elementwise (LAMB's trust ratio, Adafactor's factored statistics). Precision is never handled here: the state
store decides 32-bit or 8-bit per tensor, the kernels dequantize and requantize.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels import cpu_compile, multi_tensor, rounding
from hf_optim.kernels.algorithm import Algorithm
from hf_optim.kernels.flat_state import FlatState, FlatStates
from hf_optim.kernels.formats import (
    FORMATS,
    FP32,
    SlotLayout,
    StateFormat,
    format_for_bits,
    formats_by_rank,
    loaded_format,
    settings_format,
    with_overrides,
)
from hf_optim.kernels.formats.base import StateDictError
from hf_optim.kernels.state_store import (
    QUANT_KEYS,
    StateSpec,
    init_slot,
    slot_layouts,
    slot_tensors,
)
from hf_optim.optim import options as common_options
from hf_optim.optim import sharding
from hf_optim.optim._validation import check_min_8bit_size, check_stochastic_round
from hf_optim.optim.overrides import (
    PARAM_OVERRIDES_ATTR,
    bitsandbytes_config,
    bitsandbytes_manager,
    check_override_keys,
    module_overrides,
    update_overrides,
)
from hf_optim.optim.release import GradientRelease, release_unsupported_reason
from hf_optim.paging import on_host, paging_unavailable_reason, state_allocator

QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
TORCH_ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""torch.optim.AdamW's (and torchao's AdamW4bit/8bit's) per-parameter state keys."""
ALGORITHM_KEY = "hf_optim_algorithm"
"""Param-group key recording which algorithm wrote a state dict (ignored by bitsandbytes)."""
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


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to compute on: a DTensor's local shard, or the tensor itself."""
    if type(tensor) in _PLAIN_TENSORS:  # the common case, without the failed attribute lookup below
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class HfOptimizer(torch.optim.Optimizer):
    """Base class: subclasses set ``definition`` (or override the hooks)."""

    definition: ClassVar[Algorithm | None] = None
    """The algorithm's description; a subclass that sets it gets ``algorithm``, ``state_specs``, ``rule`` and
    ``_hyper`` from it (unless it defines them itself)."""
    algorithm: ClassVar[str] = ""
    state_specs: ClassVar[tuple[StateSpec, ...]] = ()
    supported_formats: ClassVar[tuple[str, ...] | None] = None
    """The names of the state formats the algorithm runs with; None (elementwise algorithms): every registered
    format (``hf_optim.kernels.formats``), so a new format needs no change to any algorithm."""
    pages: ClassVar[bool] = True
    """Whether the class takes ``is_paged`` (and has ``Paged*`` twins)."""
    bitsandbytes_order: ClassVar[tuple[str, ...]] = ("optim_bits", "min_8bit_size", "is_paged")
    """Where the common options (:mod:`hf_optim.optim.options`) go in a class's signature: bitsandbytes' order from
    ``optim_bits`` on, naming the class's own arguments between them (``args``, LAMB's ``max_unorm``)."""
    group_keys: ClassVar[tuple[str, ...]] = ()
    """Param-group keys the algorithm reads (filled from defaults when a foreign state dict lacks them)."""
    twins_keep_optim_bits: ClassVar[bool] = False
    """Whether the 8-bit and 32-bit twins (``AdamW8bit``, ``PagedAdamW32bit``, ...) keep an ``optim_bits`` argument,
    as bitsandbytes' namesakes of some algorithms do (AdamW: default 32, which they ignore); see
    :func:`hf_optim.optim.variants.precision_variant`."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        **options: Any,
    ) -> None:
        """``defaults``: the algorithm's hyperparameters; ``options``: the common options given (see
        :mod:`hf_optim.optim.options`; the others take their defaults)."""
        chosen = common_options.resolve(type(self), options, self._supported_formats())
        defaults = {**defaults, **common_options.group_entries(chosen), SR_SEED_KEY: 0}
        # The arguments are checked before ``params`` is read, as torch's optimizers do, so a bad value is reported
        # as itself whatever ``params`` is (torch's own error tests pass params=None with a bad lr).
        self._check_group({**defaults, "params": []})
        super().__init__(params, defaults)
        self.is_paged = chosen.get("is_paged", False)
        self._allocate = state_allocator(self.is_paged, type(self).__name__)
        self._flat = FlatStates()  # where the multi-tensor path keeps each parameter's state
        self._ordinals: dict[int, int] = {}  # during a step with stochastic rounding: id(state) -> param ordinal
        for group in self.param_groups:
            self._check_group(group)
        self.release_gradients = chosen["release_gradients"]
        self._release: GradientRelease | None = None
        if self.release_gradients:
            self._start_release()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own_init = cls.__dict__.get("__init__")
        if own_init is not None and "options" in inspect.signature(own_init).parameters:
            common_options.with_common_options(cls)
        definition = cls.__dict__.get("definition")
        if definition is None:
            return
        own = cls.__dict__
        cls.algorithm = definition.name
        cls.state_specs = definition.slots
        if "rule" not in own and definition.rule is not None:
            cls.rule = staticmethod(definition.rule)
        if "_hyper" not in own:
            cls._hyper = staticmethod(definition.hyper_values)

    # ----------------------------------------------------------------------------------------------------
    # Hooks for subclasses
    def _check_group(self, group: dict) -> None:
        """Validate a param group's hyperparameters (called for every group, including added ones)."""
        common_options.check_group_format(group, self._supported_formats(), type(self).__name__)
        check_min_8bit_size(group["min_8bit_size"])
        check_stochastic_round(group.get(SR_KEY, False), group.get(SR_SEED_KEY, 0))

    @classmethod
    def _supported_formats(cls) -> tuple[StateFormat, ...]:
        """The formats the class runs with, in table order."""
        return tuple(formats_by_rank(cls.supported_formats))

    def rule(self, param, grad, states, hyper):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hyper(self, group: dict, step: int) -> tuple:  # pragma: no cover - abstract
        """Scalars for the rule at ``step`` (host math: bias corrections, schedules): ``definition.hyper``."""
        raise NotImplementedError

    def _to_bnb_group(self, group: dict) -> dict:
        """Add the param-group keys bitsandbytes' namesake reads, so a saved state dict loads there too."""
        return group

    def _from_bnb_group(self, saved: dict) -> dict:
        """Map a bitsandbytes param group's keys to this optimizer's (inverse of :meth:`_to_bnb_group`)."""
        return saved

    def _state_format(self, param: torch.Tensor, group: dict) -> StateFormat:
        """The format of ``param``'s state: the group's (``state_format``, or ``optim_bits`` where an override set it)
        when it is not quantized or the WHOLE parameter (a DTensor's global numel) has ``min_8bit_size`` elements,
        fp32 otherwise, so the precision of a parameter's state never depends on how many ranks share it."""
        fmt = settings_format(group)
        if fmt.quantized and param.numel() < group["min_8bit_size"]:
            return FP32
        return fmt

    def _init_state(self, full: torch.Tensor, group: dict, state: dict) -> None:
        """Create the state of parameter ``full`` (a DTensor or a tensor) on its local tensor."""
        param = local_tensor(full)
        state["step"] = 0
        fmt = self._state_format(full, group)
        for spec in self.state_specs:
            init_slot(state, spec, param, fmt, self._allocate)

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, full=None) -> None:
        """Update the local tensor ``param``; ``full`` is the parameter itself (a DTensor when sharded), for
        algorithms that reduce across shards."""
        hyper = self._hyper(group, state["step"])
        self._run_rule(self.rule, param, grad, state, hyper, stream=self._stream(group, state, param))

    def _step_flat(self, group: dict, flat: FlatState, members: list, hyper: dict,
                   stream: rounding.Stream | None = None) -> None:
        """Update ``members`` = ``[(index in flat, local param, local grad)]``, sorted by index, whose state is in
        ``flat``: the multi-tensor path (``hf_optim.kernels.multi_tensor``), one call per chunk of flat state.
        ``stream``: bf16 stochastic rounding of the new parameters (its ``ordinals`` by member index)."""
        for run, params, grads in multi_tensor.runs_of(flat, members):
            multi_tensor.step_run(self.rule, flat, multi_tensor.cached_chunks(flat, run), params, grads, hyper,
                                  self._scratch, stream=stream)

    # ----------------------------------------------------------------------------------------------------
    # bf16 stochastic rounding (hf_optim.kernels.rounding)
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

    def _state_dims(self, key: str, ndim: int, state: Mapping | None = None):
        """How state ``key`` of an ``ndim``-dim parameter is laid out, for sharded checkpoints (see
        :func:`hf_optim.optim.sharding.export_state`): the parameter dimension of each state dimension, a
        ``sharding.PerShard`` for state counted on the local shard (absmax vectors, packed 4-bit codes), or None
        for state that is the same on every rank. ``state`` (the parameter's state, nested or not) tells the
        slot's format."""
        for spec in self.state_specs:
            if key not in (spec.key, spec.absmax_key):
                continue
            flat = {**state, **state.get(QUANT_STATE_KEY, {})} if state is not None else {}
            fmt = loaded_format(flat, spec) if flat else None
            if key == spec.absmax_key:
                return sharding.PerShard(fmt.num_blocks) if fmt is not None and fmt.block_size else sharding.ABSMAX
            if fmt is not None and fmt.packed:
                return sharding.PerShard(fmt.main_length)
            return (None,) * (spec.rows > 1) + tuple(range(ndim))
        return None

    # ----------------------------------------------------------------------------------------------------
    # Dispatch
    @property
    def backend(self) -> str:
        """The kernels that update this optimizer's parameters: ``triton``, ``torch-compile`` (the multi-tensor path
        compiled by inductor, CPU and CUDA) or ``torch`` (eager), per device type when they differ (see
        ``hf_optim.kernels.backend``). Configurations whose Triton kernels failed on this machine are listed by
        ``hf_optim.kernels.triton_guard.failures()``."""
        devices = {local_tensor(p).device for group in self.param_groups for p in group["params"]}
        return kernel_backend.describe(devices)


    def _on_multi_tensor_path(self, full: torch.Tensor, param: torch.Tensor) -> bool:
        """Whether ``full``'s state lives in flat buffers: :meth:`_multi_tensor_eligible` tensors the backend does not
        assign to Triton (Triton has its own multi-tensor kernels)."""
        return self._multi_tensor_eligible(full, param) and not kernel_backend.uses_triton(param.device)

    def _multi_tensor_eligible(self, full: torch.Tensor, param: torch.Tensor) -> bool:
        """Whether ``full`` can step on the multi-tensor PyTorch path: whole (unsharded) contiguous float tensors on
        a device it runs on (CPU, CUDA)."""
        return (
            _multi_tensor_capable(type(self))
            and param is full
            and param.device.type in multi_tensor.DEVICE_TYPES
            and param.is_contiguous()
            and param.dtype in multi_tensor.PARAM_DTYPES
        )

    def _create_states(self, group: dict, fresh: list) -> None:
        """Create the state of ``fresh`` = ``[(param, local param, per-parameter overrides)]``: in flat buffers for
        the multi-tensor path, per tensor otherwise."""
        flat_entries = []
        for p, param, overrides in fresh:
            settings = with_overrides(group, overrides) if overrides else group
            state = self.state[p]
            if not self._on_multi_tensor_path(p, param):
                self._init_state(p, settings, state)
                continue
            state["step"] = 0
            fmt = self._state_format(p, settings)
            flat_entries.append((p, param, state, [SlotLayout(fmt, spec.signed) for spec in self.state_specs]))
        if flat_entries:
            self._flat.create(self.state_specs, flat_entries, self._allocate)

    def _update_group(self, group: dict, group_index: int, items: list) -> None:
        """Update a group's ``(local param, local grad, state, param)`` items: one fused Triton launch (per pass)
        for the tensors the backend assigns to Triton, the multi-tensor PyTorch path for those whose state is in
        flat buffers, the PyTorch path tensor by tensor for the rest."""
        fused, flat_items, fused_full = [], [], {}
        triton_devices: dict[torch.device, bool] = {}  # the backend choice reads the environment: once per device
        for param, grad, state, full in items:
            if param.device not in triton_devices:
                triton_devices[param.device] = kernel_backend.uses_triton(param.device)
            if triton_devices[param.device]:
                from hf_optim.kernels import triton_step  # imports triton: only when a Triton step runs

                if triton_step.supported(self, param, param is not full):
                    fused.append((param, grad, state))
                    fused_full[id(state)] = full
                    continue
            if self._on_multi_tensor_path(full, param):
                flat_items.append((param, grad, state, full))
                continue
            self._update(param, grad, state, group, full=full)
        if flat_items:
            self._update_flat(group, flat_items)
        if fused:
            if group[SR_KEY]:
                skipped = triton_step.step_group(self, group, group_index, fused, ordinals=self._ordinals)
            else:
                skipped = triton_step.step_group(self, group, group_index, fused)
            if skipped:  # their kernels failed to compile or load on this GPU (hf_optim.kernels.triton_guard)
                self._update_fallback(group, [(param, grad, state, fused_full[id(state)])
                                              for param, grad, state in skipped])

    def _update_fallback(self, group: dict, items: list) -> None:
        """The PyTorch path for ``(local param, local grad, state, param)`` items whose Triton kernels failed: the
        multi-tensor path where it applies (their per-tensor state, created for Triton, moves into flat buffers at
        the first such step), tensor by tensor otherwise. The same math as their Triton kernels."""
        flat_items = []
        for param, grad, state, full in items:
            if self._multi_tensor_eligible(full, param):
                flat_items.append((param, grad, state, full))
            else:
                self._update(param, grad, state, group, full=full)
        if flat_items:
            self._update_flat(group, flat_items)

    # The multi-tensor path runs its own compiled kernels: under an outer torch.compile(optimizer.step) it runs as
    # it is (dynamo would otherwise specialize on every step's learning rate and bias corrections).
    @torch._disable_dynamo
    def _update_flat(self, group: dict, items: list) -> None:
        """The multi-tensor path for ``items`` (as :meth:`_update_group`'s): state that a loaded state dict
        replaced is first moved into flat buffers; then one :meth:`_step_flat` per flat buffer and step count."""
        located = [self._flat.locate(full, state) for _, _, state, full in items]
        homeless = [
            (full, param, state, slot_layouts(state, self.state_specs))
            for (param, _, state, full), place in zip(items, located)
            if place is None
        ]
        if homeless:  # a loaded state dict (or the Triton path, before a fallback) made their state: move it in
            for piece in _adoption_pieces(homeless):
                self._flat.adopt(self.state_specs, piece, self._allocate)
            located = [place or self._flat.locate(full, state) for (_, _, state, full), place in zip(items, located)]
        batches: dict[tuple, tuple[FlatState, list]] = {}
        ordinals: dict[int, dict[int, int]] = {}  # per flat buffer: member index -> parameter ordinal
        for (param, grad, state, _), (flat, index) in zip(items, located):
            batches.setdefault((id(flat), state["step"]), (flat, []))[1].append((index, param, grad))
            if group[SR_KEY]:
                ordinals.setdefault(id(flat), {})[index] = self._ordinals[id(state)]
        for (_, step), (flat, members) in batches.items():
            members.sort(key=lambda member: member[0])
            stream = self._flat_stream(group, step, members[0][1], ordinals.get(id(flat), {}))
            if stream is None:  # the call as it was before stochastic rounding (subclasses may not take it)
                self._step_flat(group, flat, members, self._hyper(group, step))
            else:
                self._step_flat(group, flat, members, self._hyper(group, step), stream=stream)

    @functools.cached_property
    def _scratch(self) -> multi_tensor.Scratch:
        return multi_tensor.Scratch()

    def _run_rule(self, rule, param, grad, state, hyper, out: torch.Tensor | None = None,
                  stream: rounding.Stream | None = None) -> None:
        """Apply an elementwise rule to one parameter, in place, on its device (``stream``: round a bf16 result
        stochastically)."""
        if param.numel() == 0:  # an empty local shard of a sharded parameter
            return
        flat_param = param.view(-1) if param.is_contiguous() else param.contiguous().view(-1)
        layouts = slot_layouts(state, self.state_specs)
        tensors = [t for spec in self.state_specs for t in slot_tensors(state, spec)]
        multi_tensor.step_tensor(rule, layouts, flat_param, grad.reshape(-1), out, tensors, hyper, stream=stream)
        if not param.is_contiguous():
            param.copy_(flat_param.view_as(param))

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan_step()
        if self._release is not None:
            self._release.check_not_stepped(plan)
        self._run_plan(plan)
        if self._release is not None:
            self._release.step_done()
        return loss

    def _run_plan(self, plan: list[tuple[int, dict, list[tuple]]]) -> None:
        """Step the parameters of a :meth:`_plan_step` plan."""
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
                    self._allocate.prefetch(state)  # managed buffers to the GPU, on the current stream: no sync
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

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        release = self.__dict__.get("_release")
        if release is not None:  # a group added after construction: its parameters release too
            release.watch(self.param_groups[-1]["params"])
        # Per-parameter overrides are also recorded by position: accelerate's FSDP2 preparation swaps each
        # parameter for a new DTensor parameter at the same place in param_groups, and the attribute stays behind.
        recorded = self.__dict__.setdefault("_overrides_by_position", {})
        group_index = len(self.param_groups) - 1
        for index, p in enumerate(self.param_groups[-1]["params"]):
            overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
            if overrides:
                recorded[group_index, index] = dict(overrides)
        if hasattr(self, "_allocate"):  # torch calls this from __init__ before our attributes exist
            self._check_group(self.param_groups[-1])

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
    # Pickling (copy.deepcopy, pickle, torch.save of the optimizer object)
    _PICKLED_ATTRS: ClassVar[tuple[str, ...]] = ("is_paged", "_overrides_by_position", "release_gradients")
    """What hf_optim adds to torch's pickled state (defaults, state, param_groups). The allocator is rebuilt from
    ``is_paged``; caches (Triton launch plans) are rebuilt when next needed; with ``release_gradients`` the
    unpickled optimizer hooks its own (unpickled) parameters."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._PICKLED_ATTRS})
        if self.is_paged:  # managed buffers travel as host copies, as in state_dict(); __setstate__ pages them again
            state["state"] = defaultdict(
                dict, {p: on_host(s) if isinstance(s, Mapping) else s for p, s in self.state.items()}
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)
        if not had_differentiable:  # torch's __setstate__ adds this key for its own optimizers; hf_optim has none
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("is_paged", False)
        self.__dict__.setdefault("_overrides_by_position", {})
        self.__dict__.setdefault("release_gradients", False)
        self._release = None
        self._allocate = state_allocator(self.is_paged, type(self).__name__)
        self._flat = FlatStates()  # unpickled state is standalone: the multi-tensor path moves it in at the next step
        if self.release_gradients:
            self._start_release()
        if self.is_paged:
            self._page_state_again()

    def _page_state_again(self) -> None:
        """Move unpickled state to its parameter's device, state buffers through the allocator (managed memory
        where paging is available), exactly as :meth:`load_state_dict` places loaded state."""
        slots = {spec.key for spec in self.state_specs}
        for p, param_state in self.state.items():
            if not isinstance(p, torch.Tensor) or not isinstance(param_state, dict):
                continue
            device = local_tensor(p).device
            pageable = paging_unavailable_reason(device) is None
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    paged = key in slots and pageable
                    param_state[key] = self._allocate.copy_of(value, device) if paged else value.to(device)

    def __repr__(self) -> str:
        paged = ", paged" if self.is_paged else ""
        return f"{super().__repr__()}\n(hf_optim: backend={self.backend}{paged})"

    # ----------------------------------------------------------------------------------------------------
    # State dicts in bitsandbytes' format
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with every quantization tensor nested under ``__bnb_optimizer_quant_state__``.

        Hooks follow torch's contract: state-dict pre-hooks run first, post-hooks receive the final (nested) dict
        and may return a replacement. Entries of ``optimizer.state`` that are not a parameter's state (a hook may
        add some) are passed through unchanged, as torch does.
        """
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # they run below, on the dict this method returns
        try:
            state_dict = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = [p for group in self.param_groups for p in group["params"]]  # torch's index order
        first_index: dict[int, int] = {}
        for index, p in enumerate(params):
            first_index.setdefault(id(p), index)  # torch numbers a repeated parameter by its first place
        param_indices = {first_index[id(k)] for k in self.state if isinstance(k, torch.Tensor) and id(k) in first_index}
        nested = {}
        for index, param_state in state_dict["state"].items():
            if index not in param_indices or not isinstance(param_state, Mapping):
                nested[index] = param_state
                continue
            param_state = dict(param_state)
            quant = {k: param_state.pop(k) for k in list(param_state) if k in QUANT_KEYS}
            if quant:
                param_state[QUANT_STATE_KEY] = quant
            if sharding.is_dtensor(params[index]):  # for torch.distributed.checkpoint: DTensors like the param
                # (on the parameter's device mesh, paged or not: DCP moves the local shards itself)
                param_state = sharding.export_state(param_state, params[index],
                                                   functools.partial(self._state_dims, state=param_state))
            elif self.is_paged:  # a paged optimizer's state dict holds CPU tensors: loading needs no GPU memory
                param_state = on_host(param_state)
            nested[index] = param_state
        state_dict["state"] = nested
        state_dict["param_groups"] = [
            {**self._to_bnb_group(group), ALGORITHM_KEY: self.algorithm} for group in state_dict["param_groups"]
        ]
        for hook in post_hooks.values():
            replacement = hook(self, state_dict)
            if replacement is not None:
                state_dict = replacement
        return state_dict

    @torch._disable_dynamo  # as torch's own load_state_dict (imports dynamo only when first called)
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by hf_optim or bitsandbytes (nested or flat form).

        Tensors keep their dtype (uint8 codes stay uint8, fp32 state is never cast to the parameter dtype) and
        move to their parameter's device; state buffers are allocated by the optimizer's allocator, so a paged
        optimizer's state is paged again after loading. A state dict of another algorithm, of another parameter
        layout or of the old 2048-element block size raises :class:`StateDictError`.

        torch's contract otherwise: load-state-dict pre-hooks get a shallow copy of ``state_dict`` (and may return
        a replacement), post-hooks run after loading; entries of ``state`` that belong to no parameter are kept;
        a param group keeps its ``param_names`` when the state dict has none.
        """
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # shallow copy: hooks may change it in place
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            replacement = hook(self, state_dict)
            if replacement is not None:
                state_dict = replacement
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            found = sorted(map(str, state_dict))[:5] if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise StateDictError(
                f"not an optimizer state dict (expected the keys 'state' and 'param_groups', got {found}); "
                "a model's state dict goes to model.load_state_dict"
            )
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise StateDictError(
                f"state dict has {len(saved_groups)} parameter groups, this optimizer has {len(groups)}"
            )
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise StateDictError(
                    f"parameter group {index} has {len(group['params'])} parameters, "
                    f"the state dict's has {len(saved['params'])}"
                )
            saved_algorithm = saved.get(ALGORITHM_KEY)
            if saved_algorithm not in (None, self.algorithm):
                raise StateDictError(
                    f"state dict was saved by hf_optim's {saved_algorithm!r} optimizer; "
                    f"{type(self).__name__} runs {self.algorithm!r}"
                )
        id_map = {
            saved_id: p
            for saved_group, group in zip(saved_groups, groups)
            for saved_id, p in zip(saved_group["params"], group["params"])
        }
        new_state: dict = {}
        for saved_id, param_state in state_dict["state"].items():
            if saved_id not in id_map:  # not a parameter's state (a hook's entry, say): kept as it is, as torch does
                new_state[saved_id] = copy.deepcopy(param_state)
                continue
            p = id_map[saved_id]
            flat = sharding.import_state(dict(param_state), p, local_tensor(p),
                                         functools.partial(self._state_dims, state=param_state))
            flat.update(flat.pop(QUANT_STATE_KEY, {}))
            self._check_loaded_state(local_tensor(p), flat, saved_id)
            # Copy: the loaded optimizer must never share (and mutate) the caller's tensors. State buffers go
            # through the allocator, which pages them for a paged optimizer as it did when they were created.
            device = local_tensor(p).device
            slots = {spec.key for spec in self.state_specs}
            new_state[p] = {
                k: (
                    (self._allocate.copy_of(v, device) if k in slots else v.to(device, copy=True))
                    if isinstance(v, torch.Tensor)
                    else copy.deepcopy(v)
                )
                for k, v in flat.items()
            }
            if isinstance(new_state[p].get("step"), torch.Tensor):
                new_state[p]["step"] = int(new_state[p]["step"].item())

        new_groups = []
        for group, saved in zip(groups, saved_groups):
            saved = self._from_bnb_group(saved)
            merged = {k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", ALGORITHM_KEY)}
            if "state_format" not in merged and merged.get("optim_bits") in [f.optim_bits for f in FORMATS.values()]:
                merged["state_format"] = format_for_bits(merged["optim_bits"]).name  # bitsandbytes' (or older) dict
            for key, value in self.defaults.items():
                merged.setdefault(key, value)
            merged["params"] = group["params"]
            if "param_names" in group and "param_names" not in merged:
                merged["param_names"] = group["param_names"]
            self._check_group(merged)
            new_groups.append(merged)

        self.state.clear()
        self._flat.clear()  # the loaded state moves into new flat buffers at its first step
        self.state.update(new_state)
        self.param_groups = new_groups
        if self._release is not None:
            self._release.groups_changed()
            self._release.step_done()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _check_loaded_state(self, param: torch.Tensor, state: dict, index) -> None:
        """Refuse state of another algorithm, shape or block size before it can corrupt training."""
        where = f"state of parameter {index} (shape {tuple(param.shape)})"
        expected = {spec.key for spec in self.state_specs}
        present = {k for k in state if k.startswith("state")}
        foreign = sorted(TORCH_ADAM_KEYS & set(state))
        if foreign and not present:
            subclass = next((type(state[k]).__name__ for k in foreign if type(state[k]) is not torch.Tensor), None)
            source = f"torchao's low-bit AdamW ({subclass} state)" if subclass else "torch.optim.AdamW (or torchao)"
            raise StateDictError(
                f"{where} has {foreign}: a state dict of {source}, not of hf_optim or bitsandbytes "
                f"(slots {sorted(expected)} with their absmax and qmap). hf_optim does not convert it: torchao keeps "
                "its 4-bit and 8-bit moments as tensor subclasses that need torchao installed to load, with its "
                "own 8-bit map and block scales clipped at 1e-12, and torch's AdamW state is unquantized, in another "
                "layout. Resume the model weights and start the optimizer state afresh, or finish the "
                "run with the optimizer that saved it."
            )
        if present != expected:
            raise StateDictError(
                f"{where} has slots {sorted(present)}, but {type(self).__name__} ({self.algorithm}) keeps "
                f"{sorted(expected)}: the state dict was saved by another algorithm"
            )
        for spec in self.state_specs:
            fmt = loaded_format(state, spec)
            if fmt is None:
                value = state[spec.key]
                raise StateDictError(
                    f"{where}: {spec.key} has dtype {getattr(value, 'dtype', type(value).__name__)}, expected float32 "
                    "or uint8 (fp32 values, or quantized codes with their absmax and qmap)"
                )
            fmt.check_loaded(param, state, spec, where)


ADOPT_BYTES = 256 << 20
"""Most bytes of state moved into flat buffers at once: until a parameter's old state is released, it exists twice,
so adopting a whole model's state in one piece would briefly double it (on a GPU, that can fail for lack of memory
at the very step that falls back from a failed Triton kernel)."""


def _adoption_pieces(entries: list) -> list[list]:
    """``entries`` (``FlatStates.adopt``'s) in consecutive pieces of at most :data:`ADOPT_BYTES` of state each (a
    larger parameter's state is a piece by itself)."""
    pieces, size = [], 0
    for entry in entries:
        state = entry[2]
        nbytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
        if not pieces or size + nbytes > ADOPT_BYTES:
            pieces.append([])
            size = 0
        pieces[-1].append(entry)
        size += nbytes
    return pieces


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines attribute ``name``."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


@functools.cache
def _multi_tensor_capable(cls: type) -> bool:
    """Whether ``cls`` steps on the multi-tensor path: its state is the default slots, and whoever defines its
    update also defines (or inherits from a class that knows it) the flat step."""
    return _owner(cls, "_init_state") is HfOptimizer and issubclass(_owner(cls, "_step_flat"), _owner(cls, "_update"))
