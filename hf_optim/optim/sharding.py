"""Sharded parameters (FSDP2 / DTensor): reductions across the shard group and distributed views of the state.

Elementwise algorithms compute on each rank's local shard and need nothing from here. LAMB's trust-ratio norms
and Adafactor's column statistics and RMS values reduce over dimensions a ``Shard(d)`` placement splits across
ranks: each rank sums its local part and :func:`sum_across_shards` all-reduces the sums over the mesh dimensions
that shard those dimensions; means divide by the global size (the DTensor's shape, never the local one, so
uneven shards and empty shards are counted right). For a plain tensor, or a DTensor that is only replicated,
every function here is a no-op.

State lives on local shards as plain tensors. For torch.distributed.checkpoint, :func:`distribute_state` wraps a
state tensor as a DTensor laid out like its parameter (``state_dims`` says which parameter dimension each state
dimension follows). Quantized state normally takes the whole tensor's blocks and checkpoint layout
(:mod:`hf_optim.optim.sharded_blocks`, :mod:`hf_optim.optim.sharded_state`). The per-shard layout below is for the
parameters that cannot (a local tensor that is not one contiguous range, :mod:`hf_optim.optim.shard_layout`), and
the layout earlier checkpoints have: ``absmax`` vectors and packed 4-bit codes, which count the blocks of the LOCAL
shard, padded to the largest shard's count and stacked one row per shard (:func:`distribute_absmax`), so such a
checkpoint saves every rank's blocks and resumes on the same world size and mesh only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hf_optim.formats.quant8 import num_blocks


def _dtensor_types():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def is_dtensor(tensor) -> bool:
    if not hasattr(tensor, "placements"):  # cheap test first: no import of torch.distributed for plain tensors
        return False
    DTensor, _, _ = _dtensor_types()
    return isinstance(tensor, DTensor)


def _shard_dims(param) -> list[tuple[int, int]]:
    """``(mesh_dim, tensor_dim)`` for every placement of ``param`` that shards a tensor dimension."""
    if not is_dtensor(param):
        return []
    _, Replicate, Shard = _dtensor_types()
    found = []
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            found.append((mesh_dim, placement.dim % param.dim()))
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(
                f"hf_optim supports Shard and Replicate placements of parameters, got {placement!r}"
            )
    return found


def is_sharded(param) -> bool:
    """Whether ``param`` is a DTensor split across ranks (its local tensor is only a part of it)."""
    return bool(_shard_dims(param))


def sum_across_shards(partial: torch.Tensor, param, dims: Sequence[int] | None = None) -> torch.Tensor:
    """All-reduce (sum) ``partial`` over the shard groups that split ``param`` along any of ``dims``.

    ``partial`` is a local sum over ``dims`` of the parameter (all dimensions when None). Returns the global sum
    (in place on ``partial`` when it is reduced); a plain tensor comes back unchanged.
    """
    import torch.distributed as dist

    wanted = range(param.dim()) if dims is None else {d % param.dim() for d in dims}
    for mesh_dim, tensor_dim in _shard_dims(param):
        if tensor_dim in wanted:
            dist.all_reduce(partial, group=param.device_mesh.get_group(mesh_dim))
    return partial


def square_sums(tensors: Sequence[torch.Tensor], param) -> torch.Tensor:
    """Global sums of squares of tensors laid out like ``param``, in one all-reduce."""
    partial = torch.stack([t.float().square().sum() for t in tensors])
    return sum_across_shards(partial, param)


def rms(tensor: torch.Tensor, param) -> torch.Tensor:
    """Root mean square of the whole (global) tensor of which ``tensor`` is ``param``'s local shard."""
    total = square_sums([tensor], param)[0]
    return total.sqrt() / math.sqrt(param.numel())


def mean(tensor: torch.Tensor, dim: int, param, param_dim: int, keepdim: bool = False) -> torch.Tensor:
    """Mean over ``dim`` of ``tensor`` whose dimension ``dim`` follows parameter dimension ``param_dim``."""
    total = sum_across_shards(tensor.sum(dim=dim, keepdim=keepdim), param, [param_dim])
    return total / param.shape[param_dim]


# --------------------------------------------------------------------------------------------------------------
# Whole matrices of sharded parameters (Muon's Newton-Schulz)


def gathered(local: torch.Tensor, param) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's part, laid out like the sharded parameter ``param`` (an
    all-gather over ``param``'s mesh: every rank of the shard group must call it, in the same order)."""
    DTensor, _, _ = _dtensor_types()
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride()).full_tensor()


def local_part(whole: torch.Tensor, param) -> torch.Tensor:
    """This rank's part of ``whole`` (the same on every rank) under ``param``'s placements: a slice, no
    communication."""
    DTensor, Replicate, _ = _dtensor_types()
    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


# --------------------------------------------------------------------------------------------------------------
# Distributed views of the state, for torch.distributed.checkpoint


