"""The doctor's self-test: every algorithm x state format x parameter dtype, the backend this device gets against the
PyTorch reference, on small odd-sized tensors; and one timed step per algorithm on a 4096 x 4096 tensor.

The reference is the eager PyTorch path (``HF_OPTIM_BACKEND=torch HF_OPTIM_COMPILE=0``), the rule every other path
is a twin of. The candidate is what this device runs (:func:`candidate`): Triton on a GPU, torch-compile on the CPU
(the Triton interpreter with ``--interpret``). Both run :data:`STEPS` steps from the same parameters and gradients
(the second step's gradients hold NaN and +-Inf, which every rule skips); after each step parameters and every state
tensor are compared under the case's :class:`Tolerance`.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from hf_optim.formats import FP32, StateFormat, format_named, loaded_format
from hf_optim.kernels import backend as kernel_backend
from hf_optim.kernels.torch_path import compile_guard, cpu_compile
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.optim import registry

STEPS = 3
SHAPES: tuple[tuple[int, ...], ...] = ((67, 71), (5003,), (300,))
"""Odd sizes (partial quantization blocks and tiles), a matrix (Adafactor factors it), and a tensor below
``min_8bit_size`` (fp32 state in an 8-bit or 4-bit optimizer, beside quantized state in the same launch)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONSTRUCTOR = {"adafactor": {"beta1": 0.9}}
"""Settings beside an algorithm's defaults: Adafactor's 8-bit state is its first moment, off by default."""
REFERENCE_ENV = {kernel_backend.ENV_VAR: "torch", "HF_OPTIM_COMPILE": "0"}
REFERENCE = "torch (eager)"
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TIMING_NUMEL = 4096 * 4096


@dataclass(frozen=True)
class Tolerance:
    """How far a candidate may be from the reference (ulps are units in the last place of the value's dtype at the
    tensor's scale: ``max(|a|, |b|, mean |a|)``, so a tiny element's last bit does not count as many ulps)."""

    name: str
    param_ulps_per_step: int
    state_ulps: int
    code_fraction: float
    """Fraction of 8-bit / 4-bit codes that may be one code apart (an ulp moved a value across a midpoint)."""
    resync: bool
    """Start each step from the reference's parameters and state (differences then never compound)."""
    why: str


EXACT = Tolerance("bit-identical", 0, 0, 0.0, False,
                  "the same fp32 rule with the same IEEE roundings: parameters, fp32 state and codes bit for bit")
CPU_MATH = Tolerance("1 ulp/step", 1, 0, 0.0, False,
                     "Triton's interpreter against torch's CPU kernels, whose vectorized division and square root are "
                     "not always correctly rounded (the interpreter's are): parameters within 1 ulp per step, state "
                     "and codes bit for bit")
REDUCTIONS = Tolerance("reduction order", 1, 32, 0.01, True,
                       "LAMB's norms and Adafactor's statistics are sums in another order than torch's, so they differ "
                       "in their last bits: parameters within 1 ulp and fp32 state within 32 ulps per step, codes "
                       "equal but for <= 1% one code apart; each step starts from the reference's state")


def tolerance_for(family: registry.Family, candidate_name: str, device: torch.device) -> Tolerance:
    """The tolerance of ``family`` on ``candidate_name`` (a backend name) on ``device``."""
    if candidate_name.startswith("triton"):
        if not family.algorithm.triton_plan.elementwise:
            return REDUCTIONS
        if device.type == "cpu":
            return CPU_MATH
    return EXACT


@dataclass
class Candidate:
    """The path under test: its name (``triton``, ``torch-compile``, ``torch``) and the environment it runs in."""

    name: str
    env: dict[str, str] = field(default_factory=dict)


def candidate(device: torch.device, interpret: bool = False, compiled: bool = False) -> Candidate:
    """What ``device`` runs for a user in this environment; ``interpret``: Triton's interpreter on the CPU.

    On the CPU the compiled kernels are tested only when ``compiled`` (``hf-optim doctor --compiled``): compiling
    each algorithm x format x dtype takes minutes on a cold cache, so by default the CPU runs every case on the
    eager PyTorch path (``HF_OPTIM_COMPILE=0``), which checks that every case runs, in well under a minute."""
    if interpret and device.type == "cpu":
        return Candidate("triton (interpreter)", {kernel_backend.ENV_VAR: "triton"})
    name = kernel_backend.backend_name(device)
    if name == "torch-compile" and not compiled:
        return Candidate("torch", {cpu_compile.COMPILE_ENV: "0"})
    if name == "torch-compile" and cpu_compile.compile_mode() == "auto":
        # auto runs the first steps eagerly while a background process compiles: test the compiled kernels
        return Candidate(name, {cpu_compile.COMPILE_ENV: "1"})
    return Candidate(name)


@dataclass
class Distances:
    """How far a candidate is from the reference: ulps at the tensor's scale (see :class:`Tolerance`), and how many
    of the 8-bit / 4-bit codes differ."""

    param_ulps: float = 0.0
    state_ulps: float = 0.0
    codes_differing: int = 0
    codes: int = 0


@dataclass(kw_only=True)
class CaseResult(Distances):
    algorithm: str
    state: str
    dtype: str
    backend: str
    status: str
    """``exact``, ``within tolerance``, ``MISMATCH``, ``fell back`` (a kernel failed: the PyTorch path ran) or
    ``error``."""
    tolerance: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("exact", "within tolerance")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (hf_optim reads its backend settings at every step)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype).to(device)) for shape in shapes]


def set_grads(params: Sequence[torch.Tensor], step: int) -> None:
    """Deterministic gradients; step 1's include NaN and +-Inf (every rule leaves those elements as they were)."""
    generator = torch.Generator().manual_seed(1000 + step)
    for p in params:
        grad = torch.randn(p.shape, generator=generator)
        if step == 1 and grad.numel() > 1:
            grad.view(-1)[::97] = float("nan")
            grad.view(-1)[5::131] = float("inf")
            grad.view(-1)[9::151] = -float("inf")
        p.grad = grad.to(p.dtype).to(p.device)


def build(family: registry.Family, fmt: StateFormat, params: list, env: dict[str, str]):
    """An optimizer of ``family`` with state in ``fmt`` over ``params``, created in ``env``."""
    with environment(env):
        return family.base(params, state_format=fmt.name, **CONSTRUCTOR.get(family.algorithm.name, {}))


def step(optimizer, env: dict[str, str]) -> None:
    """One step of ``optimizer`` in ``env`` (a seam for tests that corrupt one path)."""
    with environment(env):
        optimizer.step()


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance between same-dtype float tensors in ulps at the tensor's scale (see :class:`Tolerance`);
    infinite when their non-finite entries sit in different places."""
    if a.numel() == 0 or torch.equal(a.view(INT_VIEW.get(a.dtype, a.dtype)), b.view(INT_VIEW.get(b.dtype, b.dtype))):
        return 0.0
    dtype = a.dtype
    a, b = a.detach().float(), b.detach().float()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return float("inf")
    a, b = a[finite], b[finite]
    if a.numel() == 0:
        return 0.0
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), a.abs().mean())
    _, exponent = torch.frexp(scale)
    spacing = torch.finfo(dtype).eps * torch.exp2(exponent.float() - 1)
    return float(((a - b).abs() / spacing).max())


def code_distance(a: torch.Tensor, b: torch.Tensor, packed: bool) -> tuple[int, int, int]:
    """(codes differing, codes in all, largest distance) between two uint8 code tensors (``packed``: two 4-bit codes
    a byte)."""
    if packed:
        a = torch.stack([a & 15, a >> 4])
        b = torch.stack([b & 15, b >> 4])
    distance = (a.int() - b.int()).abs()
    return int((distance > 0).sum()), distance.numel(), int(distance.max()) if distance.numel() else 0


@dataclass
class Difference(Distances):
    code_step: int = 0
    other: str = ""
    """A non-tensor state entry that differs, or a key or dtype mismatch."""

    @property
    def identical(self) -> bool:
        return not (self.param_ulps or self.state_ulps or self.codes_differing or self.other)

    def within(self, tolerance: Tolerance, steps: int) -> bool:
        return (not self.other and self.param_ulps <= tolerance.param_ulps_per_step * steps
                and self.state_ulps <= tolerance.state_ulps * (1 if tolerance.resync else steps)
                and self.code_step <= 1 and self.codes_differing <= tolerance.code_fraction * max(self.codes, 1))


def compare(optimizer, params, ref_optimizer, ref_params) -> Difference:
    """Parameters and every state entry of two optimizers over equal-shaped parameters."""
    diff = Difference()
    packed_keys = set()
    for spec in ref_optimizer.state_specs:
        for ref_p in ref_params:
            fmt = loaded_format(ref_optimizer.state[ref_p], spec)
            if fmt is not None and fmt.packed:
                packed_keys.add((id(ref_p), spec.key))
    for p, ref_p in zip(params, ref_params):
        diff.param_ulps = max(diff.param_ulps, ulps(p.detach(), ref_p.detach()))
        state, ref_state = optimizer.state[p], ref_optimizer.state[ref_p]
        if state.keys() != ref_state.keys():
            diff.other = f"state keys {sorted(state)} != {sorted(ref_state)}"
            continue
        for key, ref in ref_state.items():
            value = state[key]
            if not isinstance(ref, torch.Tensor):
                if value != ref:
                    diff.other = f"{key}: {value!r} != {ref!r}"
            elif value.dtype != ref.dtype or value.shape != ref.shape:
                diff.other = f"{key}: {value.dtype} {tuple(value.shape)} != {ref.dtype} {tuple(ref.shape)}"
            elif ref.dtype == torch.uint8:
                differing, total, largest = code_distance(value, ref, (id(ref_p), key) in packed_keys)
                diff.codes_differing += differing
                diff.codes += total
                diff.code_step = max(diff.code_step, largest)
            elif ref.is_floating_point():
                diff.state_ulps = max(diff.state_ulps, ulps(value, ref))
            elif not torch.equal(value, ref):
                diff.other = f"{key} differs"
    return diff


def _resync(optimizer, params, ref_optimizer, ref_params) -> None:
    with torch.no_grad():
        for p, ref_p in zip(params, ref_params):
            p.copy_(ref_p)
    optimizer.load_state_dict(ref_optimizer.state_dict())


def check(family: registry.Family, state_format: str | StateFormat, dtype_name: str, device: torch.device,
          cand: Candidate, shapes: Sequence[tuple[int, ...]] = SHAPES, steps: int = STEPS) -> CaseResult:
    """One case: ``family`` with state in ``state_format`` (a format or its name) on ``dtype_name`` parameters,
    ``cand`` against the reference."""
    fmt = format_named(state_format) if isinstance(state_format, str) else state_format
    tolerance = tolerance_for(family, cand.name, device)
    result = CaseResult(algorithm=family.algorithm.name, state=fmt.label,
                        dtype=dtype_name, backend=cand.name, status="exact", tolerance=tolerance.name)
    fallbacks = triton_guard.fallback_runs()
    dtype = DTYPES[dtype_name]
    try:
        ref_params, params = make_params(shapes, dtype, device), make_params(shapes, dtype, device)
        ref_opt = build(family, fmt, ref_params, REFERENCE_ENV)
        opt = build(family, fmt, params, cand.env)
        for index in range(steps):
            set_grads(ref_params, index)
            set_grads(params, index)
            step(ref_opt, REFERENCE_ENV)
            step(opt, cand.env)
            diff = compare(opt, params, ref_opt, ref_params)
            result.param_ulps = max(result.param_ulps, diff.param_ulps)
            result.state_ulps = max(result.state_ulps, diff.state_ulps)
            result.codes_differing = max(result.codes_differing, diff.codes_differing)
            result.codes = diff.codes
            if not diff.identical:
                if not diff.within(tolerance, 1 if tolerance.resync else index + 1):
                    result.status = "MISMATCH"
                    result.detail = diff.other or f"after step {index + 1}"
                    break
                result.status = "within tolerance"
            if tolerance.resync:
                _resync(opt, params, ref_opt, ref_params)
    except Exception as error:  # noqa: BLE001 - a case that raises is reported, and the others still run
        result.status = "error"
        result.detail = triton_guard.first_line(error)
    compile_failed = cand.name == "torch-compile" and str(device) in compile_guard.failures()
    if result.ok and (triton_guard.fallback_runs() > fallbacks or compile_failed):
        result.status = "fell back"
        result.detail = "a kernel failed to compile here: the eager PyTorch path ran instead (see the fallbacks)"
    return result


def cases(families: Sequence[registry.Family], dtypes: Sequence[str]) -> list[tuple[registry.Family, StateFormat, str]]:
    """Every (family, state format, dtype) to check: each state format the algorithm supports, in table order."""
    return [(family, fmt, dtype) for family in families for fmt in family.base._supported_formats()
            for dtype in dtypes]


def self_test(device: torch.device, cand: Candidate, families: Sequence[registry.Family] | None = None,
              dtypes: Sequence[str] = tuple(DTYPES), shapes: Sequence[tuple[int, ...]] = SHAPES,
              progress: Callable[[str], None] | None = None) -> list[CaseResult]:
    """Every case of ``families`` (default: all registered) x their state formats x ``dtypes`` on ``device``.

    Args:
        device: where the tensors live.
        cand: the path under test (:func:`candidate`).
        families: the algorithms (default None: every registered one).
        dtypes: parameter dtype names, keys of :data:`DTYPES` (default: all three).
        shapes: the parameters' shapes (default :data:`SHAPES`).
        progress: called with each case's name before it runs (default None).
    """
    results = []
    todo = cases(families or registry.families(), dtypes)
    for index, (family, fmt, dtype) in enumerate(todo, 1):
        if progress is not None:
            progress(f"{family.algorithm.name} {fmt.label} {dtype} ({index}/{len(todo)})")
        results.append(check(family, fmt, dtype, device, cand, shapes))
    return results


@dataclass
class Timing:
    name: str
    milliseconds: float | None
    ratio: float | None = None
    """Time of this step over torch's fused AdamW's."""
    note: str = ""


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(make: Callable[[list], torch.optim.Optimizer], device: torch.device, numel: int, repeats: int = 5,
              env: dict[str, str] | None = None) -> float:
    """Median milliseconds of one step on a ``numel``-element fp32 parameter (after two warm-up steps, which
    compile what the step needs)."""
    side = int(numel ** 0.5)
    shape = (side, numel // side) if side * (numel // side) == numel else (numel,)
    param = torch.nn.Parameter(torch.randn(shape, device=device))
    param.grad = torch.randn(shape, device=device)
    with environment(env or {}):
        optimizer = make([param])
        times = []
        for index in range(2 + repeats):
            _synchronize(device)
            start = time.perf_counter()
            optimizer.step()
            _synchronize(device)
            if index >= 2:
                times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def fused_adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def timings(device: torch.device, cand: Candidate, families: Sequence[registry.Family] | None = None,
            numel: int = TIMING_NUMEL, progress: Callable[[str], None] | None = None) -> list[Timing]:
    """torch's fused AdamW, then one step per algorithm (8-bit state, fp32 parameters) on ``cand``."""
    rows = []
    try:
        reference = time_step(fused_adamw, device, numel)
        rows.append(Timing("torch.optim.AdamW(fused=True)", reference, 1.0))
    except (RuntimeError, TypeError) as error:  # fused AdamW is not implemented for this device
        reference = None
        rows.append(Timing("torch.optim.AdamW(fused=True)", None, None, triton_guard.first_line(error)))
    for family in families or registry.families():
        fmt = next((f for f in family.base._supported_formats() if f.name == "blockwise8"), FP32)
        name = f"{family.base.__name__} {fmt.label}"
        if progress is not None:
            progress(f"timing {name}")
        kwargs = {"state_format": fmt.name, **CONSTRUCTOR.get(family.algorithm.name, {})}
        try:
            ms = time_step(lambda params, family=family, kwargs=kwargs: family.base(params, **kwargs), device, numel,
                           env=cand.env)
        except Exception as error:  # noqa: BLE001 - reported in its row
            rows.append(Timing(name, None, None, triton_guard.first_line(error)))
            continue
        rows.append(Timing(name, ms, ms / reference if reference else None))
    return rows


def as_dicts(items: Sequence) -> list[dict]:
    return [asdict(item) for item in items]
