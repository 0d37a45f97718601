"""One optimizer step of a param group on the Triton kernels: a launch (or one per pass) for all its tensors.

Each runner of an optimizer (``hf_optim.optim.runner``) owns a :class:`TritonPlans`, the cache of its launch plans,
and steps a call's tensors with ``plans.prepare(...)`` then ``.run(group, hypers, ordinals)``: everything the kernels
need comes in as arguments, nothing here calls the optimizer. Everything algorithm-specific comes from its
description (an :class:`~hf_optim.core.algorithm.Algorithm`): its Triton rule, its scalars (computed on the host
by the optimizer as in the PyTorch path, passed as kernel arguments in the field order of its ``hyper`` class:
nothing here reads a device value, so a step never waits for the GPU, and changing scalars never recompiles) and its
:class:`~hf_optim.core.algorithm.TritonPlan`: one launch of the fused elementwise kernel, or the algorithm's own
passes (LAMB's and Adafactor's ``triton_passes.step``, beside their algorithms). Tensors whose step counters differ
(a parameter that had no gradient for a while) go in separate launches, one per distinct step; so do tensors whose
kernels are specialized differently (parameter or gradient dtype, state formats: :func:`kernel_group`), since each
compiled kernel holds exactly one such combination.

That grouping, the state formats and addresses and the launch tables do not change between steps, so a plan keeps
them; a step only checks, in one pass over its tensors, that nothing they were built from changed, and writes new
gradient addresses into the tables (:class:`TritonPlans` lists what is checked).

What takes the PyTorch path instead, with identical math: non-contiguous parameters; algorithms with no Triton
rule or plan; shards of sharded (DTensor) parameters when the plan reduces over the whole tensor (LAMB's norms,
Adafactor's statistics); empty parameters when the plan cannot take them (Adafactor: nothing to reduce);
optimizers whose class replaces the algorithm's ``rule`` (the optimizer does not send them here);
tensors of 2^31 elements or more (the kernels index elements with 32-bit offsets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import defaultdict

import torch

from hf_optim.core.algorithm import Algorithm, kernel_scalars
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.kernels.triton_path import multi_tensor as mt
from hf_optim.kernels.triton_path.elementwise import FusedConfig
from hf_optim.kernels.triton_path.elementwise import launch as launch_fused
from hf_optim.kernels.triton_path.rows import rows_for_code
from hf_optim.kernels.triton_path.tile import BF16, DTYPE_NAMES, dtype_code
from hf_optim.numerics import rounding

MAX_NUMEL = (1 << 31) - 1
"""Largest tensor the kernels index (32-bit element offsets); larger ones take the PyTorch path."""
MAX_CACHED_ROWS = 1 << 16
"""Most tensors (rows of launch tables) :class:`TritonPlans` keeps plans for; the oldest plans go first."""


def supported(algorithm: Algorithm | None, param: torch.Tensor, sharded: bool) -> bool:
    """Whether ``param`` (a local tensor) can be updated by ``algorithm``'s Triton kernels (the optimizer decides
    whether its class runs the algorithm's own rule: a subclass that replaced it never reaches the kernels)."""
    if algorithm is None or not algorithm.runs_on_triton or not param.is_contiguous():
        return False
    plan = algorithm.triton_plan
    if (sharded and not plan.shards) or (param.numel() == 0 and not plan.empty) or param.numel() > MAX_NUMEL:
        return False
    return param.dtype in (torch.float32, torch.bfloat16, torch.float16)


def kernel_group(specs, param: torch.Tensor, grad: torch.Tensor, state: dict) -> tuple:
    """What a tensor's kernels are specialized on: ``(parameter dtype code, gradient dtype code, format code of each
    state row, aligned)`` (rows of the slots its state holds, a stacked slot giving one per row; ``aligned``: every
    address the kernels stream is 16-byte aligned, which whole tiles need for vector accesses. An AdEMAMix state's
    second row is not when ``n`` is not a multiple of 16: such tensors get launches of their own, so that they do
    not take the vector accesses away from the rest)."""
    present = tuple(spec for spec in specs if spec.key in state)
    rows = mt.state_rows(state, present)
    aligned = all(address % 16 == 0 for address in (param.data_ptr(), grad.data_ptr(), *(row[0] for row in rows)))
    return dtype_code(param.dtype), dtype_code(grad.dtype), tuple(row[2] for row in rows), aligned


