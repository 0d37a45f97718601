"""Quantized state of a sharded (FSDP2) parameter with the whole tensor's scales: a rank's blocks are the blocks one
process forms from the whole tensor, so a run's results do not depend on how many ranks share a tensor, and its
checkpoints need not record it.

A rank steps its :class:`~hf_optim.optim.shard_layout.Part` of the tensor. Each quantized slot holds the part's span
(the whole runs of its format's scales the part touches, :mod:`~hf_optim.optim.shard_layout`); a tensor none of whose
runs is split by a shard boundary keeps the plain layout of its local tensor and steps as any tensor does (on every
path, Triton included). For a tensor with split runs, on every rank of its shard group:

- the part's whole runs step as any tensor does (``multi_tensor.step_tensor``: chunked, compiled where it can be);
- each split run steps eagerly on this rank's elements of it; their new values, padded with zeros to the whole run
  (a zero never raises a maximum), give this rank's part of the run's scale, and the run waits:
  :class:`PendingScales` collects a step's partial scales, one all-reduce (max) per shard group brings the whole
  tensor's, and the waiting runs are then encoded against them (:meth:`PendingScales.flush`, at the end of the
  optimizer's step). Tensors without split runs add nothing to it;
- a format with scales across runs (rank-1 4-bit's column scales, :class:`hf_optim.formats.base.Scales`) needs every
  element's new value before any can be encoded: its tensors step whole, eagerly, on this rank's part, with one
  all-reduce per tensor of its split runs' and its columns' scales, the way Adafactor's statistics are reduced.

Every operation of the rule is elementwise and every scale a maximum, so each element sees the values, scales and
codes it has in one process: the results are the single-process results bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_optim.core.state_store import StateSpec, slot_format
from hf_optim.formats import SlotLayout, StateFormat
from hf_optim.formats.base import Scales
from hf_optim.kernels.torch_path import elementwise, multi_tensor
from hf_optim.numerics import rounding
from hf_optim.optim.shard_layout import Part, Span


@dataclass(frozen=True)
class SlotGeometry:
    """How one quantized slot of a part is laid out: the slot holds ``numel`` elements per row, the part's
    elements from ``offset``; its scales' runs are the tensor's runs ``[span.first, span.first + span.runs)``.
    ``spanned``: the slot holds the whole span (it has split runs); otherwise it is the local tensor's own."""

    scales: tuple[Scales, ...]
    span: Span
    split: tuple[int, ...]
    spanned: bool

    @property
    def run(self) -> int:
        return self.span.run

    @property
    def offset(self) -> int:
        return self.span.offset if self.spanned else 0

    def numel(self, part: Part) -> int:
        return self.span.numel if self.spanned else part.length

    @property
    def across(self) -> bool:
        """Whether a scale covers elements of every run (a column): the slot steps whole."""
        return any(scale.across for scale in self.scales)

    def touched_split(self) -> list[tuple[int, int]]:
        """``(index in split, tensor run)`` of the split runs this part touches."""
        last = self.span.first + self.span.runs
        return [(i, run) for i, run in enumerate(self.split) if self.span.first <= run < last]


def geometry(part: Part, fmt: StateFormat, spec: StateSpec) -> SlotGeometry | None:
    """The layout of slot ``spec`` in format ``fmt`` on ``part`` (None: a format without scales, whose slot is
    the local tensor's elements). Remembered per part, format and slot."""
    key = ("geometry", fmt.name, spec)
    found = part._split.get(key, False)
    if found is False:
        scales = fmt.scales(spec, part.shape)
        if not scales and fmt.quantized and part.shards > 1:
            raise ValueError(
                f"{fmt.name} state of a tensor sharded over {part.shards} ranks (FSDP2): the format does not declare "
                "its scales (StateFormat.scales), so a shard cannot quantize with the whole tensor's blocks; "
                "use state_format='blockwise4' (4-bit) or 'blockwise8' under FSDP2")
        if not scales:
            found = None
        else:
            run = scales[0].run
            if any(scale.run != run for scale in scales):
                raise ValueError(f"state format {fmt.name!r} declares scales of different runs for {spec.key}")
            split = part.split_runs(run) if part.shards > 1 else ()
            found = SlotGeometry(tuple(scales), part.span(run), split, bool(split))
        part._split[key] = found
    return found