def element_placements(param, dims: Sequence[int | None]) -> tuple:
    """The placements of a state whose dimension ``i`` follows parameter dimension ``dims[i]``: sharded where the
    parameter is sharded along a dimension the state follows, replicated elsewhere."""
    _, Replicate, Shard = _dtensor_types()
    dims = list(dims)
    placements = []
    for placement in param.placements:
        if isinstance(placement, Shard) and placement.dim % param.dim() in dims:
            placements.append(Shard(dims.index(placement.dim % param.dim())))
        else:
            placements.append(Replicate())
    return tuple(placements)


def distribute_state(local: torch.Tensor, param, dims: Sequence[int | None]):
    """Wrap a local state tensor as a DTensor laid out like ``param``.

    ``dims[i]`` is the parameter dimension state dimension ``i`` follows (None: a dimension of its own, e.g.
    AdEMAMix's stacked EMAs). A parameter dimension the state has reduced over is replicated: the algorithm
    keeps that state identical on every rank of the shard group.
    """
    DTensor, _, _ = _dtensor_types()
    placements = element_placements(param, dims)
    shape = [param.shape[d] if d is not None else local.shape[i] for i, d in enumerate(dims)]
    return DTensor.from_local(local, param.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def largest_local_numel(param) -> int:
    """Elements of the largest local shard of ``param`` (torch.chunk splitting: the first shard is largest)."""
    sizes = list(param.shape)
    for mesh_dim, tensor_dim in _shard_dims(param):
        sizes[tensor_dim] = -(-sizes[tensor_dim] // param.device_mesh.size(mesh_dim))
    return math.prod(sizes)


@dataclass(frozen=True)
class PerShard:
    """What a state layout (``Rules.state_dims``) returns for state counted on the LOCAL shard (blockwise absmax
    vectors, packed 4-bit codes): ``length(local numel)`` entries per row, saved as one zero-padded row per shard."""

    length: Callable[[int], int]


ABSMAX = PerShard(num_blocks)
"""A 256-element-block absmax vector (8-bit state)."""


def distribute_absmax(local: torch.Tensor, param, length: Callable[[int], int] = num_blocks):
    """Wrap the local shard's per-shard vector (8-bit ``absmax`` by default: ``length`` counts its entries for a
    shard's element count) as a DTensor with one zero-padded row per shard.

    ``local`` has shape ``(blocks,)`` or ``(rows, blocks)`` with ``blocks`` counted on the local shard. The
    global tensor has a leading dimension per sharding mesh dimension (sharded over it) and the block count of
    the largest shard, so every rank's blocks land in their own row.
    """
    DTensor, Replicate, Shard = _dtensor_types()
    mesh = param.device_mesh
    shard_dims = _shard_dims(param)
    width = length(largest_local_numel(param))
    padded = torch.zeros((*local.shape[:-1], width), dtype=local.dtype, device=local.device)
    padded[..., : local.shape[-1]] = local
    lead = len(shard_dims)
    padded = padded.view((1,) * lead + tuple(padded.shape))
    placements = [Replicate()] * mesh.ndim
    for index, (mesh_dim, _) in enumerate(shard_dims):
        placements[mesh_dim] = Shard(index)
    shape = [mesh.size(mesh_dim) for mesh_dim, _ in shard_dims] + list(padded.shape[lead:])
    return DTensor.from_local(padded, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def local_absmax(saved: torch.Tensor, param, local_param: torch.Tensor,
                 length: Callable[[int], int] = num_blocks) -> torch.Tensor:
    """Undo :func:`distribute_absmax` on a loaded tensor: this shard's row, trimmed to its own length."""
    if not is_dtensor(saved):
        return saved
    local = saved.to_local()
    local = local.reshape(local.shape[len(_shard_dims(param)) :])
    return local[..., : length(local_param.numel())]


def export_state(param_state: dict, param, state_dims) -> dict:
    """A parameter's state dict entry with every tensor wrapped as a DTensor laid out like ``param``.

    ``state_dims(key, ndim)`` gives the parameter dimension each state dimension follows, a :class:`PerShard`, or
    None for state identical on every rank (scalars, quantization maps, fully reduced statistics), which stays
    a plain tensor. Nested dicts (bitsandbytes' quantization state) are converted too.
    """
    out = {}
    for key, value in param_state.items():
        if isinstance(value, dict):
            out[key] = export_state(value, param, state_dims)
            continue
        dims = state_dims(key, param.dim()) if isinstance(value, torch.Tensor) else None
        if dims is None:
            out[key] = value
        elif isinstance(dims, PerShard):
            out[key] = distribute_absmax(value, param, dims.length)
        else:
            out[key] = distribute_state(value, param, dims)
    return out


def import_state(param_state: dict, param, local_param: torch.Tensor, state_dims) -> dict:
    """Inverse of :func:`export_state`: local tensors (absmax rows trimmed to this shard's block count)."""
    out = {}
    for key, value in param_state.items():
        if isinstance(value, dict):
            out[key] = import_state(value, param, local_param, state_dims)
        elif is_dtensor(value):
            dims = state_dims(key, param.dim())
            out[key] = (local_absmax(value, param, local_param, dims.length) if isinstance(dims, PerShard)
                        else value.to_local())
        else:
            out[key] = value
    return out


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to compute on: a DTensor's local shard, or the tensor itself."""
    if type(tensor) in _PLAIN_TENSORS:  # the common case, without the failed attribute lookup below
        return tensor
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor
