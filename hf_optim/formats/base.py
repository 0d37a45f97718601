"""The :class:`StateFormat` interface, the registry of formats, and :class:`SlotLayout` (a slot's format and
map signedness: the static description of a slot that kernels are specialized on)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch


class StateDictError(ValueError):
    """A state dict that cannot be loaded into this optimizer (another algorithm, layout or block size)."""


@dataclass(frozen=True)
class Scales:
    """One scale tensor of a quantized slot, and which elements share each of its scales.

    A slot row's elements are cut into runs of :attr:`run` consecutive elements (the last run may be shorter: it
    is quantized as if zero-padded). With :attr:`across` False, scale ``j`` covers run ``j`` (a block's absmax, a
    rank-1 row scale); with :attr:`across` True, scale ``j`` covers element ``j`` of every run (a rank-1 column
    scale). Every scale is the maximum of what its elements give (:meth:`StateFormat.scales_of`), so the scales of
    a whole tensor are the element-wise maxima of the scales of its parts, each zero-padded to whole runs: what
    lets a rank that holds part of a tensor (FSDP2) quantize with the whole tensor's scales
    (``hf_optim.optim.sharded_blocks``)."""

    key: str
    """The slot's state key holding the scales (``absmax1``)."""
    run: int
    """Elements per run."""
    across: bool = False
    """Whether a scale covers one element of every run (a column) instead of one run."""