@dataclasses.dataclass
class _Batch:
    """Tensors that run one configuration of kernels together (one device, step counter and kernel group)."""

    device: torch.device
    offset: int
    """Its step counter minus that of the call's first tensor."""
    kinds: tuple
    indices: list[int]
    """Positions of its tensors in the call's items."""
    config: triton_guard.KernelConfig
    rounded: bool
    host_meta: torch.Tensor | None = None
    """Elementwise plans: the launch's ``meta`` table on the host (int64), for refreshing gradient addresses."""
    launch: mt.Launch | None = None
    launches: list = dataclasses.field(default_factory=list)
    """Elementwise plans: ``(fused config, tiles table, number of tiles)`` per non-empty kind of tile."""
    positions: torch.Tensor | None = None
    """``indices`` as an int64 tensor (None when they are 0, 1, ..., n-1 of an n-tensor call)."""


@dataclasses.dataclass
class _Plan:
    """A call's cached launches and what they were built from (compared at every step)."""

    states: tuple
    """The state dicts, in item order; held so that their ``id`` stays theirs while the plan is cached."""
    params: list
    offsets: tuple | None
    grad_dtypes: list
    misaligned: list
    grad_addresses: list
    unsupported: list[int]
    batches: list[_Batch]
    rows: int


class TritonPlans:
    """One optimizer's Triton launch plans, kept between steps; the optimizer owns it and clears it
    (:meth:`clear`) whenever it reallocates state (a loaded state dict, state moved into flat buffers).

    A call (:meth:`prepare`) is identified by its param group index, stochastic rounding and the identity of its
    tensors' state dicts, in order: a parameter that gets its first gradient, one with no gradient at this step,
    per-parameter overrides (their own calls) or edited param groups give another call and another plan. At every
    step the plan is checked against what it was built from, in O(tensors) with a small constant: each parameter's
    address, dtype, contiguity and element count and whether it is sharded; each state's step counter relative to
    the first; each gradient's dtype and 16-byte alignment. Any difference rebuilds the plan (what an uncached step
    did). Gradients at new addresses only (``zero_grad(set_to_none=True)``) refresh the gradient column of the
    ``meta`` tables: one vectorized write and one pinned host-to-device copy per launch table; unchanged gradients
    cost no copy at all. Scalars (learning rate, step, bias corrections) are arguments of every launch.

    Args:
        algorithm: the algorithm whose kernels run.
        max_rows (default :data:`MAX_CACHED_ROWS`): most tensors over all cached plans; the oldest plans are
            dropped beyond it.
    """

    def __init__(self, algorithm: Algorithm, max_rows: int = MAX_CACHED_ROWS) -> None:
        self.algorithm = algorithm
        self.max_rows = max_rows
        self.tables = mt.PlanCache()
        """Device tables of algorithms with their own passes (LAMB, Adafactor) and bf16 rounding ordinals."""
        self._plans: dict[tuple, _Plan] = {}
        self.builds = 0
        """How many plans were built (tests and benchmarks read it)."""

    def clear(self) -> None:
        """Forget every plan (state was reallocated)."""
        self._plans.clear()
        self.tables = mt.PlanCache()

    def prepare(self, group_index: int, items: list, stochastic: bool) -> GroupStep:
        """The step of ``items`` = ``[(local param, local grad, state, param), ...]`` of param group
        ``group_index`` (``stochastic``: the group rounds bf16 parameters stochastically), from its cached plan
        refreshed or rebuilt as needed (see the class). The returned step lists the items the kernels cannot take
        (``unsupported``) and the step counters whose scalars :meth:`GroupStep.run` needs (``steps``)."""
        states = tuple(item[2] for item in items)
        grads = [item[1].contiguous() for item in items]
        key = (group_index, stochastic, tuple(map(id, states)))
        params = [(p.data_ptr(), p.dtype, p.is_contiguous(), p.numel(), p is not full) for p, _, _, full in items]
        steps = [state["step"] for state in states]
        offsets = None if steps.count(steps[0]) == len(steps) else tuple(s - steps[0] for s in steps)
        addresses = list(map(torch.Tensor.data_ptr, grads))
        grad_dtypes = [g.dtype for g in grads]
        misaligned = [index for index, address in enumerate(addresses) if address & 15]
        plan = self._plans.get(key)
        if (plan is None or plan.params != params or plan.offsets != offsets or plan.grad_dtypes != grad_dtypes
                or plan.misaligned != misaligned):
            plan = self._build(key, items, grads, stochastic, params, offsets, grad_dtypes, misaligned, addresses)
        elif plan.grad_addresses != addresses:
            _refresh_gradients(plan, addresses)
        return GroupStep(self, group_index, plan, items, grads, steps[0])

    def _build(self, key, items, grads, stochastic, params, offsets, grad_dtypes, misaligned, addresses) -> _Plan:
        self.builds += 1
        self._plans.pop(key, None)
        plan = build_plan(self.algorithm, items, grads, stochastic)
        plan.params, plan.offsets, plan.grad_dtypes, plan.misaligned = params, offsets, grad_dtypes, misaligned
        plan.grad_addresses = addresses
        total = plan.rows + sum(cached.rows for cached in self._plans.values())
        while self._plans and total > self.max_rows:
            total -= self._plans.pop(next(iter(self._plans))).rows
        self._plans[key] = plan
        return plan

    def plan_tables(self, group_index: int, items: list, stochastic: bool) -> list:
        """The cached plan of a call as plain values (tests compare it with :func:`build_plan`'s), after
        :meth:`prepare`: see :func:`describe`."""
        key = (group_index, stochastic, tuple(id(item[2]) for item in items))
        return describe(self._plans[key])


