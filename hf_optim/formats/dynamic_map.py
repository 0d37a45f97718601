"""The 8-bit dynamic quantization maps of bitsandbytes, and the lookup tables that encode against them.

A map is 256 sorted fp32 values in [-1, 1] (signed) or [0, 1] (unsigned). It is built from 7 decades,
10^-6 .. 10^0: in decade ``i`` the signed map holds the midpoints of ``linspace(0.1, 1, 2**i + 1)`` scaled by
``10**(i - 6)`` with both signs, the unsigned map the midpoints of ``linspace(0.1, 1, 2**(i + 1) + 1)``; 0 and 1
are appended.

The maps are constants of the package (:data:`SIGNED_MAP_BITS`, :data:`UNSIGNED_MAP_BITS`), never computed at run
time: bitsandbytes builds them with ``torch.linspace`` in fp32, whose last bit depends on how torch's CPU kernels
were compiled. The constants are what bitsandbytes' ``create_dynamic_map`` gives with torch's FMA kernels (AVX2 and
AVX-512, where ``start + step * i`` rounds once); torch's kernels without FMA (``ATEN_CPU_CAPABILITY=default``)
round 42 signed and 31 unsigned entries 1 ulp differently. A checkpoint holding such a map still loads
(:meth:`hf_optim.formats.blockwise8.Blockwise8.check_loaded`) and continues on these constants.

Encoding (value -> nearest code) uses one lookup table keyed by the top bits of the fp32 pattern of the normalized
value: sign, exponent and ``MANTISSA_BITS`` mantissa bits. Each key covers a range of relative width
2**-MANTISSA_BITS, narrower than the closest pair of midpoints, so a key's range contains at most one midpoint.
Beyond that midpoint the value moves one code further from zero. Every value in a range shares its top bits with
the midpoint, and positive fp32 values order like their bit patterns, so comparing the low ``KEY_SHIFT`` bits
decides exactly which side a value is on. An entry therefore packs ``code << KEY_SHIFT | midpoint low bits`` (the
low bits are all ones when the range holds no midpoint, which no value exceeds): a single lookup per value.
Only the ``BINADES`` binades below 1.0 are kept (smaller magnitudes clamp into the first key, which holds no
midpoint), so the table (48 KiB) stays in cache. The result is exact round-to-nearest, with exact ties going to
the code nearer zero. Signed maps apply bitsandbytes' sign fix: a value with the sign bit set (negative values
and -0.0, as CUDA's ``signbit``) never encodes as the 0.0 code but as the smallest negative one.
"""

from __future__ import annotations

import functools

import torch

MANTISSA_BITS = 8
"""Mantissa bits in the lookup key; 2**-8 = 0.39% is finer than the closest relative midpoint spacing (0.7%)."""

BINADES = 23
"""Binades of magnitude kept below 1.0: the smallest map midpoint (2.75e-7) lies above 2**-23 (1.2e-7)."""

KEY_SHIFT = 23 - MANTISSA_BITS
KEYS_PER_SIGN = (BINADES + 1) << MANTISSA_BITS  # magnitudes [2**-BINADES, 2), 1.0 included
KEY_OFFSET = (127 - BINADES) << MANTISSA_BITS  # magnitude key of 2**-BINADES
ZERO_CODE_SIGNED = 127


# The fp32 bit patterns of the maps in ascending order of value, 8 codes per line (line k: codes 8k .. 8k + 7).
# Read one with ``struct.unpack("<f", struct.pack("<I", bits))[0]`` or ``float.hex`` of that.
SIGNED_MAP_BITS: tuple[int, ...] = (
    0xBF7E3333, 0xBF7A999A, 0xBF770000, 0xBF736666, 0xBF6FCCCD, 0xBF6C3333, 0xBF68999A, 0xBF650000,
    0xBF616666, 0xBF5DCCCD, 0xBF5A3333, 0xBF56999A, 0xBF530000, 0xBF4F6666, 0xBF4BCCCD, 0xBF483333,
    0xBF44999A, 0xBF410000, 0xBF3D6666, 0xBF39CCCD, 0xBF363334, 0xBF32999A, 0xBF2F0000, 0xBF2B6666,
    0xBF27CCCD, 0xBF243334, 0xBF20999A, 0xBF1D0000, 0xBF196666, 0xBF15CCCD, 0xBF123334, 0xBF0E999A,
    0xBF0B0000, 0xBF076666, 0xBF03CCCC, 0xBF003333, 0xBEF93332, 0xBEF20000, 0xBEEACCCC, 0xBEE3999A,
    0xBEDC6666, 0xBED53333, 0xBECE0000, 0xBEC6CCCC, 0xBEBF999A, 0xBEB86666, 0xBEB13333, 0xBEAA0000,
    0xBEA2CCCC, 0xBE9B999A, 0xBE946666, 0xBE8D3334, 0xBE860000, 0xBE7D9999, 0xBE6F3333, 0xBE60CCCD,
    0xBE526666, 0xBE440000, 0xBE35999A, 0xBE273333, 0xBE18CCCD, 0xBE0A6666, 0xBDF80000, 0xBDDB3334,
    0xBDC9EB85, 0xBDC428F7, 0xBDBE6667, 0xBDB8A3D7, 0xBDB2E148, 0xBDAD1EB8, 0xBDA75C2A, 0xBDA1999A,
    0xBD9BD70A, 0xBD96147B, 0xBD9051EB, 0xBD8A8F5D, 0xBD84CCCD, 0xBD7E147B, 0xBD728F5D, 0xBD670A3D,
    0xBD5B851F, 0xBD500000, 0xBD447AE1, 0xBD38F5C3, 0xBD2D70A3, 0xBD21EB85, 0xBD166667, 0xBD0AE148,
    0xBCFEB852, 0xBCE7AE15, 0xBCD0A3D7, 0xBCB9999A, 0xBCA28F5D, 0xBC8B851F, 0xBC68F5C3, 0xBC3AE148,
    0xBC1F3B64, 0xBC160418, 0xBC0CCCCD, 0xBC039581, 0xBBF4BC6A, 0xBBE24DD3, 0xBBCFDF3B, 0xBBBD70A4,
    0xBBAB020D, 0xBB989374, 0xBB8624DD, 0xBB676C8A, 0xBB428F5C, 0xBB1DB22D, 0xBAF1A9FC, 0xBAA7EF9D,
    0xBA7765FF, 0xBA59E83E, 0xBA3C6A80, 0xBA1EECC1, 0xBA016F01, 0xB9C7E283, 0xB98CE705, 0xB923D70B,
    0xB8BA1F4B, 0xB88AEFB3, 0xB8378034, 0xB7B24206, 0xB70205FF, 0xB65A1A94, 0xB513A3B7, 0x00000000,
    0x3513A3B7, 0x365A1A94, 0x370205FF, 0x37B24206, 0x38378034, 0x388AEFB3, 0x38BA1F4B, 0x3923D70B,
    0x398CE705, 0x39C7E283, 0x3A016F01, 0x3A1EECC1, 0x3A3C6A80, 0x3A59E83E, 0x3A7765FF, 0x3AA7EF9D,
    0x3AF1A9FC, 0x3B1DB22D, 0x3B428F5C, 0x3B676C8A, 0x3B8624DD, 0x3B989374, 0x3BAB020D, 0x3BBD70A4,
    0x3BCFDF3B, 0x3BE24DD3, 0x3BF4BC6A, 0x3C039581, 0x3C0CCCCD, 0x3C160418, 0x3C1F3B64, 0x3C3AE148,
    0x3C68F5C3, 0x3C8B851F, 0x3CA28F5D, 0x3CB9999A, 0x3CD0A3D7, 0x3CE7AE15, 0x3CFEB852, 0x3D0AE148,
    0x3D166667, 0x3D21EB85, 0x3D2D70A3, 0x3D38F5C3, 0x3D447AE1, 0x3D500000, 0x3D5B851F, 0x3D670A3D,
    0x3D728F5D, 0x3D7E147B, 0x3D84CCCD, 0x3D8A8F5D, 0x3D9051EB, 0x3D96147B, 0x3D9BD70A, 0x3DA1999A,
    0x3DA75C2A, 0x3DAD1EB8, 0x3DB2E148, 0x3DB8A3D7, 0x3DBE6667, 0x3DC428F7, 0x3DC9EB85, 0x3DDB3334,
    0x3DF80000, 0x3E0A6666, 0x3E18CCCD, 0x3E273333, 0x3E35999A, 0x3E440000, 0x3E526666, 0x3E60CCCD,
    0x3E6F3333, 0x3E7D9999, 0x3E860000, 0x3E8D3334, 0x3E946666, 0x3E9B999A, 0x3EA2CCCC, 0x3EAA0000,
    0x3EB13333, 0x3EB86666, 0x3EBF999A, 0x3EC6CCCC, 0x3ECE0000, 0x3ED53333, 0x3EDC6666, 0x3EE3999A,
    0x3EEACCCC, 0x3EF20000, 0x3EF93332, 0x3F003333, 0x3F03CCCC, 0x3F076666, 0x3F0B0000, 0x3F0E999A,
    0x3F123334, 0x3F15CCCD, 0x3F196666, 0x3F1D0000, 0x3F20999A, 0x3F243334, 0x3F27CCCD, 0x3F2B6666,
    0x3F2F0000, 0x3F32999A, 0x3F363334, 0x3F39CCCD, 0x3F3D6666, 0x3F410000, 0x3F44999A, 0x3F483333,
    0x3F4BCCCD, 0x3F4F6666, 0x3F530000, 0x3F56999A, 0x3F5A3333, 0x3F5DCCCD, 0x3F616666, 0x3F650000,
    0x3F68999A, 0x3F6C3333, 0x3F6FCCCD, 0x3F736666, 0x3F770000, 0x3F7A999A, 0x3F7E3333, 0x3F800000,
)
UNSIGNED_MAP_BITS: tuple[int, ...] = (
    0x00000000, 0x34AE7BAA, 0x35500998, 0x360E9B38, 0x3692CCF6, 0x36DE4C51, 0x3714E5D5, 0x3783126E,
    0x37E171A0, 0x381FE868, 0x384F1800, 0x387E479A, 0x3896BB99, 0x38AE5364, 0x38C5EB31, 0x3906594B,
    0x394154CA, 0x397C5049, 0x399BA5E4, 0x39B923A2, 0x39D6A163, 0x39F41F22, 0x3A08CE71, 0x3A178D50,
    0x3A264C30, 0x3A350B10, 0x3A43C9EF, 0x3A5288D0, 0x3A6147AF, 0x3A70068E, 0x3A7EC56E, 0x3A958106,
    0x3ABA5E35, 0x3ADF3B64, 0x3B020C4A, 0x3B147AE1, 0x3B26E978, 0x3B395810, 0x3B4BC6A7, 0x3B5E3540,
    0x3B70A3D7, 0x3B818937, 0x3B8AC082, 0x3B93F7CF, 0x3B9D2F1A, 0x3BA66666, 0x3BAF9DB2, 0x3BB8D4FD,
    0x3BC20C4A, 0x3BCB4395, 0x3BD47AE1, 0x3BDDB22E, 0x3BE6E978, 0x3BF020C5, 0x3BF9580F, 0x3C0147AE,
    0x3C05E354, 0x3C0A7EF9, 0x3C0F1AA0, 0x3C13B645, 0x3C1851EB, 0x3C1CED92, 0x3C218937, 0x3C2F5C2A,
    0x3C466667, 0x3C5D70A3, 0x3C747AE2, 0x3C85C28F, 0x3C9147AF, 0x3C9CCCCD, 0x3CA851EB, 0x3CB3D70B,
    0x3CBF5C29, 0x3CCAE147, 0x3CD66667, 0x3CE1EB87, 0x3CED70A3, 0x3CF8F5C3, 0x3D023D70, 0x3D080000,
    0x3D0DC28F, 0x3D13851F, 0x3D1947AF, 0x3D1F0A3D, 0x3D24CCCD, 0x3D2A8F5C, 0x3D3051EB, 0x3D36147B,
    0x3D3BD70A, 0x3D41999A, 0x3D475C28, 0x3D4D1EB8, 0x3D52E147, 0x3D58A3D7, 0x3D5E6667, 0x3D6428F7,
    0x3D69EB87, 0x3D6FAE15, 0x3D7570A3, 0x3D7B3333, 0x3D807AE2, 0x3D835C2A, 0x3D863D71, 0x3D891EB8,
    0x3D8C0000, 0x3D8EE148, 0x3D91C290, 0x3D94A3D7, 0x3D97851F, 0x3D9A6667, 0x3D9D47AF, 0x3DA028F6,
    0x3DA30A3E, 0x3DA5EB85, 0x3DA8CCCD, 0x3DABAE15, 0x3DAE8F5C, 0x3DB170A4, 0x3DB451EB, 0x3DB73333,
    0x3DBA147B, 0x3DBCF5C3, 0x3DBFD70B, 0x3DC2B852, 0x3DC5999A, 0x3DC87AE2, 0x3DCB5C29, 0x3DD40000,
    0x3DE26666, 0x3DF0CCCD, 0x3DFF3333, 0x3E06CCCC, 0x3E0E0000, 0x3E153334, 0x3E1C6666, 0x3E23999A,
    0x3E2ACCCC, 0x3E320000, 0x3E393334, 0x3E406666, 0x3E47999A, 0x3E4ECCCC, 0x3E560000, 0x3E5D3334,
    0x3E646666, 0x3E6B999A, 0x3E72CCCC, 0x3E7A0000, 0x3E809999, 0x3E843333, 0x3E87CCCD, 0x3E8B6666,
    0x3E8F0000, 0x3E92999A, 0x3E963333, 0x3E99CCCC, 0x3E9D6666, 0x3EA10000, 0x3EA4999A, 0x3EA83333,
    0x3EABCCCC, 0x3EAF6666, 0x3EB30000, 0x3EB6999A, 0x3EBA3333, 0x3EBDCCCC, 0x3EC16666, 0x3EC50000,
    0x3EC8999A, 0x3ECC3333, 0x3ECFCCCC, 0x3ED36666, 0x3ED70000, 0x3EDA999A, 0x3EDE3333, 0x3EE1CCCC,
    0x3EE56666, 0x3EE90000, 0x3EEC999A, 0x3EF03333, 0x3EF3CCCC, 0x3EF76666, 0x3EFB0000, 0x3EFE9999,
    0x3F01199A, 0x3F02E666, 0x3F04B333, 0x3F068000, 0x3F084CCC, 0x3F0A199A, 0x3F0BE666, 0x3F0DB334,
    0x3F0F8000, 0x3F114CCD, 0x3F13199A, 0x3F14E666, 0x3F16B334, 0x3F188000, 0x3F1A4CCD, 0x3F1C199A,
    0x3F1DE666, 0x3F1FB334, 0x3F218000, 0x3F234CCD, 0x3F25199A, 0x3F26E666, 0x3F28B334, 0x3F2A8000,
    0x3F2C4CCD, 0x3F2E199A, 0x3F2FE666, 0x3F31B334, 0x3F338000, 0x3F354CCD, 0x3F37199A, 0x3F38E666,
    0x3F3AB334, 0x3F3C8000, 0x3F3E4CCD, 0x3F40199A, 0x3F41E666, 0x3F43B334, 0x3F458000, 0x3F474CCC,
    0x3F49199A, 0x3F4AE666, 0x3F4CB334, 0x3F4E8000, 0x3F504CCC, 0x3F52199A, 0x3F53E666, 0x3F55B334,
    0x3F578000, 0x3F594CCC, 0x3F5B199A, 0x3F5CE666, 0x3F5EB334, 0x3F608000, 0x3F624CCC, 0x3F64199A,
    0x3F65E666, 0x3F67B334, 0x3F698000, 0x3F6B4CCC, 0x3F6D199A, 0x3F6EE666, 0x3F70B334, 0x3F728000,
    0x3F744CCC, 0x3F76199A, 0x3F77E666, 0x3F79B334, 0x3F7B8000, 0x3F7D4CCC, 0x3F7F199A, 0x3F800000,
)


