"""One conformance suite over every registered state format (:func:`hf_optim.formats.formats_by_rank`).

Per format and slot kind (signed / unsigned map, one row / AdEMAMix's two stacked rows): quantize then dequantize
stays within the bound derived from the format's own map (fp32: exact); a slot survives ``torch.save`` /
``torch.load(weights_only=True)`` and the format's load checks, bit for bit; slots allocated through the
optimizers' allocator (paged or not: on CPU paged allocation is ordinary memory) have the format's dtypes, decode to
zero and occupy exactly ``state_bytes``; its Triton branch is one declaration (``TritonRows``) named by reference; and
with the Triton backend (Triton's interpreter), the fused kernel equals the PyTorch path bit for bit, or for a format
without a Triton branch, its tensors step on the PyTorch path (said once in a log line) while the small tensors' fp32
state still runs on Triton.
"""

from __future__ import annotations

import inspect
import io
import warnings

import pytest
import torch
from format_helpers import element_scale, round_trip_bound

from hf_optim.core.state_store import StateSpec
from hf_optim.formats import FORMATS, StateFormat, formats_by_rank, loaded_format
from hf_optim.formats.base import StateDictError
from hf_optim.kernels.triton_path.configs import fused_configs
from hf_optim.optim import fast_paths, registry, sharded_blocks
from hf_optim.optim.shard_layout import Part
from hf_optim.paging import is_paged_tensor, state_allocator

REGISTERED = [fmt.name for fmt in formats_by_rank()]
SLOTS = [StateSpec("state1", signed=True), StateSpec("state2", signed=False), StateSpec("state1", True, rows=2)]
FP32_ROUNDING = 4 * torch.finfo(torch.float32).eps
"""Slack, relative to the scale, for the fp32 roundings of normalizing (``v / absmax``) and decoding
(``qmap * absmax``): a value exactly at a gap's midpoint may land a few ulps of the scale past half the gap."""
SHAPE = (25, 41)
"""1025 elements: odd, a partial last block for every block size, a matrix for rank-1 scales."""


@pytest.fixture(params=REGISTERED)
def fmt(request):
    return FORMATS[request.param]


def slot_id(spec: StateSpec) -> str:
    return f"{'signed' if spec.signed else 'unsigned'}-{spec.rows}row"


# --------------------------------------------------------------------------------------------------------------
# Bounds derived from the format
def probe_values(spec: StateSpec, n: int) -> torch.Tensor:
    """``(rows, n)`` values over nine decades, zeros, a negative zero and an all-zero block (|v| for unsigned)."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(spec.rows, n, generator=gen) * torch.logspace(-6, 3, n)[torch.randperm(n, generator=gen)]
    values[:, 256:512] = 0.0  # an all-zero block (of 256 or 128 elements)
    values[:, 41 * 20 : 41 * 21] = 0.0  # an all-zero row of the (25, 41) matrix (rank-1 scales)
    values[0, 3] = -0.0
    return values if spec.signed else values.abs()


def allocate_slot(fmt: StateFormat, spec: StateSpec, paged: bool, device: str = "cpu") -> dict:
    param = torch.zeros(SHAPE, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged allocation on CPU says once that it is ordinary memory
        allocate = state_allocator(paged, "ConformanceTest")
        state: dict = {}
        fmt.init_slot(state, spec, param, allocate)
    return state


def store(fmt: StateFormat, state: dict, spec: StateSpec, values: torch.Tensor) -> torch.Tensor:
    """Quantize ``values`` into the slot and return its dequantized contents."""
    raw = fmt.raw(state, spec)
    fmt.store(values, raw, spec.signed)
    return fmt.dequantize(fmt.raw(state, spec), spec.signed, values.shape[1])


def slot_bytes(fmt: StateFormat, spec: StateSpec) -> int:
    """``fmt.state_bytes`` of the slot, passing the signedness and shape to a format whose size depends on them."""
    extra = {"signed": spec.signed, "shape": SHAPE}
    accepted = inspect.signature(fmt.state_bytes).parameters
    n = torch.Size(SHAPE).numel()
    return fmt.state_bytes(n, spec.rows, **{key: value for key, value in extra.items() if key in accepted})


# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SLOTS, ids=slot_id)
def test_round_trip_is_within_the_bound_of_the_format(fmt, spec):
    n = torch.Size(SHAPE).numel()
    state = allocate_slot(fmt, spec, paged=False)
    values = probe_values(spec, n)
    decoded = store(fmt, state, spec, values.clone())
    assert decoded.shape == values.shape and decoded.dtype == torch.float32
    if not fmt.quantized:
        assert torch.equal(decoded, values)
        return
    bound = round_trip_bound(state, spec, fmt)
    assert 0 < bound < 0.5
    scale = element_scale(fmt, values, spec.signed, SHAPE)
    error = (decoded - values).abs()
    allowed = (bound + FP32_ROUNDING) * scale
    assert torch.all(error <= allowed), f"worst {(error / scale).nan_to_num().max():.6g} > {bound:.6g}"
    assert bool((scale == 0).any()) and torch.all(decoded[scale == 0] == 0), "zero scale must decode to exactly 0"
    if spec.signed:
        assert torch.all(decoded * values >= 0), "a value changed sign"
    # the bound is not vacuous: the widest error is more than half the bound
    assert (error / scale.clamp(min=1e-30)).max() > bound / 2


@pytest.mark.parametrize("spec", SLOTS, ids=slot_id)
def test_state_dict_round_trip_of_a_slot(fmt, spec):
    n = torch.Size(SHAPE).numel()
    state = allocate_slot(fmt, spec, paged=False)
    decoded = store(fmt, state, spec, probe_values(spec, n))
    buffer = io.BytesIO()
    torch.save({key: state[key] for key in fmt.keys(spec)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded.keys() == {key for key in fmt.keys(spec)}
    param = torch.zeros(SHAPE)
    assert loaded_format(loaded, spec) is fmt.stored_as(spec)
    fmt.check_loaded(param, loaded, spec, "conformance")
    for key in fmt.keys(spec):
        if not isinstance(state[key], torch.Tensor):  # a plain value (stochastic4's format marker)
            assert loaded[key] == state[key], key
            continue
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key]), key
    assert torch.equal(fmt.dequantize(fmt.raw(loaded, spec), spec.signed, n), decoded)
    # a slot saved for another parameter is refused by the format's load check
    with pytest.raises(StateDictError):
        fmt.check_loaded(torch.zeros(n + 300), loaded, spec, "conformance")


@pytest.mark.parametrize("paged", [False, True], ids=["unpaged", "paged"])
@pytest.mark.parametrize("spec", SLOTS, ids=slot_id)
def test_allocation_dtypes_zero_values_and_state_bytes(fmt, spec, paged):
    state = allocate_slot(fmt, spec, paged)
    n = torch.Size(SHAPE).numel()
    assert set(state) == set(fmt.keys(spec))
    main = state[spec.key]
    assert main.dtype == fmt.main_dtype() and main.device.type == "cpu"
    assert main.shape[-1] == (fmt.main_length(n) if fmt.packed else SHAPE[-1])
    assert not any(is_paged_tensor(t) for t in state.values())  # CPU: paged allocation is ordinary memory
    held = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    assert held == slot_bytes(fmt, spec), f"allocated {held} bytes, state_bytes says {slot_bytes(fmt, spec)}"
    decoded = fmt.dequantize(fmt.raw(state, spec), spec.signed, n)
    assert decoded.shape == (spec.rows, n) and torch.all(decoded == 0), "a new slot must decode to zeros"
    assert loaded_format(state, spec) is fmt.stored_as(spec)


# --------------------------------------------------------------------------------------------------------------
# Parts of a tensor (FSDP2's shards) quantize as the whole tensor does
PART_BOUNDS = (0, 300, 301, 700, 1025)
"""Parts of the 1025 elements: boundaries inside blocks of 128 and 256 and inside rows of the (25, 41) matrix, odd
(inside a packed byte), and a part of one element."""


@pytest.mark.parametrize("spec", SLOTS, ids=slot_id)
def test_parts_with_max_combined_scales_store_the_whole_tensors_state(fmt, spec):
    """The contract ``hf_optim.optim.sharded_blocks`` builds on: each part of a tensor, zero-padded to the whole runs
    of its format's scales (:meth:`StateFormat.scales`), gives partial scales (:meth:`StateFormat.scales_of`) whose
    element-wise maxima over the parts are the whole tensor's; stored against them, every part's elements decode
    to what the whole tensor's state decodes them to, bit for bit, and its scales are the whole tensor's."""
    if not fmt.quantized:
        assert fmt.scales(spec, SHAPE) == ()
        return
    if not fmt.scales(spec, SHAPE):  # a quantized format without the declaration is refused on a sharded tensor
        part = Part(0, 300, 1025, 0, (0, 300, 1025), SHAPE, 0, None)
        with pytest.raises(ValueError, match=f"{fmt.name} state of a tensor sharded over 2 ranks.*blockwise4"):
            sharded_blocks.geometry(part, fmt, spec)
        return
    n = torch.Size(SHAPE).numel()
    values = probe_values(spec, n)
    whole = allocate_slot(fmt, spec, paged=False)
    fmt.store(values, fmt.raw(whole, spec), spec.signed)
    expected = fmt.dequantize(fmt.raw(whole, spec), spec.signed, n)
    scales = fmt.scales(spec, SHAPE)
    run = scales[0].run
    assert all(scale.run == run for scale in scales)
    parts = []
    for lo, hi in zip(PART_BOUNDS[:-1], PART_BOUNDS[1:]):
        first, runs = lo // run, -(-hi // run) - lo // run
        state: dict = {}
        fmt.init_slot(state, spec, torch.zeros(fmt.span_shape(spec, SHAPE, runs)), state_allocator(False, "Test"))
        placed = torch.zeros(spec.rows, runs * run)
        placed[:, lo - first * run : hi - first * run] = values[:, lo:hi]
        partial = fmt.scales_of(placed, fmt.raw(state, spec), spec.signed)
        parts.append((lo, hi, first, runs, state, placed, partial))
    combined = [torch.zeros(spec.rows, run if scale.across else -(-n // run)) for scale in scales]
    for _, _, first, runs, _, _, partial in parts:
        for scale, total, mine in zip(scales, combined, partial):
            window = total if scale.across else total[:, first : first + runs]
            window.copy_(torch.maximum(window, mine))
    for lo, hi, first, runs, state, placed, _ in parts:
        given = [total if scale.across else total[:, first : first + runs] for scale, total in zip(scales, combined)]
        fmt.store(placed, fmt.raw(state, spec), spec.signed, given)
        decoded = fmt.dequantize(fmt.raw(state, spec), spec.signed, runs * run)[:, lo - first * run : hi - first * run]
        assert torch.equal(decoded.view(torch.int32), expected[:, lo:hi].view(torch.int32)), (lo, hi)
        for scale, total in zip(scales, combined):
            mine = state[scale.key].reshape(spec.rows, -1)
            assert torch.equal(mine, total if scale.across else total[:, first : first + runs]), scale.key
            wanted = whole[scale.key].reshape(spec.rows, -1)
            assert torch.equal(mine, wanted if scale.across else wanted[:, first : first + runs]), scale.key


# --------------------------------------------------------------------------------------------------------------
# Triton branch: one declaration per format, and the fused kernel in the interpreter against the PyTorch path
def test_a_triton_branch_is_one_declaration_named_by_reference(fmt):
    """A format's Triton branch (row I/O and tuning) is one ``TritonRows``, named by a ``"module:attribute"`` string
    (formats/ never import triton) and resolved by the kernels; its label and its functions' names are its own (the
    kernels' labels name formats by it; tools key compiled binaries by the functions' names)."""
    from hf_optim.kernels.triton_path.rows import TritonRows, rows_of

    if not fmt.triton:
        assert fmt.triton_rows is None
        pytest.skip(f"{fmt.name} has no Triton branch")
    rows = rows_of(fmt)
    assert isinstance(fmt.triton_rows, str) and isinstance(rows, TritonRows)
    others = [rows_of(other) for other in FORMATS.values() if other.triton and other is not fmt]
    assert rows.label not in {other.label for other in others}
    taken = {function.__name__ for other in others for function in (other.load, other.store)}
    assert {rows.load.__name__, rows.store.__name__}.isdisjoint(taken)


def twin_family(fmt: StateFormat):
    """The first registered elementwise algorithm with a Triton rule that runs with ``fmt``, or None."""
    for family in registry.families():
        algorithm = family.algorithm
        if (fmt in family.base._supported_formats() and algorithm.triton_plan.elementwise
                and fused_configs(algorithm, (fmt,))):
            return family
    return None


TWIN_SHAPES = [(600,), (45,)]
TWIN_MIN_8BIT = 512


def run_twin(cls, fmt, backend_name, monkeypatch):
    monkeypatch.setenv("HF_OPTIM_BACKEND", backend_name)
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in TWIN_SHAPES]
    opt = cls(params, lr=1e-2, state_format=fmt.name, min_8bit_size=TWIN_MIN_8BIT)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, params


@pytest.mark.parametrize("name", REGISTERED)
def test_triton_interpreter_twin_equals_pytorch(name, monkeypatch, use_triton, cuda_scalars, launched):  # noqa: F811
    fmt = FORMATS[name]
    family = twin_family(fmt)
    if family is None:
        pytest.skip(f"no registered algorithm has a Triton rule for {name}")  # not a registered format's case today
    ref_opt, ref_params = run_twin(family.base, fmt, "torch", monkeypatch)
    assert launched == []
    monkeypatch.setattr(fast_paths, "_told_no_triton", set())
    told: list[str] = []
    monkeypatch.setattr(fast_paths.logger, "warning", lambda message, *args: told.append(message % args))
    opt, params = run_twin(family.base, fmt, "triton", monkeypatch)
    assert "backend=triton" in repr(opt)
    launched_codes = {code for config in launched for code in config.formats}
    if fmt.triton:
        assert launched_codes == {fmt.code, FORMATS["fp32"].code} and told == []
    else:  # its tensors took the PyTorch path (said once, naming the format); the small one's fp32 state Triton
        assert launched_codes == {FORMATS["fp32"].code}
        assert len(told) == 1 and repr(name) in told[0], told
    for ref_p, p in zip(ref_params, params):
        assert torch.equal(p, ref_p), f"{tuple(p.shape)}: parameters differ"
        assert ref_opt.state[ref_p].keys() == opt.state[p].keys()
        for key, ref in ref_opt.state[ref_p].items():
            value = opt.state[p][key]
            if isinstance(ref, torch.Tensor):
                assert value.dtype == ref.dtype and torch.equal(value, ref), f"{tuple(p.shape)}: {key} differs"
        quantized = p.numel() >= TWIN_MIN_8BIT and fmt.quantized
        for spec in family.base.state_specs:
            expected = fmt.stored_as(spec).name if quantized else "fp32"
            assert loaded_format(opt.state[p], spec).name == expected
