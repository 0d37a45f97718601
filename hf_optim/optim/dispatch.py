"""Updating parameters: the update hooks subclasses override, lazy state creation and the three-way dispatch.

:class:`Dispatch` is a mixin of :class:`~hf_optim.optim.base.HfOptimizer`. A group's parameters go to one fused
Triton launch (:mod:`hf_optim.kernels.triton_path.step`), the multi-tensor PyTorch path over flat state buffers
(:mod:`hf_optim.kernels.torch_path.multi_tensor`), or the PyTorch path tensor by tensor (:meth:`Dispatch._update`); the
PyTorch paths also run the tensors whose Triton kernels failed on this machine.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.formats import FORMATS, FP32, SlotLayout, StateFormat, settings_format, with_overrides
from hf_optim.kernels.state_store import init_slot, slot_layouts, slot_tensors
from hf_optim.kernels.torch_path import multi_tensor, rounding
from hf_optim.kernels.torch_path.flat_state import FlatState
from hf_optim.optim.sharding import local_tensor
from hf_optim.optim.stepping import SR_KEY

logger = logging.getLogger("hf_optim")
_told_no_triton: set[tuple[str, str]] = set()
"""(format name, device type) pairs already logged as stepping on the PyTorch path instead of Triton."""


class Dispatch:
    """Mixin of :class:`~hf_optim.optim.base.HfOptimizer`: the update of each parameter (see the module)."""

    # ----------------------------------------------------------------------------------------------------
    # Hooks for subclasses: the update
    def rule(self, param, grad, states, hyper):  # pragma: no cover - abstract
        raise NotImplementedError

    def _hyper(self, group: dict, step: int) -> tuple:  # pragma: no cover - abstract
        """Scalars for the rule at ``step`` (host math: bias corrections, schedules): ``definition.hyper``."""
        raise NotImplementedError

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
        for spec in self._slots_for(full, group):
            init_slot(state, spec, param, fmt, self._allocate)

    def _slots_for(self, full: torch.Tensor, group: dict) -> tuple:
        """The slots parameter ``full`` of ``group`` keeps: the algorithm's (a hybrid optimizer, Muon, picks the
        slots of the rule the parameter takes)."""
        return self.state_specs

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, full=None) -> None:
        """Update the local tensor ``param``; ``full`` is the parameter itself (a DTensor when sharded), for
        algorithms that reduce across shards."""
        hyper = self._hyper(group, state["step"])
        self._run_rule(self.rule, param, grad, state, hyper, stream=self._stream(group, state, param))

    def _step_flat(self, group: dict, flat: FlatState, members: list, hyper: dict,
                   stream: rounding.Stream | None = None) -> None:
        """Update ``members`` = ``[(index in flat, local param, local grad)]``, sorted by index, whose state is in
        ``flat``: the multi-tensor path (``hf_optim.kernels.torch_path.multi_tensor``), one call per chunk of flat
        state. ``stream``: bf16 stochastic rounding of the new parameters (its ``ordinals`` by member index)."""
        for run, params, grads in multi_tensor.runs_of(flat, members):
            multi_tensor.step_run(self.rule, flat, multi_tensor.cached_chunks(flat, run), params, grads, hyper,
                                  self._scratch, stream=stream)

    # ----------------------------------------------------------------------------------------------------
    # Dispatch
    @property
    def backend(self) -> str:
        """The kernels that update this optimizer's parameters: ``triton``, ``torch-compile`` (the multi-tensor path
        compiled by inductor, CPU and CUDA) or ``torch`` (eager), per device type when they differ (see
        ``hf_optim.kernels.backend``). Configurations whose Triton kernels failed on this machine are listed by
        ``hf_optim.kernels.triton_path.guard.failures()``."""
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
            fmt = self._state_format(p, settings)
            if fmt.whole_tensor or not self._on_multi_tensor_path(p, param):
                self._init_state(p, settings, state)
                continue
            state["step"] = 0
            flat_entries.append((p, param, state, [SlotLayout(fmt, spec.signed) for spec in self.state_specs]))
        if flat_entries:
            self._flat.create(self.state_specs, flat_entries, self._allocate)

    def _update_group(self, group: dict, group_index: int, items: list) -> None:
        """Update a group's ``(local param, local grad, state, param)`` items: one fused Triton launch (per pass)
        for the tensors the backend assigns to Triton, the multi-tensor PyTorch path for those whose state is in
        flat buffers, the PyTorch path tensor by tensor for the rest."""
        restricted = _restricted_formats(type(self), len(FORMATS))
        capable = _triton_capable(type(self))
        triton_devices: dict[torch.device, bool] = {}  # the backend choice reads the environment: once per device
        rest, on_triton, flat_items, triton = [], [], [], None
        for item in items:
            param, grad, state, full = item
            device = param.device
            if device not in triton_devices:
                triton_devices[device] = capable and kernel_backend.uses_triton(device)
            if restricted and self._off_fast_paths(state, restricted, device, triton_devices):
                # a whole-tensor format, or one without a Triton branch: the PyTorch path, per tensor
                self._update(param, grad, state, group, full=full)
                continue
            (on_triton if triton_devices[device] else rest).append(item)
        if on_triton:
            triton = self._triton_plans.prepare(group_index, on_triton, stochastic=bool(group[SR_KEY]))
            rest.extend(triton.unsupported)
        for param, grad, state, full in rest:
            if self._on_multi_tensor_path(full, param):
                flat_items.append((param, grad, state, full))
                continue
            self._update(param, grad, state, group, full=full)
        if flat_items:
            self._update_flat(group, flat_items)
        if triton is not None:
            hypers = {step: self._hyper(group, step) for step in triton.steps}
            skipped = triton.run(group, hypers, self._ordinals if group[SR_KEY] else None)
            if skipped:  # their kernels failed to compile or load on this GPU (hf_optim.kernels.triton_path.guard)
                self._update_fallback(group, skipped)

    @functools.cached_property
    def _triton_plans(self):
        """The Triton path's launch plans, kept between steps (``hf_optim.kernels.triton_path.step.TritonPlans``); state
        reallocation clears them (:meth:`_state_reallocated`)."""
        from hf_optim.kernels.triton_path import step as triton_step  # imports triton: only when a Triton step runs

        return triton_step.TritonPlans(self.definition)

    def _state_reallocated(self) -> None:
        """State tensors were replaced (a loaded state dict, state moved into flat buffers): the Triton path's
        cached tables name their old addresses."""
        plans = self.__dict__.get("_triton_plans")
        if plans is not None:
            plans.clear()
        self.__dict__.pop("_restricted_seen", None)

    def _triton_eligible(self, param: torch.Tensor, sharded: bool) -> bool:
        """Whether this optimizer's Triton kernels can update the local tensor ``param``."""
        if not _triton_capable(type(self)):
            return False
        from hf_optim.kernels.triton_path import step as triton_step

        return triton_step.supported(self.definition, param, sharded)

    def _off_fast_paths(self, state: dict, restricted: tuple[StateFormat, ...], device: torch.device,
                        triton_devices: dict) -> bool:
        """Whether ``state`` holds a slot in one of the ``restricted`` formats (:func:`_restricted_formats`) that keeps
        it off the fast paths here: a whole-tensor format always, one without a Triton branch where Triton runs the
        rest (said once per format and device type). Such a tensor steps on the PyTorch path tensor by tensor.
        These formats recognise only their own slots (rank1_4bit: by its column scales), so asking them is enough,
        and cheaper than finding each slot's format. The answer is remembered per first state tensor (weakly; new
        state tensors, from a load or a format change, are asked again; cleared with the Triton plans), so a
        step does not ask every format about every tensor again."""
        first = state.get(self.state_specs[0].key)
        known = self.__dict__.setdefault("_restricted_seen", {})  # id(first tensor): (weak ref, restricted, format)
        seen = known.get(id(first))
        if seen is not None and seen[0]() is first and seen[1] is restricted:
            fmt = seen[2]
        else:
            fmt = next((fmt for fmt in restricted if any(fmt.recognises(state, spec) for spec in self.state_specs)),
                       None)
            if isinstance(first, torch.Tensor):
                known[id(first)] = (weakref.ref(first), restricted, fmt)
        if fmt is not None:
            off_triton = not fmt.triton and triton_devices[device]
            if off_triton and (fmt.name, device.type) not in _told_no_triton:
                _told_no_triton.add((fmt.name, device.type))
                logger.warning("state_format %r has no Triton kernels: its tensors step on the PyTorch path, one by "
                               "one, on %s (the other tensors stay on Triton)", fmt.name, device.type)
            return fmt.whole_tensor or off_triton  # a chunkable format without Triton keeps the multi-tensor path
        return False

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
            self._state_reallocated()  # their state tensors are replaced by views of flat buffers
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


ADOPT_BYTES = 256 << 20
"""Most bytes of state moved into flat buffers at once: until a parameter's old state is released, it exists twice,
so adopting a whole model's state in one piece would briefly double it (on a GPU, that can fail for lack of memory
at the very step that falls back from a failed Triton kernel)."""


def _adoption_pieces(entries: list) -> list[list]:
    """``entries`` (``FlatStates.adopt``'s) in consecutive pieces of at most :data:`ADOPT_BYTES` of state each (a
    larger parameter's state is a piece by itself)."""
    return multi_tensor.consecutive_pieces(
        entries, lambda entry: sum(t.nbytes for t in entry[2].values() if isinstance(t, torch.Tensor)), ADOPT_BYTES)


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO that defines attribute ``name``."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


@functools.cache
def _restricted_formats(cls: type, registered: int) -> tuple[StateFormat, ...]:
    """The formats ``cls`` runs with that leave the fast paths: whole-tensor formats (no flat-buffer form, so not the
    multi-tensor path) and those without a Triton branch. Empty for most classes, which then pay nothing per
    tensor for the check. ``registered``: how many formats are registered (a later registration is a new key)."""
    supported = getattr(cls, "_supported_formats", None)
    formats = supported() if supported is not None else ()
    return tuple(fmt for fmt in formats if fmt.whole_tensor or not fmt.triton)


@functools.cache
def _multi_tensor_capable(cls: type) -> bool:
    """Whether ``cls`` steps on the multi-tensor path: its state is the default slots, and whoever defines its
    update also defines (or inherits from a class that knows it) the flat step."""
    return _owner(cls, "_init_state") is Dispatch and issubclass(_owner(cls, "_step_flat"), _owner(cls, "_update"))


@functools.cache
def _triton_capable(cls: type) -> bool:
    """Whether ``cls`` can step on the Triton kernels: its algorithm has a Triton rule or plan, and the class did not
    replace the algorithm's rule or update (the kernels would not run that code)."""
    algorithm = getattr(cls, "definition", None)
    if algorithm is None or not algorithm.runs_on_triton:
        return False
    base = _owner(cls, "definition")
    return cls._update is base._update and cls.rule is base.rule