def build_plan(algorithm: Algorithm, items: list, grads: list, stochastic: bool) -> _Plan:
    """A plan for ``items`` built from scratch: tensors the kernels take go in batches of one device, one step
    counter and one kernel group (:func:`kernel_group`); each elementwise batch gets its launch tables."""
    states = tuple(item[2] for item in items)
    base = states[0]["step"]
    batches: dict[tuple, list[int]] = defaultdict(list)
    unsupported = []
    for index, (param, _, state, full) in enumerate(items):
        if not supported(algorithm, param, param is not full):
            unsupported.append(index)
            continue
        kinds = kernel_group(algorithm.slots, param, grads[index], state)
        batches[(param.device, state["step"] - base, kinds)].append(index)
    planned = []
    for (device, offset, kinds), indices in batches.items():
        rounded = stochastic and kinds[0] == BF16.value
        batch = _Batch(device, offset, kinds, indices, configuration(algorithm, kinds, stochastic=rounded), rounded)
        if indices != list(range(len(items))):
            batch.positions = torch.tensor(indices, dtype=torch.int64)
        if algorithm.triton_plan.elementwise:
            config = fused_config(algorithm, kinds, device, stochastic=rounded)
            table = mt.meta_rows([(items[i][0], grads[i], states[i]) for i in indices], algorithm.slots,
                                 config.tile_blocks)
            batch.host_meta = torch.tensor(table, dtype=torch.int64).reshape(len(table), mt.META_COLS)
            batch.launch = mt.launch_tables(table, batch.host_meta, config.tile_blocks, device)
            batch.launches = [(dataclasses.replace(config, full=whole, aligned=config.aligned and batch.launch.aligned),
                               tiles, count) for whole, tiles, count in batch.launch.tables()]
        planned.append(batch)
    rows = len(items)
    return _Plan(states, [], None, [], [], [], unsupported, planned, rows)


def _refresh_gradients(plan: _Plan, addresses: list[int]) -> None:
    """Write the gradients' new ``addresses`` into the plan's ``meta`` tables (one vectorized write and one
    non-blocking copy per table: the previous table may still be read by a launch in flight, so a new one is
    made)."""
    column = torch.tensor(addresses, dtype=torch.int64)
    for batch in plan.batches:
        if batch.host_meta is None:
            continue
        host = batch.host_meta.clone()
        host[:, mt.GRAD] = column if batch.positions is None else column[batch.positions]
        batch.host_meta = host
        batch.launch = dataclasses.replace(batch.launch, meta=mt.to_device(host, torch.int64, batch.device))
    plan.grad_addresses = addresses


def describe(plan: _Plan) -> list:
    """A plan as plain values: per batch its device, step offset, kernel group, tensor positions and, for
    elementwise plans, its ``meta`` table, tile tables and launch configurations."""
    out = []
    for batch in plan.batches:
        entry = [str(batch.device), batch.offset, batch.kinds, batch.indices, batch.config.key]
        if batch.launch is not None:
            entry += [batch.host_meta.tolist(), batch.launch.meta.cpu().tolist(),
                      batch.launch.whole_tiles.cpu().tolist(), batch.launch.partial_tiles.cpu().tolist(),
                      [(config, count) for config, _, count in batch.launches]]
        out.append(entry)
    return [plan.unsupported, out]


class GroupStep:
    """One step of a call's tensors on the Triton kernels, from a :class:`TritonPlans` plan."""

    def __init__(self, plans: TritonPlans, group_index: int, plan: _Plan, items: list, grads: list, base: int):
        self._plans, self._group_index, self._plan = plans, group_index, plan
        self._items, self._grads, self._base = items, grads, base
        self.unsupported = [items[i] for i in plan.unsupported]
        """Items the kernels cannot take (the PyTorch path runs them)."""
        self.steps = {base + batch.offset for batch in plan.batches}
        """The step counters of the batches (each needs its algorithm scalars)."""

    def run(self, group: dict, hypers: dict, ordinals: dict | None = None) -> list:
        """Launch every batch. ``hypers``: the algorithm's scalars (``definition.hyper``, from ``hyper_at``) per
        step counter in :attr:`steps`; ``ordinals`` (``id(state)`` -> parameter ordinal), when the group has
        ``bf16_stochastic_round``: bf16 parameters are rounded stochastically
        (:mod:`hf_optim.kernels.triton_path.rounding`).

        Each batch is one run of the algorithm's kernels, compiled for exactly its dtypes and formats, through
        :mod:`hf_optim.kernels.triton_path.guard` (every kernel of the batch compiled and loaded before any launches).
        Returns the items it did NOT update, untouched: those of kernel configurations that failed to compile or
        load on their device; the caller runs them on the PyTorch path."""
        algorithm = self._plans.algorithm
        plan, items = self._plan, self._items
        skipped = []
        for batch in plan.batches:
            device, step = batch.device, self._base + batch.offset
            if triton_guard.failed(batch.config, device):
                skipped.extend(items[i] for i in batch.indices)
                continue
            hyper = hypers[step]
            key = (self._group_index, device, batch.offset, batch.kinds)
            stochastic = None
            if batch.rounded:
                values = [ordinals[id(items[i][2])] for i in batch.indices]
                stochastic = (self._plans.tables.table(("bf16 ordinals", *key), values, torch.int64, device),
                              mt.to_device(rounding.key_tensor(group["bf16_stochastic_round_seed"], step),
                                           torch.int64, device))
            if algorithm.triton_plan.elementwise:
                work = functools.partial(_launch_fused, batch, kernel_scalars(hyper), stochastic)
            else:
                work = functools.partial(algorithm.resolve(algorithm.triton_plan.step), algorithm, group, key,
                                         [(items[i][0], self._grads[i], items[i][2]) for i in batch.indices], step,
                                         hyper, self._plans.tables, device, stochastic)
            with _on(device):
                if not triton_guard.run(batch.config, device, work):
                    skipped.extend(items[i] for i in batch.indices)
        return skipped


def _launch_fused(batch: _Batch, scalars: tuple, stochastic) -> None:
    """The fused kernel over an elementwise batch: a launch for the whole tiles, one for the partial ones
    (``stochastic``: bf16 stochastic rounding's ``(ordinals, key)``)."""
    for config, tiles, count in batch.launches:
        launch_fused(config, batch.launch.meta, tiles, count, scalars, batch.device, stochastic=stochastic)


def configuration(algorithm: Algorithm, kinds: tuple, stochastic: bool) -> triton_guard.KernelConfig:
    """The kernel configuration of a batch (:mod:`triton_guard`): the fused kernel with the algorithm's rule, or its
    own passes, specialized for the batch's kernel group (:func:`kernel_group`) and bf16 stochastic rounding; its
    whole-tile and partial-tile kernels (and LAMB's or Adafactor's other passes) are prepared together."""
    kind = "fused" if algorithm.triton_plan.elementwise else "passes"
    param_dtype, grad_dtype, formats, aligned = kinds
    grads = "" if grad_dtype == param_dtype else f" ({DTYPE_NAMES[grad_dtype]} gradients)"
    states = "/".join(sorted({rows_for_code(code).label for code in formats})) or "no state"
    label = (f"{kind}/{algorithm.name} {DTYPE_NAMES[param_dtype]}{grads} {states}"
             f"{'' if aligned else ' unaligned'}{' (bf16 stochastic rounding)' if stochastic else ''}")
    return triton_guard.KernelConfig((kind, algorithm.name, *kinds, stochastic), label)


def _on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current device and stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "xpu":
        return torch.xpu.device(device)
    return contextlib.nullcontext()


def fused_config(algorithm: Algorithm, kinds: tuple, device: torch.device, *, stochastic: bool,
                 write_out: bool = False) -> FusedConfig:
    """The fused kernel's configuration for a batch of kernel group ``kinds`` on ``device`` (whole tiles: the
    launch makes the partial-tile twin)."""
    param_dtype, grad_dtype, formats, aligned = kinds
    signed = mt.row_signedness(algorithm.slots)[: len(formats)]
    rule = algorithm.resolve(algorithm.triton_rule)
    return FusedConfig(algorithm.name, rule, formats, signed, param_dtype, grad_dtype, full=True, stochastic=stochastic,
                       write_out=write_out, aligned=aligned, arch=device_arch(device))


@functools.cache
def device_arch(device: torch.device) -> int:
    """CUDA compute capability ``major * 10 + minor`` of ``device`` (the kernels' tile width and register limit
    depend on it); 0 for other devices (the interpreter, ROCm, XPU): no NVIDIA-specific choice."""
    if device.type == "cuda" and not torch.version.hip:
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor
    return 0