def _map_from_bits(bits: tuple[int, ...]) -> torch.Tensor:
    signed_bits = [b - (1 << 32) if b >= 1 << 31 else b for b in bits]  # as int32, so the view is exact
    return torch.tensor(signed_bits, dtype=torch.int32).view(torch.float32)


_MAPS = {True: _map_from_bits(SIGNED_MAP_BITS), False: _map_from_bits(UNSIGNED_MAP_BITS)}


def create_dynamic_map(signed: bool = True) -> torch.Tensor:
    """The 256-entry fp32 dynamic map (a fresh CPU tensor): the package's constant, equal bit for bit to
    bitsandbytes' ``create_dynamic_map`` under torch's FMA kernels (see the module)."""
    return _MAPS[signed].clone()


_built: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}


def _build_maps(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    qmap = _MAPS[signed]
    _built[signed] = qmap, _build_encoder(qmap, signed)
    return _built[signed]


# The encoder table's build checks its own exactness (a data-dependent branch) and is worth doing once per process,
# not once per compiled graph: under torch.compile it runs outside the graph. (torch._disable_dynamo imports
# dynamo only when first called.)
_build_maps_eagerly = torch._disable_dynamo(_build_maps)


def _maps_cpu(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(map, encoder table) on CPU, the table built once per process. A compiled step that finds them built reads
    them as constants (a dict lookup, no graph break); only the very first build breaks the graph."""
    maps = _built.get(signed)
    if maps is not None:
        return maps
    return _build_maps_eagerly(signed) if torch.compiler.is_compiling() else _build_maps(signed)


def dynamic_map(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The signed or unsigned dynamic map on ``device`` (a fresh tensor: callers may store it in state). Read through
    :func:`_maps_cpu`, so that the first eager creation of 8-bit state also builds the encoder table: a compiled step
    traces through ``_encoder_on``'s cache and would otherwise find nothing built and break its graph."""
    return _maps_cpu(signed)[0].to(device, copy=True)


@functools.cache
def _encoder_on(signed: bool, device: torch.device) -> torch.Tensor:
    return _maps_cpu(signed)[1].to(device)


def encoder_table(signed: bool, device: torch.device | str) -> torch.Tensor:
    """The packed int32 encoder table, indexed by :func:`encoder_keys`, cached per device."""
    return _encoder_on(signed, torch.device(device))


def _nearest_codes(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Reference encoder: the code whose value is nearest; an exact tie (a value equal to an fp32 midpoint
    ``(qmap[i] + qmap[i+1]) * 0.5``) goes to the code nearer zero, so encoding is symmetric in sign."""
    mids = (qmap[1:] + qmap[:-1]) * 0.5
    toward_zero_up = torch.bucketize(values, mids, right=True)  # negative ties: the upper (nearer-zero) code
    toward_zero_down = torch.bucketize(values, mids, right=False)  # positive ties: the lower code
    return torch.where(values < 0, toward_zero_up, toward_zero_down)


def encoder_keys(bits: torch.Tensor) -> torch.Tensor:
    """Table index for fp32 bit patterns (int32): magnitude key clamped to the kept binades, plus the sign half."""
    magnitude_key = ((bits & 0x7FFFFFFF) >> KEY_SHIFT) - KEY_OFFSET
    return magnitude_key.clamp(0, KEYS_PER_SIGN - 1) + torch.where(bits < 0, KEYS_PER_SIGN, 0)


LOW_MASK = (1 << KEY_SHIFT) - 1


def _key_ranges() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(is negative, low end |value|, top end |value|) of every key's range."""
    index = torch.arange(2 * KEYS_PER_SIGN, dtype=torch.int64)
    negative = index >= KEYS_PER_SIGN
    magnitude_key = index % KEYS_PER_SIGN
    low_bits = ((magnitude_key + KEY_OFFSET) << KEY_SHIFT).to(torch.int32)
    top_bits = low_bits | ((1 << KEY_SHIFT) - 1)
    low = torch.where(magnitude_key == 0, 0.0, low_bits.view(torch.float32))  # key 0 also holds every tinier value
    return negative, low.clamp(max=1.0), top_bits.view(torch.float32).clamp(max=1.0)


def _codes_at(magnitude: torch.Tensor, negative: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    codes = _nearest_codes(torch.where(negative, -magnitude, magnitude), qmap)
    if signed:
        # Sign fix: a negative value never encodes as +0 (the 0.0 code); it takes the smallest negative code.
        return torch.where(negative & (codes == ZERO_CODE_SIGNED), ZERO_CODE_SIGNED - 1, codes)
    return torch.where(negative, 0, codes)


def _build_encoder(qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    negative, low, top = _key_ranges()
    codes = _codes_at(low, negative, qmap, signed)

    # The midpoint (as |value|) beyond which the nearest code is the next one further from zero.
    mids_abs = ((qmap[1:] + qmap[:-1]) * 0.5).abs()
    inf = torch.tensor([float("inf")])
    up = torch.cat([mids_abs, inf])  # for codes whose value is >= 0: next code is +1
    down = torch.cat([inf, mids_abs])  # for codes whose value is < 0: next code is -1
    threshold = torch.where(qmap >= 0, up, down)[codes]
    inside = (threshold >= low) & (threshold <= top)
    if not signed:
        inside &= ~negative  # negatives clamp to code 0
    threshold_low = torch.where(inside, threshold.view(torch.int32) & LOW_MASK, LOW_MASK)
    table = (codes.to(torch.int32) << KEY_SHIFT) | threshold_low

    # Prove the one-midpoint-per-key property: the top of every key range encodes as the table predicts.
    step = 1 if not signed else torch.where(negative, -1, 1)
    predicted = codes + torch.where(top > torch.where(inside, threshold, float("inf")), step, 0)
    if not torch.equal(predicted, _codes_at(top, negative, qmap, signed)):
        raise AssertionError("dynamic-map encoder table is not exact; MANTISSA_BITS is too small")
    return table.contiguous()