def steps_apart(part: Part, state: dict, specs: Sequence[StateSpec]) -> bool:
    """Whether ``part``'s state needs this module's step: a quantized slot with split runs or column scales, on a
    shard group of more than one rank (the same answer on every rank of the group)."""
    if part.shards < 2:
        return False
    for spec in specs:
        if spec.key not in state:
            continue
        geo = geometry(part, slot_format(state, spec), spec)
        if geo is not None and (geo.spanned or geo.across):
            return True
    return False


def stand_in(part: Part, fmt: StateFormat, spec: StateSpec, local: torch.Tensor) -> torch.Tensor:
    """What to allocate slot ``spec`` for (``StateFormat.init_slot``'s ``param``): the local tensor, or, for a slot
    that holds the whole span, a tensor of the span's shape (a view of one element: nothing is allocated)."""
    geo = geometry(part, fmt, spec)
    if geo is None or not geo.spanned:
        return local
    shape = fmt.span_shape(spec, part.shape, geo.span.runs)
    return torch.empty((), dtype=local.dtype, device=local.device).expand(shape)


# --------------------------------------------------------------------------------------------------------------
# Partial scales of split runs, reduced once per step and shard group


@dataclass
class _Waiting:
    position: int
    partial: torch.Tensor  # (rows, 1): this rank's part of the run's scale
    finish: Callable[[torch.Tensor], None]  # encodes the run against the whole scale (rows, 1)


class _GroupScales:
    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device
        self.length = 0
        self.waiting: list[_Waiting] = []


class PendingScales:
    """The split runs of a step waiting for the whole tensor's scales (see the module). Every rank of a shard group
    reserves the same entries in the same order (:meth:`reserve`: the tensor's split runs, from its global shape),
    whether or not it holds a part of them, so one all-reduce per group serves every tensor of the step."""

    def __init__(self) -> None:
        self._groups: dict[int, _GroupScales] = {}

    def reserve(self, part: Part, count: int, device: torch.device) -> int:
        """Reserve ``count`` entries in ``part``'s group; returns the first one's position."""
        found = self._groups.get(id(part.group))
        if found is None:
            found = self._groups[id(part.group)] = _GroupScales(part.group, device)
        position = found.length
        found.length += count
        return position

    def wait(self, part: Part, position: int, partial: torch.Tensor, finish: Callable[[torch.Tensor], None]) -> None:
        """A run whose ``partial`` scale (rows, 1) fills entries ``[position, position + rows)``; ``finish(scale)``
        encodes it once the whole scale is known."""
        self._groups[id(part.group)].waiting.append(_Waiting(position, partial, finish))

    def flush(self) -> None:
        """Reduce every group's partial scales (one all-reduce each) and encode the waiting runs."""
        if not self._groups:
            return
        import torch.distributed as dist

        groups, self._groups = self._groups, {}
        for found in groups.values():
            scales = torch.zeros(found.length, dtype=torch.float32, device=found.device)
            for waiting in found.waiting:
                rows = waiting.partial.shape[0]
                scales[waiting.position : waiting.position + rows] = waiting.partial.reshape(rows)
            dist.all_reduce(scales, op=dist.ReduceOp.MAX, group=found.group)
            for waiting in found.waiting:
                rows = waiting.partial.shape[0]
                waiting.finish(scales[waiting.position : waiting.position + rows].view(rows, 1))


# --------------------------------------------------------------------------------------------------------------
# The step


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)


def step(rule, specs: Sequence[StateSpec], part: Part, param: torch.Tensor, grad: torch.Tensor, state: dict,
         hyper, out: torch.Tensor | None, stream: rounding.Stream | None, pending: PendingScales) -> None:
    """One elementwise step of ``param``, this rank's part of a sharded tensor (see the module); ``out``: write
    the rule's output there instead (LAMB's direction, Muon's update)."""
    flat_param = param.view(-1) if param.is_contiguous() else param.contiguous().view(-1)
    slots = _slots(part, state, specs)
    if any(geo is not None and geo.across for _, _, geo, _ in slots):
        _step_whole(rule, part, slots, flat_param, grad.reshape(-1), state, hyper, out, stream)
    else:
        _step_runs(rule, part, slots, flat_param, grad.reshape(-1), hyper, out, stream, pending)
    if not param.is_contiguous():
        param.copy_(flat_param.view_as(param))


def _slots(part: Part, state: dict, specs: Sequence[StateSpec]) -> list[tuple]:
    """``(spec, format, geometry, raw tensors)`` of each slot."""
    found = []
    for spec in specs:
        fmt = slot_format(state, spec)
        found.append((spec, fmt, geometry(part, fmt, spec), fmt.raw(state, spec)))
    return found


def _stochastic(stream, out, start: int, stop: int, device) -> tuple | None:
    if stream is None or out is not None:
        return None
    return rounding.tensor_bases(stream.ordinal, start, stop, False, device), stream.key


def _step_runs(rule, part: Part, slots: list, param: torch.Tensor, grad: torch.Tensor, hyper, out, stream,
               pending: PendingScales) -> None:
    """The part's whole runs through ``multi_tensor.step_tensor``, each split run on its own (its encoding waits
    in ``pending``)."""
    runs = {geo.run for _, _, geo, _ in slots if geo is not None and geo.spanned}
    if len(runs) != 1:
        raise ValueError(f"the slots of one tensor have split scales of {len(runs)} run lengths ({sorted(runs)}) and "
                         "no column scales: not a layout hf_optim's formats have")
    run = runs.pop()
    reserved = {}
    for spec, _, geo, _ in slots:
        if geo is not None and geo.split:
            reserved[spec.key] = pending.reserve(part, spec.rows * len(geo.split), param.device)
    length = part.length
    if not length:
        return
    first_split = part.start % run != 0
    last_split = part.stop % run != 0 and part.stop < part.total
    lo = min(length, -part.start % run) if first_split else 0
    hi = max(lo, length - part.stop % run) if last_split else length
    if hi > lo:
        tensors = [t for _, fmt, geo, raw in slots for t in _elements(fmt, geo, raw, lo, hi)]
        multi_tensor.step_tensor(rule, [SlotLayout(fmt, spec.signed) for spec, fmt, _, _ in slots], param[lo:hi],
                                 grad[lo:hi], None if out is None else out[lo:hi], tensors, hyper, stream=stream,
                                 index_offset=lo)
    for tensor_run in sorted({part.start // run, (part.stop - 1) // run}):
        if (tensor_run == part.start // run and first_split) or (tensor_run == (part.stop - 1) // run and last_split):
            _step_split_run(rule, part, slots, param, grad, hyper, out, stream, pending, reserved, tensor_run, run)


def _elements(fmt: StateFormat, geo: SlotGeometry | None, raw, lo: int, hi: int) -> list[torch.Tensor]:
    """The raw tensors of the part's elements ``[lo, hi)`` (whole runs, or up to the tensor's end)."""
    offset = 0 if geo is None else geo.offset
    return fmt.slice_raw(raw, offset + lo, offset + hi, False)


def _step_split_run(rule, part: Part, slots: list, param, grad, hyper, out, stream, pending: PendingScales,
                    reserved: dict, tensor_run: int, run: int) -> None:
    """Step this rank's elements of split run ``tensor_run``; its quantized slots wait for the run's scale."""
    run_start = tensor_run * run
    lo, hi = max(part.start, run_start) - part.start, min(part.stop, run_start + run) - part.start
    lanes = slice(lo + part.start - run_start, hi + part.start - run_start)
    olds, raws = [], []
    for spec, fmt, geo, raw in slots:
        if geo is None:
            olds.append(fmt.dequantize(fmt.slice_raw(raw, lo, hi, False), spec.signed, hi - lo))
            raws.append(None)
            continue
        at = (tensor_run - geo.span.first) * run
        run_raw = fmt.slice_raw(raw, at, at + run, False)
        olds.append(fmt.dequantize(run_raw, spec.signed, run)[:, lanes])
        raws.append(run_raw)
    news = elementwise.update_values(rule, param[lo:hi], grad[lo:hi], None if out is None else out[lo:hi], olds,
                                     hyper, _stochastic(stream, out, lo, hi, param.device))
    for (spec, fmt, geo, raw), run_raw, new in zip(slots, raws, news):
        if geo is None:
            fmt.store(new, fmt.slice_raw(raw, lo, hi, False), spec.signed)
            continue
        placed = torch.zeros((spec.rows, run), dtype=torch.float32, device=param.device)
        placed[:, lanes] = new
        partial = fmt.scales_of(placed, run_raw, spec.signed)[0]
        position = reserved[spec.key] + geo.split.index(tensor_run) * spec.rows
        pending.wait(part, position, partial, _encoder(fmt, placed, run_raw, spec.signed))


def _encoder(fmt: StateFormat, values: torch.Tensor, raw, signed: bool) -> Callable[[torch.Tensor], None]:
    return lambda scale: fmt.store(values, raw, signed, [scale])


def _step_whole(rule, part: Part, slots: list, param: torch.Tensor, grad: torch.Tensor, state: dict, hyper, out,
                stream) -> None:
    """Step the whole part eagerly, then reduce every split run's and column's scale in one all-reduce."""
    length = part.length
    if not length:  # an empty part still takes its place in the group's all-reduce
        _reduce_empty(part, [(spec, geo) for spec, _, geo, _ in slots if geo is not None], state, param.device)
        return
    olds = []
    for spec, fmt, geo, raw in slots:
        offset, numel = (0, length) if geo is None else (geo.offset, geo.numel(part))
        olds.append(fmt.dequantize(raw, spec.signed, numel)[:, offset : offset + length])
    news = elementwise.update_values(rule, param, grad, out, olds, hyper,
                                     _stochastic(stream, out, 0, length, param.device))
    placed_slots = []
    for (spec, fmt, geo, raw), new in zip(slots, news):
        if geo is None:
            fmt.store(new, raw, spec.signed)
            continue
        placed = _placed(geo, part, spec, new)
        placed_slots.append((spec, fmt, geo, raw, placed, fmt.scales_of(placed, raw, spec.signed)))
    reduce_whole(part, [(spec.rows, geo, partial) for spec, _, geo, _, _, partial in placed_slots])
    for spec, fmt, _, raw, placed, partial in placed_slots:
        fmt.store(placed, raw, spec.signed, partial)


def _reduce_empty(part: Part, slots: list[tuple[StateSpec, SlotGeometry]], state: dict, device) -> None:
    """An empty part's share of a whole-tensor reduction: zeros in, and the whole tensor's column scales kept, as
    every rank keeps them (a checkpoint may take them from any rank)."""
    partial = [_no_scales(geo, spec.rows, device) for spec, geo in slots]
    reduce_whole(part, [(spec.rows, geo, scales) for (spec, geo), scales in zip(slots, partial)])
    for (spec, geo), scales in zip(slots, partial):
        for scale, values in zip(geo.scales, scales):
            if scale.across:
                state[scale.key].view(spec.rows, -1).copy_(values)


def _no_scales(geo: SlotGeometry, rows: int, device) -> list[torch.Tensor]:
    """The partial scales of an empty part: none of its runs, zero for every column."""
    return [torch.zeros((rows, scale.run if scale.across else 0), dtype=torch.float32, device=device)
            for scale in geo.scales]


def reduce_whole(part: Part, slots: list[tuple[int, SlotGeometry, list[torch.Tensor]]]) -> None:
    """Replace, in place, each slot's partial scales (``(rows, geometry, [scales per Scales])``) of its split runs
    and its column scales by the whole tensor's: one all-reduce (max) over ``part``'s shard group."""
    import torch.distributed as dist

    pieces, length = [], 0
    for rows, geo, partial in slots:
        for scale, values in zip(geo.scales, partial):
            if scale.across:
                pieces.append((length, values, None))
                length += values.numel()
            else:
                for index, tensor_run in geo.touched_split():
                    pieces.append((length + index * rows, values, tensor_run - geo.span.first))
                length += rows * len(geo.split)
    if not length:
        return
    device = slots[0][2][0].device if slots[0][2] else None
    whole = torch.zeros(length, dtype=torch.float32, device=device)
    for at, values, column in pieces:
        chunk = values.reshape(-1) if column is None else values[:, column]
        whole[at : at + chunk.numel()] = chunk
    dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=part.group)
    for at, values, column in pieces:
        if column is None:
            values.copy_(whole[at : at + values.numel()].view_as(values))
        else:
            values[:, column] = whole[at : at + values.shape[0]]


# --------------------------------------------------------------------------------------------------------------
# Whole-slot reads and writes (an algorithm that is not elementwise: Adafactor's first moment)


def read_part(part: Part, state: dict, spec: StateSpec) -> torch.Tensor:
    """The fp32 values ``(rows, length)`` of this rank's elements of slot ``spec``."""
    fmt = slot_format(state, spec)
    geo = geometry(part, fmt, spec)
    numel, offset = (part.length, 0) if geo is None else (geo.numel(part), geo.offset)
    return fmt.dequantize(fmt.raw(state, spec), spec.signed, numel)[:, offset : offset + part.length]


def write_part(part: Part, state: dict, spec: StateSpec, values: torch.Tensor, pending: PendingScales) -> None:
    """Store fp32 ``values`` ``(rows, length)`` as this rank's elements of slot ``spec``, with the whole tensor's
    scales: split runs wait in ``pending`` (call it on every rank of the group, also for an empty part)."""
    fmt = slot_format(state, spec)
    geo = geometry(part, fmt, spec)
    raw = fmt.raw(state, spec)
    if geo is None or part.shards < 2 or not (geo.spanned or geo.across):
        fmt.store(values.contiguous(), raw, spec.signed)
        return
    length, device = part.length, values.device
    if geo.across:  # every element waits for the columns: reduce now, the way the step does
        if not length:
            _reduce_empty(part, [(spec, geo)], state, device)
            return
        placed = _placed(geo, part, spec, values)
        partial = fmt.scales_of(placed, raw, spec.signed)
        reduce_whole(part, [(spec.rows, geo, partial)])
        fmt.store(placed, raw, spec.signed, partial)
        return
    reserved = pending.reserve(part, spec.rows * len(geo.split), device)
    if not length:
        return
    placed = _placed(geo, part, spec, values)
    fmt.store(placed, raw, spec.signed)  # every whole run now; each split run again once its scale is known
    for index, tensor_run in geo.touched_split():
        at = (tensor_run - geo.span.first) * geo.run
        run_raw = fmt.slice_raw(raw, at, at + geo.run, False)
        run_values = placed[:, at : at + geo.run]
        partial = fmt.scales_of(run_values, run_raw, spec.signed)[0]
        pending.wait(part, reserved + index * spec.rows, partial, _encoder(fmt, run_values, run_raw, spec.signed))


def _placed(geo: SlotGeometry, part: Part, spec: StateSpec, values: torch.Tensor) -> torch.Tensor:
    """``values`` (rows, length) at the part's place in the slot's elements, zeros elsewhere."""
    placed = torch.zeros((spec.rows, geo.numel(part)), dtype=torch.float32, device=values.device)
    placed[:, geo.offset : geo.offset + part.length] = values
    return placed
