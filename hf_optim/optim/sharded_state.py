"""A sharded (FSDP2) parameter's optimizer state in checkpoints, in the layout of the whole tensor: a
torch.distributed.checkpoint (DCP) checkpoint loads at any number of ranks, and a gathered (full) state dict is the
state dict one process has (bitsandbytes' layout for 8-bit state).

``optimizer.state_dict()`` gives each state tensor of a parameter with a :class:`~hf_optim.optim.shard_layout.Part`
as a DTensor of the tensor one process would hold:

- per-element state (fp32 values, 8-bit and fp8 codes): laid out like the parameter (each rank its own elements);
- per-run scales (absmax, rank-1 row scales) and packed 4-bit codes: sharded in torch.chunk's chunks of their last
  dimension, as DTensor and DCP cut a tensor. A rank's chunk is not exactly what its part holds (a part's runs and
  bytes do not start where the chunk does), so ``state_dict()`` sends the few runs and codes at the ends of each part
  to the rank whose chunk holds them (point to point, within the shard group) and ``load_state_dict()`` sends them
  back (:func:`exchange`);
- scales across runs (rank-1 column scales), maps and step counters: plain tensors, the same on every rank.

Nothing in it records the number of shards. ``state_dict()`` and ``load_state_dict()`` of such an optimizer are
therefore collective over each shard group: every rank calls them, in the same order (as DCP's ``get_state_dict`` /
``set_state_dict`` and accelerate's FSDP checkpoint functions do).

Checkpoints written before this layout kept 8-bit and 4-bit state per shard (:mod:`hf_optim.optim.sharding`'s
padded rows: :func:`per_shard_rows`): they load at the number of shards that saved them, their state re-quantized
with the whole tensor's blocks; at another number they are refused.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from hf_optim.core.state_store import StateSpec
from hf_optim.formats import StateFormat, loaded_format
from hf_optim.formats.base import StateDictError, zeroed_buffer
from hf_optim.optim import sharded_blocks, sharding
from hf_optim.optim.shard_layout import Part, part_of


def _chunks(length: int, shards: int) -> list[tuple[int, int]]:
    """torch.chunk's (and DTensor's ``Shard``) pieces of ``length`` over ``shards`` ranks."""
    size = -(-length // shards) if shards else 0
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(shards)]


def exchange(values: torch.Tensor, have: Sequence[tuple[int, int]], want: Sequence[tuple[int, int]],
             part: Part) -> torch.Tensor:
    """Move entries of a vector split over ``part``'s shard group: ``values`` ``(rows, n)`` are entries
    ``have[i]`` (disjoint ranges covering the vector) on shard ``i = part.index``; returns entries ``want[i]`` (any
    range) ``(rows, m)``, from whichever ranks hold them. Point to point, only between ranks that share entries."""
    import torch.distributed as dist

    me = part.index
    have_lo, want_lo, want_hi = have[me][0], *want[me]
    out = values.new_empty((values.shape[0], max(want_hi - want_lo, 0)))
    ops, received = [], []
    for shard, (lo, hi) in enumerate(have):
        a, b = max(lo, want_lo), min(hi, want_hi)
        if a >= b:
            continue
        if shard == me:
            out[:, a - want_lo : b - want_lo] = values[:, a - have_lo : b - have_lo]
        else:
            buffer = values.new_empty((values.shape[0], b - a))
            ops.append(dist.P2POp(dist.irecv, buffer, group=part.group, group_peer=shard))
            received.append((a, buffer))
    for shard, (lo, hi) in enumerate(want):
        a, b = max(lo, have[me][0]), min(hi, have[me][1])
        if shard != me and a < b:
            ops.append(dist.P2POp(dist.isend, values[:, a - have_lo : b - have_lo].contiguous(), group=part.group,
                                  group_peer=shard))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for a, buffer in received:
        out[:, a - want_lo : a - want_lo + buffer.shape[1]] = buffer
    return out


def _as_dtensor(local: torch.Tensor, param, part: Part, rows: int, length: int):
    """A vector of ``length`` entries per row (``(rows, length)``, the row dimension dropped when ``rows`` is 1) of
    which ``local`` is this rank's torch.chunk piece, as a DTensor sharded over ``part``'s mesh dimension."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = param.device_mesh
    placements = [Replicate()] * mesh.ndim
    placements[part.mesh_dim] = Shard(0 if rows == 1 else 1)
    shape = (length,) if rows == 1 else (rows, length)
    local = local.reshape(-1) if rows == 1 else local
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=(1,) if rows == 1 else (length, 1))


