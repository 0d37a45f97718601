"""Where a rank's part of a sharded (FSDP2 / DTensor) parameter lies in the whole tensor, and which runs of a state
format's scales the shard boundaries split.

FSDP2 shards a parameter along dimension 0 over one mesh dimension (torch.chunk: ``ceil(rows / W)`` rows per rank, the
last ranks fewer or none), so each rank holds one contiguous range ``[start, stop)`` of the flattened tensor: a
:class:`Part`. A quantized slot cuts the flattened tensor into runs of its format's scales (256-element blocks for
8-bit and fp8, 128 for 4-bit, matrix rows for a rank-1 row scale: :class:`hf_optim.formats.base.Scales`); a run that
two (or more) parts share is *split*, and its scale is the maximum over every part's elements. What a rank stores of
a quantized slot is its *span*: the whole runs its part touches (:meth:`Part.span`), so that its blocks are the whole
tensor's; the elements of a split run that other ranks hold are padding it never reads.

Parameters whose local tensor is not one contiguous range (sharded over two mesh dimensions, or along a dimension
after one of size > 1, as tensor parallelism does) have no :class:`Part`: :func:`part_of` says why, and their
quantized state keeps the blocks of each rank's local tensor (``hf_optim.optim.sharding``'s per-shard layout).
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field

from hf_optim.optim import sharding

logger = logging.getLogger("hf_optim")


@dataclass(frozen=True)
class Span:
    """The whole runs of ``run`` elements a part touches: runs ``[first, first + runs)`` of the tensor; the part's
    elements are elements ``[offset, offset + length)`` of the span."""

    run: int
    first: int
    runs: int
    offset: int

    @property
    def numel(self) -> int:
        return self.runs * self.run


@dataclass(frozen=True, eq=False)
class Part:
    """Elements ``[start, stop)`` of the flattened whole tensor (``total`` elements), on shard ``index`` of a
    shard group whose parts begin at ``bounds[i]`` (``bounds[-1] == total``)."""

    start: int
    stop: int
    total: int
    index: int
    bounds: tuple[int, ...]
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    mesh_dim: int
    group: object = field(repr=False)
    """The shard group (``torch.distributed.ProcessGroup``) of mesh dimension ``mesh_dim``."""
    _split: dict = field(default_factory=dict, repr=False)

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    def span(self, run: int) -> Span:
        """The whole runs of ``run`` elements this part touches (none for an empty part)."""
        if not self.length:
            return Span(run, self.start // run, 0, 0)
        first = self.start // run
        return Span(run, first, -(-self.stop // run) - first, self.start - first * run)

    def split_runs(self, run: int) -> tuple[int, ...]:
        """The runs of ``run`` elements that two or more parts share, in order: the whole tensor's, the same on every
        rank of the group."""
        found = self._split.get(run)
        if found is None:
            found = self._split[run] = tuple(sorted({bound // run for bound in self.bounds[1:-1]
                                                     if bound % run and 0 < bound < self.total}))
        return found

    def parts(self) -> list[tuple[int, int]]:
        """Every shard's ``[start, stop)``, in shard order."""
        return list(zip(self.bounds[:-1], self.bounds[1:]))


class Unsupported(str):
    """Why a sharded parameter has no :class:`Part` (a reason, for messages)."""


def _compute_part(param) -> Part | Unsupported | None:
    dims = sharding._shard_dims(param)
    if not dims:
        return None
    if len(dims) > 1:
        return Unsupported(f"it is sharded over {len(dims)} mesh dimensions ({param.placements})")
    mesh_dim, dim = dims[0]
    placement = param.placements[mesh_dim]
    if type(placement).__name__ != "Shard":  # _StridedShard and other subclasses interleave their chunks
        return Unsupported(f"its placement {placement!r} is not a plain Shard")
    shape = tuple(param.shape)
    if math.prod(shape[:dim]) != 1:
        return Unsupported(f"it is sharded along dimension {dim} of shape {shape}: a rank's part is not one "
                           "contiguous range of the flattened tensor")
    mesh = param.device_mesh
    shards, rows, inner = mesh.size(mesh_dim), shape[dim], math.prod(shape[dim + 1:])
    chunk = -(-rows // shards)
    bounds = tuple(min(i * chunk, rows) * inner for i in range(shards)) + (math.prod(shape),)
    index = mesh.get_local_rank(mesh_dim)
    local = sharding.local_tensor(param)
    if local.numel() != bounds[index + 1] - bounds[index]:
        return Unsupported(f"its local tensor {tuple(local.shape)} is not torch.chunk's part {index} of {shape}")
    return Part(bounds[index], bounds[index + 1], bounds[-1], index, bounds, shape, mesh_dim,
                mesh.get_group(mesh_dim))


_parts: dict[int, tuple[weakref.ref, Part | Unsupported | None]] = {}


def part_of(param) -> Part | Unsupported | None:
    """``param``'s :class:`Part`; None for a tensor that is not sharded (a plain tensor, or a DTensor only
    replicated); :class:`Unsupported` (a reason) for a sharded one whose local tensor is not one contiguous range.
    Remembered per parameter (the parameters of an FSDP2 model keep their placements), weakly."""
    if not sharding.is_dtensor(param):
        return None
    found = _parts.get(id(param))
    if found is not None and found[0]() is param:
        return found[1]
    part = _compute_part(param)
    key = id(param)
    _parts[key] = (weakref.ref(param, lambda _, key=key: _parts.pop(key, None)), part)
    return part


_noted: set[str] = set()


def note_per_shard(param, reason: Unsupported) -> None:
    """Say once per kind of layout that a sharded parameter without a :class:`Part` keeps quantized state in the
    blocks of its local tensor (its results depend on the layout; its checkpoints load only into the same one)."""
    if reason in _noted:
        return
    _noted.add(reason)
    logger.warning("quantized optimizer state of a parameter of shape %s keeps the blocks of each rank's local "
                   "tensor, because %s: its results depend on the sharding, and its checkpoints load only into the "
                   "same sharding (FSDP2's default, dimension 0 over one mesh dimension, has neither limit)",
                   tuple(param.shape), reason)