class StateFormat:
    """How one state slot is stored. Subclasses are stateless singletons, registered with :func:`register_format`.

    Shapes: a slot holds ``rows`` stacked tensors of ``n`` elements (``rows`` is 2 for AdEMAMix's first slot).
    Kernels get a slot as :meth:`raw` tensors, in one of two forms: flat ``(rows, n)`` (per-tensor path) or block
    form ``(rows, blocks, 256)`` (the multi-tensor path's chunks, always whole 256-element blocks).
    """

    name: ClassVar[str]
    """The registry key users pass as ``state_format=`` (``"blockwise8"``), recorded in param groups."""
    bits: ClassVar[int]
    """Bits per stored element (information only: two formats may have the same count, e.g. 8-bit blockwise and
    a float8 format)."""
    code: ClassVar[int]
    """Runtime code of the format in the Triton kernels' tables."""
    class_suffix: ClassVar[str]
    """Suffix of the fixed-format classes (``"8bit"``: ``AdamW8bit``, ``PagedAdamW8bit``)."""
    optim_suffix: ClassVar[str]
    """Suffix of the ``optim=`` names (``"8bit"``: ``adamw_8bit``, ``paged_adamw_8bit``)."""
    label: ClassVar[str]
    """How tables name the state (``"8-bit blockwise"``)."""
    rank: ClassVar[float]
    """Table order and the planner's preference: exact state first (fp32: 0), then smaller ones (unique: two formats
    of one rank would have no order)."""
    optim_bits: ClassVar[int | None] = None
    """bitsandbytes' ``optim_bits`` value that selects this format (an alias of ``state_format``), or None for a
    format bitsandbytes has no value for."""
    block_size: ClassVar[int] = 0
    """Elements per quantization block (0: not quantized)."""
    width: ClassVar[int]
    """How many raw tensors a slot passes to the kernels."""
    packed: ClassVar[bool] = False
    """Whether the main tensor is not shaped like the parameter (several codes per byte)."""
    crosses_threads: ClassVar[bool] = False
    """Whether its Triton encoder moves values between the threads of a tile (a code byte or a scale made of elements
    other threads hold), which Triton does through shared memory: the static check expects it there."""
    whole_tensor: ClassVar[bool] = False
    """Whether a slot's scales span the whole tensor, so that it cannot be quantized in independent chunks: such a
    format has no flat-buffer (multi-tensor) form, and its tensors step one by one on the PyTorch path."""
    triton_rows: ClassVar[str | None] = None
    """The format's Triton branch, as a ``"module:attribute"`` reference to a
    ``hf_optim.kernels.triton_path.rows.TritonRows`` (its row I/O and tuning; a relative module is looked up in the
    package of the module defining the format's class), resolved when a Triton step first needs it, so that formats
    never import triton; None: no Triton branch. Tensors whose state is in a format without one step on the PyTorch
    path, also on a GPU; ``triton_path.configs`` lists no kernel for it."""
    ahead_of: ClassVar[str | None] = None
    """The name of a registered format whose :meth:`recognises` also accepts some slot of this format (a format that
    adds scales to another's slot): this one is registered ahead of it, so that :func:`loaded_format` asks it first."""

    def suits(self, slots: Sequence) -> bool:
        """Whether the format is worth offering to an algorithm with state slots ``slots`` (``StateSpec``s): a
        format that stores some kinds of slot as another format does offers nothing new to an algorithm whose slots
        are all of those kinds."""
        return True

    def stored_as(self, spec) -> StateFormat:
        """The format slot ``spec`` is actually stored in (what :func:`loaded_format` finds): the format itself, or
        the format it shares that kind of slot with."""
        return self

    @property
    def triton(self) -> bool:
        """Whether the fused Triton kernels have a branch for the format (:attr:`triton_rows`)."""
        return self.triton_rows is not None

    @property
    def quantized(self) -> bool:
        """Whether tensors under ``min_8bit_size`` keep fp32 state instead (every format but fp32)."""
        return self.block_size > 0

    @property
    def group_bits(self) -> int:
        """The ``optim_bits`` recorded beside ``state_format`` in a param group (bitsandbytes reads it)."""
        return self.bits if self.optim_bits is None else self.optim_bits

    def num_blocks(self, numel: int) -> int:
        """Quantization blocks (absmax entries) per row of ``numel`` elements."""
        return -(-numel // self.block_size)

    def main_length(self, numel: int) -> int:
        """Entries per row of the main tensor for ``numel`` elements (a packed format's bytes)."""
        return numel

    # -- scales: what a part of a tensor (an FSDP2 shard) needs to quantize as the whole tensor does --------------
    def scales(self, spec, shape: tuple[int, ...]) -> tuple[Scales, ...]:
        """The scale tensors of slot ``spec`` for a parameter of ``shape`` (the whole tensor's), in the order
        :meth:`scales_of` returns them; every one has the same :attr:`Scales.run`. None for unscaled state."""
        return ()

    def span_shape(self, spec, shape: tuple[int, ...], runs: int) -> tuple[int, ...]:
        """The shape to allocate (:meth:`init_slot`) a slot for ``runs`` whole runs of a ``shape`` parameter's
        scales: ``runs * run`` elements by default; a format whose geometry follows the parameter's shape (rank-1's
        columns) keeps it."""
        return (runs * self.scales(spec, shape)[0].run,)

    def scales_of(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool) -> list[torch.Tensor]:
        """The scales :meth:`store` would compute for fp32 ``values`` (flat ``(rows, n)``, ``n`` whole runs), one
        tensor per :meth:`scales` entry, each ``(rows, count)``; ``raw``: the slot's raw tensors for those
        elements (shapes that tell the geometry)."""
        raise NotImplementedError(f"state format {self.name!r} has no scales")

    def unpack_codes(self, main: torch.Tensor, n: int) -> torch.Tensor:
        """A packed format's per-element codes (uint8 ``(rows, n)``) of main tensor bytes ``(rows, ...)``."""
        raise NotImplementedError(f"state format {self.name!r} is not packed")

    def pack_codes(self, codes: torch.Tensor, signed: bool) -> torch.Tensor:
        """Inverse of :meth:`unpack_codes`: uint8 bytes ``(rows, ceil(n / 2))`` of codes ``(rows, n)``, a last
        odd element padded with the code a zero value gets."""
        raise NotImplementedError(f"state format {self.name!r} is not packed")

    # -- allocation -------------------------------------------------------------------------------------------
    def init_slot(self, state: dict, spec, param: torch.Tensor, allocate: Callable) -> None:
        """Create the zeroed slot ``spec`` for ``param`` (a local tensor) in ``state``. ``allocate(shape, *, dtype,
        device, elements)`` makes a zeroed buffer serving ``elements`` parameter elements: the optimizer's
        :class:`hf_optim.paging.StateAllocator` (which pages by ``elements``), or :func:`zeroed_buffer`."""
        raise NotImplementedError

    def raw(self, state: dict, spec) -> list[torch.Tensor]:
        """The slot's raw tensors in flat ``(rows, n)`` form, in the order the kernels take them."""
        raise NotImplementedError

    def slice_raw(self, raw: Sequence[torch.Tensor], start: int, stop: int, block_form: bool) -> list[torch.Tensor]:
        """Elements ``[start, stop)`` of flat raw tensors (``start`` block-aligned), in block form when asked
        (then ``stop - start`` is whole 256-element blocks)."""
        raise NotImplementedError

    # -- flat buffers of the multi-tensor path (hf_optim.kernels.torch_path.flat_state) ----------------------
    def flat_buffers(self, rows: int, total: int, signed: bool, device: torch.device,
                     allocate: Callable) -> list[torch.Tensor]:
        """Buffers for ``total`` elements per row (a multiple of 256), filled so that every element decodes to
        exactly 0 whatever its block's absmax: the padding between members must stay zero."""
        raise NotImplementedError

    def kernel_chunk(self, buffers: Sequence[torch.Tensor], start: int, stop: int, signed: bool,
                     device: torch.device) -> list[torch.Tensor]:
        """The raw tensors of flat elements ``[start, stop)`` (whole blocks) of the buffers, in block form."""
        raise NotImplementedError

    def flat_views(self, buffers: Sequence[torch.Tensor], offset: int, numel: int) -> list[torch.Tensor]:
        """The ``(rows, ...)`` views of one member's elements ``[offset, offset + numel)`` in the state's own
        layout: the main tensor (flat, reshaped by the caller) and the other per-element/per-block tensors."""
        raise NotImplementedError

    def bind(self, state: dict, spec, views: Sequence[torch.Tensor], shape: tuple[int, ...]) -> None:
        """Point ``state``'s slot at ``views`` (from :meth:`flat_views`); ``shape`` is the slot's shape."""
        raise NotImplementedError

    def load_views(self, views: Sequence[torch.Tensor], state: dict, spec) -> None:
        """Copy a parameter's slot tensors (this format) into its views of the flat buffers."""
        for view, key in zip(views, self.keys(spec)):
            view.copy_(state[key].reshape(view.shape))

    def main_offset_bytes(self, offset: int) -> int:
        """Byte offset, in the main buffer, of flat element ``offset`` (to recognise a member's views)."""
        raise NotImplementedError

    def main_dtype(self) -> torch.dtype:
        raise NotImplementedError

    # -- math -------------------------------------------------------------------------------------------------
    def dequantize(self, raw: Sequence[torch.Tensor], signed: bool, n: int | None = None) -> torch.Tensor:
        """fp32 values of a slot from its raw tensors (either form; the result has the same form). ``n``: the
        elements per row of the flat form (packed formats cannot tell an odd count from their bytes)."""
        raise NotImplementedError

    def store(self, values: torch.Tensor, raw: Sequence[torch.Tensor], signed: bool,
              scales: Sequence[torch.Tensor] | None = None) -> None:
        """Write fp32 ``values`` (same form as ``raw``) into the raw tensors, re-quantizing. ``scales`` (flat form
        only): the scales to quantize against instead of those of ``values`` (:meth:`scales_of`), each at least
        as large as its elements' (the whole tensor's, for a part of it); they are stored as the slot's scales."""
        raise NotImplementedError

    # -- size and checkpoints ---------------------------------------------------------------------------------
    def state_bytes(self, numel: int, rows: int = 1) -> int:
        """Bytes of one slot of ``rows`` x ``numel`` elements (what ``state_memory`` measures)."""
        raise NotImplementedError

    def slot_bytes(self, spec, shape: tuple[int, ...]) -> int:
        """Bytes of slot ``spec`` for a parameter of ``shape``: :meth:`state_bytes`, for formats whose size
        depends only on the element count; a format whose size depends on the slot's signedness or the parameter's
        shape overrides this."""
        return self.state_bytes(math.prod(shape), spec.rows)

    def keys(self, spec) -> tuple[str, ...]:
        """The slot's keys in a parameter's state."""
        raise NotImplementedError

    def recognises(self, state: dict, spec) -> bool:
        """Whether a loaded parameter state holds slot ``spec`` in this format."""
        raise NotImplementedError

    def check_loaded(self, param: torch.Tensor, state: dict, spec, where: str) -> None:
        """Raise :class:`StateDictError` if a loaded slot of this format does not fit ``param``."""
        raise NotImplementedError

    @staticmethod
    def check_slot_shape(param: torch.Tensor, values: torch.Tensor, spec, where: str, shape: tuple) -> None:
        """Refuse a slot tensor whose shape is not ``shape``, saying when it looks like AdEMAMix's stacked state."""
        if tuple(values.shape) == tuple(shape):
            return
        hint = ""
        if spec.rows == 1 and values.dim() == param.dim() + 1 and tuple(values.shape[1:]) == tuple(param.shape):
            hint = " (a stacked AdEMAMix state: the state dict was saved by AdEMAMix)"
        raise StateDictError(f"{where}: {spec.key} has shape {tuple(values.shape)}, expected {tuple(shape)}{hint}")

    @staticmethod
    def check_shapes(state: dict, spec, expected: dict[str, tuple], where: str, what: str) -> None:
        """Refuse a loaded slot missing one of the ``expected`` tensors (key: shape) or holding one of another shape;
        ``what`` names the format in the message."""
        for key, shape in expected.items():
            found = state.get(key)
            if found is None:
                raise StateDictError(f"{where}: {what} {spec.key} has no {key}")
            if tuple(found.shape) != shape:
                raise StateDictError(f"{where}: {what} {key} has shape {tuple(found.shape)}, expected {shape}")

    @staticmethod
    def coded_raw(state: dict, spec, encoder: Callable[[bool, torch.device], torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`raw` of a slot of codes with a map: the codes as the int8 view the kernels take, the absmax, the
        map, and ``encoder(signed, device)``'s table, one row per stacked row."""
        codes = state[spec.key].view(spec.rows, -1)
        absmax = state[spec.absmax_key].view(spec.rows, -1)
        return [codes.view(torch.int8), absmax, state[spec.qmap_key], encoder(spec.signed, codes.device)]

    @staticmethod
    def zero_absmax(spec, blocks: int, device: torch.device) -> torch.Tensor:
        """A slot's fp32 absmax, one per block (per row and block for a stacked slot), zeroed."""
        shape = (blocks,) if spec.rows == 1 else (spec.rows, blocks)
        return torch.zeros(shape, dtype=torch.float32, device=device)

    def __repr__(self) -> str:
        return f"<state format {self.name}>"

    def __reduce__(self):  # a format pickles as its name: optimizers and their plans stay picklable
        return format_named, (self.name,)


def zeroed_buffer(shape, *, dtype: torch.dtype, device: torch.device | str, elements: int) -> torch.Tensor:
    """The plain allocator of a format's buffers (``torch.zeros``): for buffers that are never paged."""
    return torch.zeros(shape, dtype=dtype, device=device)


def in_blocks(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``(rows, n)`` as ``(rows, n / width, width)``, the kernels' block form. A single row is viewed as a contiguous
    tensor's, so that its strides do not depend on the buffer's length (they would count as a new shape for the
    compiled kernel)."""
    return rows[0].view(1, -1, width) if rows.shape[0] == 1 else rows.unflatten(1, (-1, width))


BITSANDBYTES_FORMATS = ("fp32", "blockwise8")
"""The formats bitsandbytes has optimizer classes of (``AdamW32bit``, ``AdamW8bit``): every algorithm's default
named classes, and the classes that keep bitsandbytes' ``optim_bits`` argument."""

FORMATS: dict[str, StateFormat] = {}
"""Registered formats by name."""


_UNIQUE = ("name", "code", "class_suffix", "optim_suffix", "rank")

TORCH_STATE_RANK = 1
"""The rank no format may take: the planner's tables (``hf-optim validate --fit``) put torch's own AdamW state, in
the parameters' dtype, there, between fp32 state (0) and the 1-byte formats (2)."""


def register_format(fmt: StateFormat) -> StateFormat:
    """Add ``fmt`` to :data:`FORMATS`. Its name, code, class and ``optim=`` suffixes, rank and ``optim_bits`` alias
    (when it has one) must be new: the rest of hf_optim derives class and Trainer names and its tables' order from
    them. A format with
    :attr:`StateFormat.ahead_of` goes in ahead of that format (which must be registered)."""
    for other in FORMATS.values():
        same = [key for key in _UNIQUE if getattr(other, key) == getattr(fmt, key)]
        if fmt.optim_bits is not None and other.optim_bits == fmt.optim_bits:
            same.append("optim_bits")
        if same:
            raise ValueError(f"state format {fmt.name!r} clashes with {other.name!r} ({', '.join(same)})")
    if fmt.rank == TORCH_STATE_RANK:
        raise ValueError(f"state format {fmt.name!r} has rank {fmt.rank}, which the planner keeps for torch's own "
                         "state; choose another rank (fractions are fine: fp8's is 2.5)")
    if fmt.ahead_of is None:
        FORMATS[fmt.name] = fmt
        return fmt
    if fmt.ahead_of not in FORMATS:
        raise ValueError(f"state format {fmt.name!r} goes ahead of {fmt.ahead_of!r}, which is not registered")
    order = list(FORMATS.values())
    order.insert(list(FORMATS).index(fmt.ahead_of), fmt)
    FORMATS.clear()
    FORMATS.update((f.name, f) for f in order)
    return fmt


def formats_by_rank(names=None) -> list[StateFormat]:
    """The registered formats (or those named in ``names``) in table order (:attr:`StateFormat.rank`)."""
    chosen = FORMATS.values() if names is None else [format_named(name) for name in names]
    return sorted(chosen, key=lambda fmt: fmt.rank)


class StateFormats(list):
    """The list :func:`available_state_formats` returns: :class:`StateFormat` objects, shown as a table."""

    HEADER = ("state_format", "label", "optim_bits", "classes", "optim= names", "bytes/element")
    SLOT = 1 << 20
    """Elements of the slot whose bytes per element the table shows (a per-tensor map is negligible at this size;
    at 4096 elements blockwise8's 1 KiB map alone added 0.25 byte/element)."""

    def rows(self) -> list[tuple[str, ...]]:
        return [(f.name, f.label, "-" if f.optim_bits is None else str(f.optim_bits), f"AdamW{f.class_suffix}",
                 f"adamw_{f.optim_suffix}", f"{f.state_bytes(self.SLOT) / self.SLOT:.4g}") for f in self]

    def table(self) -> str:
        rows = [self.HEADER, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.HEADER))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)

    __repr__ = __str__ = table


def available_state_formats() -> StateFormats:
    """Every registered state format in table order (``print(hf_optim.available_state_formats())``: a table of
    names, labels, ``optim_bits`` aliases, class and ``optim=`` suffixes, and bytes per element)."""
    return StateFormats(formats_by_rank())


def format_named(name: str) -> StateFormat:
    """The format registered as ``name``; an unknown name raises ValueError with the known ones."""
    if not isinstance(name, str) or name not in FORMATS:
        close = difflib.get_close_matches(str(name), FORMATS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(repr(fmt.name) for fmt in formats_by_rank())
        raise ValueError(f"Invalid state_format: {name!r}; expected one of {known}{hint}")
    return FORMATS[name]


def format_for_bits(bits: int) -> StateFormat:
    """The format bitsandbytes' ``optim_bits=bits`` selects (its :attr:`StateFormat.optim_bits` alias)."""
    for fmt in FORMATS.values():
        if fmt.optim_bits is not None and fmt.optim_bits == bits and not isinstance(bits, bool):
            return fmt
    known = sorted(fmt.optim_bits for fmt in FORMATS.values() if fmt.optim_bits is not None)
    raise ValueError(f"Invalid optim_bits: {bits!r}; expected one of {known}")


def with_overrides(group, overrides) -> dict:
    """``group``'s settings with a parameter's ``overrides`` applied; an override that names a ``state_format``
    without ``optim_bits`` brings its alias along, so that the group's ``optim_bits`` does not overrule it."""
    settings = {**group, **overrides}
    if "state_format" in overrides and "optim_bits" not in overrides:
        settings["optim_bits"] = format_named(overrides["state_format"]).group_bits
    return settings


def settings_format(settings) -> StateFormat:
    """The format a param group (or a parameter's merged settings) asks for: its ``state_format``, unless its
    ``optim_bits`` was set apart from it (a per-parameter override ``{"optim_bits": 32}``, bitsandbytes' manager,
    a bitsandbytes state dict): then the format ``optim_bits`` selects."""
    fmt = FORMATS.get(settings.get("state_format"))
    bits = settings.get("optim_bits")
    if fmt is None or (bits is not None and bits != fmt.group_bits):
        return format_for_bits(bits)
    return fmt


def loaded_format(state: dict, spec) -> StateFormat | None:
    """The format a parameter's (created or loaded) state holds slot ``spec`` in, or None if none fits."""
    for fmt in FORMATS.values():
        if fmt.recognises(state, spec):
            return fmt
    return None


@dataclass(frozen=True)
class SlotLayout:
    """What a kernel must know statically about one slot: its format and whether its map is signed."""

    format: StateFormat
    signed: bool

    @property
    def width(self) -> int:
        return self.format.width