def _run_pieces(part: Part, run: int) -> list[tuple[int, int]]:
    """Per shard, the runs it owns in a checkpoint's exchange: those whose first element it holds."""
    return [(-(-lo // run), -(-hi // run)) for lo, hi in part.parts()]


def _byte_elements(part: Part) -> list[tuple[int, int]]:
    """Per shard, the elements of its torch.chunk piece of packed 4-bit codes (two elements per byte)."""
    return [(2 * lo, min(2 * hi, part.total)) for lo, hi in _chunks(-(-part.total // 2), part.shards)]


# --------------------------------------------------------------------------------------------------------------
# state_dict


def export_slot(fmt: StateFormat, spec: StateSpec, state: dict, param, part: Part) -> dict:
    """The checkpoint entries of slot ``spec`` (format ``fmt``) of ``param``'s state (see the module)."""
    geo = sharded_blocks.geometry(part, fmt, spec)
    rows, out = spec.rows, {}
    scales = {scale.key: scale for scale in geo.scales} if geo is not None else {}
    for key in fmt.keys(spec):
        value = state[key]
        if key == spec.key and (geo is None or not fmt.packed):
            local = _part_of_slot(value, rows, geo, part)
            shape = tuple(sharding.local_tensor(param).shape)
            local = local.reshape(shape if rows == 1 else (rows, *shape))
            if geo is not None and geo.spanned:  # a view inside the span: torch.save cannot pickle a DTensor of
                local = local.clone()  # a view that starts inside its storage (torch 2.13)
            out[key] = sharding.distribute_state(local, param, (None,) * (rows > 1) + tuple(range(param.dim())))
        elif key == spec.key:
            codes = _part_of_slot(fmt.unpack_codes(value.reshape(rows, -1), geo.numel(part)), rows, geo, part)
            wanted = exchange(codes, part.parts(), _byte_elements(part), part)
            out[key] = _as_dtensor(fmt.pack_codes(wanted, spec.signed), param, part, rows, -(-part.total // 2))
        elif key in scales and not scales[key].across:
            run = geo.run
            owned = value.reshape(rows, -1)[:, -(-part.start // run) - geo.span.first : -(-part.stop // run)
                                            - geo.span.first] if part.length else value.reshape(rows, -1)[:, :0]
            count = -(-part.total // run)
            chunk = exchange(owned, _run_pieces(part, run), _chunks(count, part.shards), part)
            out[key] = _as_dtensor(chunk, param, part, rows, count)
        else:  # column scales, maps: the same on every rank of the group
            out[key] = value
    return out


def _part_of_slot(value: torch.Tensor, rows: int, geo, part: Part) -> torch.Tensor:
    """The part's elements ``(rows, length)`` of a slot's per-element tensor (codes or values)."""
    offset = 0 if geo is None else geo.offset
    return value.reshape(rows, -1)[:, offset : offset + part.length]


# --------------------------------------------------------------------------------------------------------------
# load_state_dict


def _whole_or_local(value, param, part: Part, expected_placements) -> tuple[torch.Tensor, bool]:
    """``(tensor, is_whole)``: a DTensor laid out as :func:`export_slot` lays it out gives its local piece; any other
    DTensor is gathered (collective); a plain tensor is the whole tensor (a full state dict)."""
    if sharding.is_dtensor(value):
        if value.device_mesh == param.device_mesh and tuple(value.placements) == tuple(expected_placements):
            return value.to_local(), False
        return value.full_tensor(), True
    return value, True


def _vector_placements(param, part: Part, rows: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    placements = [Replicate()] * param.device_mesh.ndim
    placements[part.mesh_dim] = Shard(0 if rows == 1 else 1)
    return tuple(placements)


def import_slot(fmt: StateFormat, spec: StateSpec, loaded: dict, param, part: Part, device) -> dict:
    """The live state entries of slot ``spec`` from checkpoint entries ``loaded`` (as :func:`export_slot` gives
    them, or a full state dict's whole tensors), checked against the whole tensor's shape."""
    geo = sharded_blocks.geometry(part, fmt, spec)
    local = sharding.local_tensor(param)
    fresh: dict = {}
    fmt.init_slot(fresh, spec, sharded_blocks.stand_in(part, fmt, spec, local) if geo is not None else local,
                  zeroed_buffer)
    rows = spec.rows
    scales = {scale.key: scale for scale in geo.scales} if geo is not None else {}
    for key in fmt.keys(spec):
        value = loaded[key]
        target = fresh[key].view(rows, -1) if key in scales or key == spec.key else None
        if key == spec.key and (geo is None or not fmt.packed):
            element_dims = (None,) * (rows > 1) + tuple(range(param.dim()))
            tensor, whole = _whole_or_local(value, param, part, sharding.element_placements(param, element_dims))
            mine = tensor.reshape(rows, -1)[:, part.start : part.stop] if whole else tensor.reshape(rows, -1)
            _part_of_slot(target, rows, geo, part).copy_(mine)
        elif key == spec.key:
            tensor, whole = _whole_or_local(value, param, part, _vector_placements(param, part, rows))
            if whole:
                mine = fmt.unpack_codes(tensor.reshape(rows, -1), part.total)[:, part.start : part.stop]
            else:
                lo, hi = _byte_elements(part)[part.index]
                codes = fmt.unpack_codes(tensor.reshape(rows, -1), hi - lo)
                mine = exchange(codes, _byte_elements(part), part.parts(), part)
            codes = fmt.unpack_codes(target, geo.numel(part))
            codes[:, geo.offset : geo.offset + part.length] = mine
            target.copy_(fmt.pack_codes(codes, spec.signed))
        elif key in scales and not scales[key].across:
            tensor, whole = _whole_or_local(value, param, part, _vector_placements(param, part, rows))
            first, runs = geo.span.first, target.shape[1]
            if whole:
                mine = tensor.reshape(rows, -1)[:, first : first + runs]
            else:
                mine = exchange(tensor.reshape(rows, -1), _chunks(-(-part.total // geo.run), part.shards),
                                [(span.first, span.first + span.runs) for span in _spans(part, geo.run)], part)
            target.copy_(mine)
        else:
            fresh[key] = value.full_tensor() if sharding.is_dtensor(value) else value
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in fresh.items()}


def _spans(part: Part, run: int):
    """Every shard's span of ``run``-element runs (what each holds of a per-run scale)."""
    return [Part(lo, hi, part.total, i, part.bounds, part.shape, part.mesh_dim, part.group).span(run)
            for i, (lo, hi) in enumerate(part.parts())]


def meta_of(param) -> torch.Tensor:
    """A tensor with ``param``'s whole shape and no data: what loaded whole-tensor state is checked against."""
    return torch.empty(tuple(param.shape), dtype=param.dtype, device="meta")


def per_shard_rows(fmt: StateFormat, spec: StateSpec, loaded: dict, param) -> int | None:
    """The number of shards a checkpoint in the per-shard layout of earlier hf_optim saved slot ``spec`` for, else
    None. That layout's absmax has one padded row per shard in front of the whole tensor's dimensions, and its main
    tensor is the parameter's shape (8-bit, fp8) or, packed, has such rows too, each shorter than the whole tensor's
    (which tells it from a stacked AdEMAMix slot of another algorithm, refused by the format's checks)."""
    shape = tuple(param.shape)
    scales = fmt.scales(spec, shape)
    if not scales or scales[0].across:
        return None
    absmax, main = loaded.get(scales[0].key), loaded.get(spec.key)
    if not isinstance(absmax, torch.Tensor) or not isinstance(main, torch.Tensor):
        return None
    lead = () if spec.rows == 1 else (spec.rows,)
    if absmax.dim() != len(lead) + 2:
        return None
    if fmt.packed:
        whole = fmt.main_length(math.prod(shape))
        per_shard = main.dim() == len(lead) + 2 and main.shape[0] == absmax.shape[0] and main.shape[-1] < whole
    else:
        per_shard = tuple(main.shape) == (*lead, *shape)
    return int(absmax.shape[0]) if per_shard else None


def refuse_per_shard_state(opt, loaded: dict, param, index, shards: int) -> None:
    """Refuse, in one line, a parameter's state saved in the per-shard layout for another number of shards."""
    for spec in _slots(opt._rules, loaded):
        fmt = loaded_format(loaded, spec)
        saved = per_shard_rows(fmt, spec, loaded, param) if fmt is not None else None
        if saved is not None and saved != shards:
            refuse_per_shard(saved, shards, f"state of parameter {index} (shape {tuple(param.shape)})")


def refuse_per_shard(saved: int, shards: int, where: str) -> None:
    here = "one process" if shards == 1 else f"{shards} shards"
    raise StateDictError(
        f"{where}: this checkpoint keeps 8-bit/4-bit state per shard of {saved} ranks (hf_optim's layout before "
        f"whole-tensor blocks), which cannot load into {here}; resume it on {saved} ranks and save it again: the new "
        "checkpoint loads at any number of ranks"
    )


# --------------------------------------------------------------------------------------------------------------
# A parameter's whole state


def export_state(rules, param_state: dict, param) -> dict:
    """``param``'s state (flat: quantization tensors not nested) as checkpoint entries: per slot as
    :func:`export_slot` says, the rest (step counters, Adafactor's statistics) as ``rules.state_dims`` lays it out.
    A sharded parameter without a :class:`Part` keeps :mod:`~hf_optim.optim.sharding`'s per-shard layout."""
    part = part_of(param)
    dims_of = functools.partial(rules.state_dims, state=param_state)
    if not isinstance(part, Part):
        return sharding.export_state(param_state, param, dims_of)
    out, done = {}, set()
    for spec in _slots(rules, param_state):
        fmt = loaded_format(param_state, spec)
        if fmt is not None:
            out.update(export_slot(fmt, spec, param_state, param, part))
            done.update(fmt.keys(spec))
    for key, value in param_state.items():
        if key in done:
            continue
        dims = dims_of(key, param.dim()) if isinstance(value, torch.Tensor) else None
        out[key] = value if dims is None else sharding.distribute_state(value, param, dims)
    return out


def _slots(rules, state: dict) -> list[StateSpec]:
    return [spec for spec in rules.slots_of_state(state) if spec.key in state]


def import_state(opt, loaded: dict, param, index, check_loaded) -> dict:
    """The live state of ``param`` (a sharded parameter with a :class:`Part`) from checkpoint entries ``loaded``
    (flat), checked against the whole tensor first (``check_loaded(opt, param, state, index)``: the optimizer's
    checks). Collective over the shard group (see the module)."""
    part = part_of(param)
    local = sharding.local_tensor(param)
    where = f"state of parameter {index} (shape {tuple(param.shape)})"
    specs = _slots(opt._rules, loaded)
    out: dict = {}
    legacy = {}
    for spec in specs:
        fmt = loaded_format(loaded, spec)
        saved = per_shard_rows(fmt, spec, loaded, param) if fmt is not None else None
        if saved is not None:
            if saved != part.shards:
                refuse_per_shard(saved, part.shards, where)
            if any(scale.across for scale in fmt.scales(spec, tuple(param.shape))):
                raise StateDictError(f"{where}: {spec.key} was saved per shard in the {fmt.name} format, whose "
                                     "per-shard checkpoints hf_optim cannot convert; start its state afresh")
            legacy[spec.key] = fmt
    whole = {key: value for key, value in loaded.items()}
    if not legacy:
        check_loaded(opt, meta_of(param), whole, index)
    done = set()
    for spec in specs:
        fmt = loaded_format(whole, spec)
        if spec.key in legacy:
            out.update(_import_per_shard(fmt, spec, whole, param, part, local.device, where))
        else:
            out.update(import_slot(fmt, spec, whole, param, part, local.device))
        done.update(fmt.keys(spec))
    dims_of = functools.partial(opt._rules.state_dims, state=loaded)
    for key, value in whole.items():
        if key in done:
            continue
        if sharding.is_dtensor(value):
            out[key] = value.to_local()
        elif isinstance(value, torch.Tensor) and value.dim() and (dims := dims_of(key, param.dim())) is not None:
            out[key] = _local_slice(value, param, dims)
        else:
            out[key] = value
    return out


def _local_slice(whole: torch.Tensor, param, dims) -> torch.Tensor:
    """This rank's piece of a whole state tensor laid out like ``param`` (``dims``: as ``distribute_state``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = sharding.element_placements(param, dims)
    shape, offset = compute_local_shape_and_global_offset(whole.shape, param.device_mesh, placements)
    return whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _import_per_shard(fmt: StateFormat, spec: StateSpec, loaded: dict, param, part: Part, device, where: str) -> dict:
    """A slot saved in the per-shard layout at this number of shards: this shard's row; where shard boundaries split
    blocks, decoded with the blocks of the shard it was saved for and stored again with the whole tensor's
    (collective over the shard group)."""
    local = sharding.local_tensor(param)
    per_shard = {scale.key for scale in fmt.scales(spec, tuple(param.shape))} | ({spec.key} if fmt.packed else set())
    own = {}
    for key in fmt.keys(spec):
        value = loaded[key]
        if key in per_shard:  # one zero-padded row per shard: this shard's, trimmed to its own length
            row = value.to_local()[0] if sharding.is_dtensor(value) else value[part.index]
            length = fmt.main_length(local.numel()) if key == spec.key else fmt.num_blocks(local.numel())
            value = row[..., :length]
        elif key == spec.key:
            dims = (None,) * (spec.rows > 1) + tuple(range(param.dim()))
            value = value.to_local() if sharding.is_dtensor(value) else _local_slice(value, param, dims)
        own[key] = value.to(device) if isinstance(value, torch.Tensor) else value
    fmt.check_loaded(local, own, spec, where)
    geo = sharded_blocks.geometry(part, fmt, spec)
    if geo is None or not (geo.spanned or geo.across):  # every shard's blocks are the whole tensor's: as saved
        return own
    values = fmt.dequantize(fmt.raw(own, spec), spec.signed, local.numel())
    fresh: dict = {}
    fmt.init_slot(fresh, spec, sharded_blocks.stand_in(part, fmt, spec, local), zeroed_buffer)
    pending = sharded_blocks.PendingScales()
    sharded_blocks.write_part(part, fresh, spec, values.reshape(spec.rows, -1), pending)
    pending.flush()
    return fresh
