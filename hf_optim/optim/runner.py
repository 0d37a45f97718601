"""The runner: how one rule of an optimizer updates a param group's tensors.

The backend choice is :meth:`Runner.update_group`: one fused Triton launch (per pass) for the tensors the backend
assigns to Triton (:mod:`hf_optim.kernels.triton_path.step`), the multi-tensor PyTorch path over flat state buffers
(:mod:`hf_optim.kernels.torch_path.multi_tensor`) for whole contiguous tensors, and the PyTorch path tensor by tensor
for the rest; the PyTorch paths also run the tensors whose Triton kernels failed on this machine. An algorithm that
is not elementwise plugs its own PyTorch path in through its description
(:class:`hf_optim.core.own_update.OwnUpdate`), which receives the runner as its context.

A single-rule optimizer has one runner; a hybrid one (a :class:`hf_optim.core.partition.Partition`) one per rule.
"""

from __future__ import annotations

import functools

import torch

from hf_optim.core import state_store
from hf_optim.core.algorithm import Algorithm
from hf_optim.core.state_store import StateSpec, slot_layouts, slot_tensors
from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.torch_path import multi_tensor
from hf_optim.kernels.torch_path.flat_state import FlatState
from hf_optim.numerics import rounding
from hf_optim.optim import fast_paths, shard_layout, sharded_blocks
from hf_optim.optim.states import StateStore
from hf_optim.optim.step_plan import SR_KEY, StepPlan


class Runner:
    """Updates the tensors of one rule (see the module).

    Args:
        name: the optimizer class's name, for messages.
        label: the rule's label in a hybrid optimizer (``""``: the only rule).
        algorithm: the rule's description.
        rule: the elementwise rule to run (the class's ``rule``: a subclass may replace the algorithm's, and then
            never takes the Triton kernels, which would not run it).
        formats: ``formats()`` -> the formats the optimizer runs with (restricted ones leave the fast paths).
        store, plan: the optimizer's state store and step plan.
        settings: ``settings(group) -> dict``, the hyperparameters this rule reads (a hybrid's rule); None: the
            group's.
    """

    def __init__(self, name: str, label: str, algorithm: Algorithm, rule, formats, store: StateStore,
                 plan: StepPlan, settings=None) -> None:
        self.name, self.label, self.algorithm, self.rule = name, label, algorithm, rule
        self.slots: tuple[StateSpec, ...] = algorithm.slots
        self.store, self.plan, self.settings = store, plan, settings
        self.update = algorithm.update
        self.notes: set[str] = set()
        self.multi_tensor_capable = self.update is None or self.update.multi_tensor
        self.triton_capable = algorithm.runs_on_triton and rule is algorithm.rule
        self.fast_paths = fast_paths.FastPaths(formats, self.slots)
        store.on_replaced(self.clear_caches)

    # What an own update (OwnUpdate) uses
    def hyper(self, group: dict, step: int):
        """The rule's scalars at ``step`` (host math: bias corrections, schedules)."""
        return self.algorithm.hyper_values(group, step)

    def stream(self, group: dict, state: dict, param: torch.Tensor) -> rounding.Stream | None:
        return self.plan.stream(group, state, param)

    @functools.cached_property
    def scratch(self) -> multi_tensor.Scratch:
        return multi_tensor.Scratch()

    def run_rule(self, param, grad, state, hyper, out: torch.Tensor | None = None,
                 stream: rounding.Stream | None = None, full: torch.Tensor | None = None) -> None:
        """Apply the elementwise rule to one parameter, in place, on its device (``out``: write the rule's output
        there instead; ``stream``: round a bf16 result stochastically; ``full``: the parameter, when ``param`` is a
        sharded one's local tensor: its quantized state then takes the whole tensor's scales, and every rank of
        its shard group must step it, also with an empty part)."""
        part = self.part_apart(full, param, state)
        if part is not None:
            sharded_blocks.step(self.rule, self.slots, part, param, grad, state, hyper, out, stream, self.store.pending)
            return
        if param.numel() == 0:  # an empty local shard of a sharded parameter
            return
        flat_param = param.view(-1) if param.is_contiguous() else param.contiguous().view(-1)
        layouts = slot_layouts(state, self.slots)
        tensors = [t for spec in self.slots for t in slot_tensors(state, spec)]
        multi_tensor.step_tensor(self.rule, layouts, flat_param, grad.reshape(-1), out, tensors, hyper,
                                 stream=stream)
        if not param.is_contiguous():
            param.copy_(flat_param.view_as(param))

    def part_apart(self, full, param, state: dict, slots: tuple[StateSpec, ...] | None = None):
        """The :class:`~hf_optim.optim.shard_layout.Part` of a sharded parameter whose quantized state (``slots``:
        the rule's by default) needs the sharded step (:func:`hf_optim.optim.sharded_blocks.steps_apart`), else
        None."""
        if full is None or full is param:
            return None
        part = shard_layout.part_of(full)
        if isinstance(part, shard_layout.Part) and sharded_blocks.steps_apart(part, state, slots or self.slots):
            return part
        return None

    def read_slot(self, state: dict, spec: StateSpec, n: int, full: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values ``(rows, n)`` of slot ``spec`` of a parameter's state (``full``: the parameter, for a
        sharded one's part)."""
        part = self.part_apart(full, None, state, (spec,))
        if part is not None:
            return sharded_blocks.read_part(part, state, spec)
        return state_store.read_slot(state, spec, n)

    def write_slot(self, state: dict, spec: StateSpec, values: torch.Tensor, full: torch.Tensor | None = None) -> None:
        """Store fp32 ``values`` ``(rows, n)`` into slot ``spec`` (``full``: as :meth:`read_slot`; every rank of a
        sharded parameter's group must write, also an empty part)."""
        part = self.part_apart(full, None, state, (spec,))
        if part is not None:
            sharded_blocks.write_part(part, state, spec, values, self.store.pending)
        else:
            state_store.write_slot(state, spec, values)

    # State
    def view(self, group: dict) -> dict:
        """``group`` as this rule reads it (a hybrid's rule reads its own hyperparameters)."""
        return {**group, **self.settings(group)} if self.settings is not None else group

    def create_states(self, group: dict, fresh: list, states: dict) -> None:
        """Create the state of ``fresh`` = ``[(param, local param, overrides)]`` (a step's new parameters)."""
        if fresh and self.update is not None and self.update.created is not None:
            self.update.created(self, group, [param for _, param, _ in fresh])
        self.store.create(self, group, fresh, states)

    def init_state(self, full: torch.Tensor, group: dict, state: dict) -> None:
        """Create one parameter's state, per tensor."""
        if self.update is not None and self.update.init_state is not None:
            self.update.init_state(self, full, group, state)
        else:
            self.store.init_slots(full, group, state, self.slots)

    def clear_caches(self) -> None:
        plans = self.__dict__.get("triton_plans")
        if plans is not None:
            plans.clear()
        self.fast_paths.forget()

    # Which path a tensor takes
    def multi_tensor_eligible(self, full: torch.Tensor, param: torch.Tensor) -> bool:
        """Whether ``full`` can step on the multi-tensor PyTorch path: whole (unsharded) contiguous float tensors on
        a device it runs on (CPU, CUDA)."""
        return (
            self.multi_tensor_capable
            and param is full
            and param.device.type in multi_tensor.DEVICE_TYPES
            and param.is_contiguous()
            and param.dtype in multi_tensor.PARAM_DTYPES
        )

    def on_multi_tensor_path(self, full: torch.Tensor, param: torch.Tensor) -> bool:
        """Whether ``full``'s state lives in flat buffers: eligible tensors the backend does not assign to Triton
        (Triton has its own multi-tensor kernels)."""
        return self.multi_tensor_eligible(full, param) and not kernel_backend.uses_triton(param.device)

    def triton_eligible(self, param: torch.Tensor, sharded: bool) -> bool:
        """Whether this rule's Triton kernels can update the local tensor ``param``."""
        if not self.triton_capable:
            return False
        from hf_optim.kernels.triton_path import step as triton_step

        return triton_step.supported(self.algorithm, param, sharded)

    @functools.cached_property
    def triton_plans(self):
        """The Triton path's launch plans, kept between steps; replaced state clears them."""
        from hf_optim.kernels.triton_path import step as triton_step  # imports triton: only when a Triton step runs

        return triton_step.TritonPlans(self.algorithm)

    # The update
    def update_group(self, group: dict, group_index: int, items: list) -> None:
        """Update a group's ``(local param, local grad, state, param)`` items (see the module)."""
        group = self.view(group)
        if self.update is not None and self.update.group is not None:
            self.update.group(self, group, items)
            return
        triton_devices: dict[torch.device, bool] = {}  # the backend choice reads the environment: once per device
        rest, on_triton, triton = [], [], None
        restricted = self.fast_paths.restricted()  # empty for most optimizers: nothing to ask per tensor
        for item in items:
            param, grad, state, full = item
            device = param.device
            if device not in triton_devices:
                triton_devices[device] = self.triton_capable and kernel_backend.uses_triton(device)
            if restricted and self.fast_paths.off(state, restricted, triton_devices[device], device):
                self.update_tensor(param, grad, state, group, full)  # a whole-tensor format, or one without Triton
                continue
            on_this_triton = triton_devices[device] and self.part_apart(full, param, state) is None
            (on_triton if on_this_triton else rest).append(item)
        if on_triton:
            triton = self.triton_plans.prepare(group_index, on_triton, stochastic=bool(group[SR_KEY]))
            rest.extend(triton.unsupported)
        self._update_on_pytorch(group, rest, self.on_multi_tensor_path)
        if triton is not None:
            hypers = {step: self.hyper(group, step) for step in triton.steps}
            skipped = triton.run(group, hypers, self.plan.ordinals if group[SR_KEY] else None)
            if skipped:  # their kernels failed to compile or load on this GPU (hf_optim.kernels.triton_path.guard)
                self.update_fallback(group, skipped)

    def update_tensor(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, full=None) -> None:
        """The PyTorch path for one tensor (``full``: the parameter, a DTensor when sharded)."""
        if self.update is not None and self.update.tensor is not None:
            self.update.tensor(self, param, grad, state, group, full)
            return
        self.run_rule(param, grad, state, self.hyper(group, state["step"]), stream=self.stream(group, state, param),
                      full=full)

    def update_fallback(self, group: dict, items: list) -> None:
        """The PyTorch path for items whose Triton kernels failed: the multi-tensor path where it applies (their
        per-tensor state, created for Triton, moves into flat buffers at the first such step), tensor by tensor
        otherwise. The same math as their Triton kernels."""
        self._update_on_pytorch(group, items, self.multi_tensor_eligible)

    def _update_on_pytorch(self, group: dict, items: list, on_flat_path) -> None:
        """The multi-tensor path for the items ``on_flat_path(full, param)`` accepts, tensor by tensor the rest."""
        flat_items = []
        for param, grad, state, full in items:
            if on_flat_path(full, param):
                flat_items.append((param, grad, state, full))
            else:
                self.update_tensor(param, grad, state, group, full)
        if flat_items:
            self.update_flat(group, flat_items)

    # The multi-tensor path runs its own compiled kernels: under an outer torch.compile(optimizer.step) it runs as
    # it is (dynamo would otherwise specialize on every step's learning rate and bias corrections).
    @torch._disable_dynamo
    def update_flat(self, group: dict, items: list) -> None:
        """The multi-tensor path for ``items``: state that a loaded state dict replaced is first moved into flat
        buffers; then one flat step per flat buffer and step count."""
        flats = self.store.flat(self.label)
        located = [flats.locate(full, state) for _, _, state, full in items]
        homeless = [(full, param, state, slot_layouts(state, self.slots))
                    for (param, _, state, full), place in zip(items, located) if place is None]
        if homeless:  # a loaded state dict (or the Triton path, before a fallback) made their state: move it in
            self.store.replaced()  # their state tensors are replaced by views of flat buffers
            for piece in fast_paths.adoption_pieces(homeless):
                flats.adopt(self.slots, piece, self.store.allocate)
            located = [place or flats.locate(full, state) for (_, _, state, full), place in zip(items, located)]
        batches: dict[tuple, tuple[FlatState, list]] = {}
        ordinals: dict[int, dict[int, int]] = {}  # per flat buffer: member index -> parameter ordinal
        for (param, grad, state, _), (flat, index) in zip(items, located):
            batches.setdefault((id(flat), state["step"]), (flat, []))[1].append((index, param, grad))
            if group[SR_KEY]:
                ordinals.setdefault(id(flat), {})[index] = self.plan.ordinals[id(state)]
        for (_, step), (flat, members) in batches.items():
            members.sort(key=lambda member: member[0])
            stream = self.plan.flat_stream(group, step, members[0][1], ordinals.get(id(flat), {}))
            self.step_flat(group, flat, members, self.hyper(group, step), stream)

    def step_flat(self, group: dict, flat: FlatState, members: list, hyper, stream=None) -> None:
        """Update ``members`` = ``[(index in flat, local param, local grad)]``, sorted by index, whose state is in
        ``flat``: one call per chunk of flat state (``stream``: its ``ordinals`` by member index)."""
        if self.update is not None and self.update.flat is not None:
            self.update.flat(self, group, flat, members, hyper, stream)
            return
        for run, params, grads in multi_tensor.runs_of(flat, members):
            multi_tensor.step_run(self.rule, flat, multi_tensor.cached_chunks(flat, run), params, grads, hyper,
                                  self.scratch, stream=stream)
