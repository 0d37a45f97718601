"""Every 32-bit class equals an independent reference after 12 steps on random problems, for fp32 and bf16 params.

References: ``torch.optim.AdamW`` (and ``torch.optim.RMSprop``), ``transformers.optimization.Adafactor``, plain
per-tensor implementations of the spec formulas (``/work/shared/spec/optimizers.md`` section 2) written below for
AdEMAMix, LAMB, Lion and RMSprop, and bitsandbytes' CPU 32-bit classes where their math is the same.

Mixed precision contract: hf_optim keeps fp32 state, loads ``p`` and ``g`` from bf16, computes in fp32 and rounds
``p`` back to bf16 after every step. Every reference here runs that same contract (an fp32 master copy rounded to
bf16 after each step, or fp32 math on the bf16 tensor), so bf16 results agree to about one bf16 ulp.
"""

from __future__ import annotations

import math
import warnings

import bitsandbytes as bnb
import pytest
import torch
from transformers.optimization import Adafactor as TransformersAdafactor

import hf_optim

SHAPES = ((64, 48), (130,), (3, 5, 7))
"""A matrix (3072 elements), a vector not a multiple of 256, and a 3-D tensor (105 elements)."""
GRAD_SCALES = (1.0, 0.05, 3.0)
STEPS = 12
DTYPES = [torch.float32, torch.bfloat16]

# Tolerances. Measured on x86 CPU after 12 steps: fp32 results differ from torch / transformers / the references
# below by at most 2.4e-7 absolute (1-2 fp32 ulps, rounding order only; at most 0.32 of FP32_TOL's allowance,
# many cases are bit-exact), and from bitsandbytes by at most 4.8e-7 (0.05 of BNB_FP32_TOL's). bf16 results were
# bit-identical in every case; one bf16 ulp is allowed for elements where an fp32 rounding difference tips the
# bf16 rounding (another CPU's vectorization can do that).
FP32_TOL = dict(rtol=1e-6, atol=1e-7)
BF16_TOL = dict(rtol=2**-7, atol=1e-6)  # rtol 2**-7 is between one and two bf16 ulps of the value
BNB_FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # bnb reorders the arithmetic (eps * sqrt(bc2), step-size folding)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One intra-op thread: on tiny tensors OpenMP hand-offs cost milliseconds per op on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tolerance(dtype: torch.dtype, fp32: dict = FP32_TOL) -> dict:
    return fp32 if dtype == torch.float32 else BF16_TOL


# --------------------------------------------------------------------------------------------------------------
# Problem driver
def initial_values(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def gradient(step: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 * step + index)
    return (torch.randn(SHAPES[index], generator=gen) * GRAD_SCALES[index]).to(dtype)


def param_groups(params: list, group2: dict | None) -> list[dict]:
    """One group, or two: the last parameter in a second group with ``group2``'s hyperparameters."""
    if group2 is None:
        return [{"params": params}]
    return [{"params": params[:-1]}, {"params": params[-1:], **group2}]


def run(factory, dtype: torch.dtype, group2: dict | None = None, *, steps: int = STEPS):
    """Run ``factory(param_groups)`` for ``steps`` steps on parameters of ``dtype``; return the final values."""
    params = [torch.nn.Parameter(v.clone()) for v in initial_values(dtype)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "hf_optim: paged optimizers", UserWarning)  # Paged* on CPU are unpaged
        optimizer = factory(param_groups(params, group2))
        for step in range(1, steps + 1):
            for index, p in enumerate(params):
                p.grad = gradient(step, index, dtype)
            optimizer.step()
    return [p.detach().clone() for p in params]


def run_fp32_master(factory, dtype: torch.dtype, group2: dict | None = None, *, steps: int = STEPS):
    """Run a torch optimizer on fp32 copies, rounding them to ``dtype`` after every step (fp32 state)."""
    params = [torch.nn.Parameter(v.float()) for v in initial_values(dtype)]
    optimizer = factory(param_groups(params, group2))
    for step in range(1, steps + 1):
        for index, p in enumerate(params):
            p.grad = gradient(step, index, dtype).float()
        optimizer.step()
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(dtype).float())
    return [p.detach().to(dtype) for p in params]


def max_diffs(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> tuple[float, float]:
    """Largest absolute and relative difference over all parameters (for failure messages)."""
    abs_diff = max((a.double() - e.double()).abs().max().item() for a, e in zip(actual, expected))
    rel_diff = max(
        ((a.double() - e.double()).abs() / e.double().abs().clamp(min=1e-30)).max().item()
        for a, e in zip(actual, expected)
    )
    return abs_diff, rel_diff


def assert_results_close(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: dict) -> None:
    """Parameter-wise ``assert_close``, and the problem is not vacuous: the parameters moved."""
    initial = initial_values(actual[0].dtype)
    assert any(not torch.equal(a, i) for a, i in zip(actual, initial)), "the parameters never moved"
    abs_diff, rel_diff = max_diffs(actual, expected)
    for index, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(
            a, e, **tol, msg=lambda m, i=index: f"param {i}: {m}\n(max abs {abs_diff:.3g}, max rel {rel_diff:.3g})"
        )


def assert_results_differ(actual: list[torch.Tensor], wrong: list[torch.Tensor], tol: dict) -> None:
    """Some element differs by more than 10x the tolerance used for the real comparison."""
    ratio = max(
        ((a.double() - w.double()).abs() / (tol["atol"] + tol["rtol"] * w.double().abs())).max().item()
        for a, w in zip(actual, wrong)
    )
    assert ratio > 10, f"the wrong variant is within {ratio:.2f}x of the tolerance: the comparison is too weak"


# --------------------------------------------------------------------------------------------------------------
# Straightforward references, written from the spec (fp32 state, fp32 math, one tensor at a time)
class Reference(torch.optim.Optimizer):
    """Per-tensor loop: ``p`` and ``g`` loaded as fp32; ``update`` returns the new fp32 ``p``, stored in p's dtype."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["t"] = state.get("t", 0) + 1
                p.copy_(self.update(p.float(), p.grad.float(), state, group, state["t"]))

    def update(self, p, g, state, group, t):  # pragma: no cover - abstract
        raise NotImplementedError


def zeros_state(state: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    if key not in state:
        state[key] = torch.zeros_like(like, dtype=torch.float32)
    return state[key]


class ReferenceAdEMAMix(Reference):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None,
                 eps=1e-8, weight_decay=1e-2, bias_corrected_m2=False):
        defaults = dict(lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
                        weight_decay=weight_decay, bias_corrected_m2=bias_corrected_m2)
        super().__init__(params, defaults)

    def update(self, p, g, state, group, t):
        lr, (b1, b2, b3), alpha = group["lr"], group["betas"], group["alpha"]
        if group["t_alpha"]:
            alpha = alpha * min(1.0, t / group["t_alpha"])
        if group["t_beta3"]:
            s = t / group["t_beta3"]
            b3 = min(math.exp(math.log(b1) * math.log(b3) / ((1 - s) * math.log(b3) + s * math.log(b1))), b3)
        m1, m2, nu = (zeros_state(state, key, p) for key in ("m1", "m2", "nu"))
        m1 = state["m1"] = b1 * m1 + (1 - b1) * g
        m2 = state["m2"] = b3 * m2 + (1 - b3) * g
        nu = state["nu"] = b2 * nu + (1 - b2) * g * g
        slow = m2 / (1 - b3**t) if group["bias_corrected_m2"] else m2  # the wrong variant corrects m2
        p = p * (1 - lr * group["weight_decay"])
        return p - lr * (m1 / (1 - b1**t) + alpha * slow) / (nu.sqrt() / math.sqrt(1 - b2**t) + group["eps"])


class ReferenceLAMB(Reference):
    """apex FusedLAMB; counts in ``clamped`` how often ``max_trust_ratio`` bound. ``max_unorm``: bitsandbytes'
    update-norm clip as its CUDA kernel computes it (kPreconditionOptimizer32bit2State: the norm of the
    bias-corrected direction, ``||ratio * u|| <= max_unorm * ||p||``), applied where ``||p|| > 0``; counted in
    ``unorm_clipped``."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 adam_w_mode=True, use_nvlamb=False, max_trust_ratio=None, max_unorm=0.0):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb, max_trust_ratio=max_trust_ratio,
                        max_unorm=max_unorm)
        super().__init__(params, defaults)
        self.clamped = 0
        self.unorm_clipped = 0

    def update(self, p, g, state, group, t):
        (b1, b2), wd = group["betas"], group["weight_decay"]
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
        if not group["adam_w_mode"]:
            g = g + wd * p
        m, v = zeros_state(state, "m", p), zeros_state(state, "v", p)
        m = state["m"] = b1 * m + (1 - b1) * g
        v = state["v"] = b2 * v + (1 - b2) * g * g
        u = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
        if group["adam_w_mode"]:
            u = u + wd * p
        w_norm, u_norm = p.norm().item(), u.norm().item()
        ratio = 1.0
        if (wd != 0 or group["use_nvlamb"]) and w_norm > 0 and u_norm > 0:
            ratio = w_norm / u_norm
            if group["max_trust_ratio"] is not None and ratio > group["max_trust_ratio"]:
                ratio = group["max_trust_ratio"]
                self.clamped += 1
        if group["max_unorm"] > 0 and w_norm > 0 and u_norm > 0 and ratio > w_norm / u_norm * group["max_unorm"]:
            ratio = w_norm / u_norm * group["max_unorm"]
            self.unorm_clipped += 1
        return p - group["lr"] * ratio * u


class ReferenceLion(Reference):
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, momentum_first=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, momentum_first=momentum_first))

    def update(self, p, g, state, group, t):
        lr, (b1, b2) = group["lr"], group["betas"]
        m = zeros_state(state, "m", p)
        if group["momentum_first"]:  # the wrong variant: the EMA is updated before the sign is taken
            m = state["m"] = b2 * m + (1 - b2) * g
        p = p * (1 - lr * group["weight_decay"])
        p = p - lr * torch.sign(b1 * m + (1 - b1) * g)
        if not group["momentum_first"]:
            state["m"] = b2 * m + (1 - b2) * g
        return p


class ReferenceRMSprop(Reference):
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, decoupled=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, decoupled=decoupled))

    def update(self, p, g, state, group, t):
        lr, a, wd = group["lr"], group["alpha"], group["weight_decay"]
        if group["decoupled"]:  # the wrong variant: AdamW-style decay instead of bitsandbytes' L2
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        v = state["v"] = a * zeros_state(state, "v", p) + (1 - a) * g * g
        return p - lr * g / (v.sqrt() + group["eps"])


# --------------------------------------------------------------------------------------------------------------
# Option sets: (id, constructor kwargs, second param group's overrides or None)
ADAMW_CASES = [
    ("defaults", {}, None),
    ("betas-eps-wd", dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1), None),
    ("beta1-zero", dict(lr=1e-2, betas=(0.0, 0.99), weight_decay=0.0), None),
    ("two-groups", dict(lr=3e-2, weight_decay=0.0), dict(lr=5e-3, betas=(0.5, 0.9), weight_decay=0.3)),
]
ADEMAMIX_CASES = [
    ("defaults", {}, None),
    ("alpha-betas-wd", dict(lr=1e-2, alpha=2.0, betas=(0.8, 0.99, 0.999), weight_decay=0.1), None),
    ("warmup", dict(lr=1e-2, t_alpha=5, t_beta3=5), None),
    ("warmup-two-groups", dict(lr=1e-2, t_alpha=8), dict(alpha=8.0, t_beta3=4, weight_decay=0.0)),
]
LAMB_CLAMP = dict(lr=1e-2, weight_decay=0.05, max_trust_ratio=1.2)
"""Binds in 33 of the 36 (step, tensor) updates: see test_lamb_max_trust_ratio_binds."""
LAMB_BNB = dict(lr=1e-2, eps=1e-8, weight_decay=0.0, max_unorm=1.0)
"""bitsandbytes' LAMB (Adam with its update-norm clip at its default 1.0): see test_lamb_max_unorm_binds."""
LAMB_UNORM_WITH_RATIO = dict(lr=1e-2, weight_decay=0.05, max_unorm=0.5)
"""A clip below 1 caps the trust ratio itself at every update."""
LAMB_CASES = [
    ("defaults", {}, None),
    ("bitsandbytes-lamb", LAMB_BNB, None),
    ("max-unorm-with-trust-ratio", LAMB_UNORM_WITH_RATIO, None),
    ("wd", dict(lr=1e-2, weight_decay=0.1), None),
    ("no-wd", dict(lr=1e-2, weight_decay=0.0), None),
    ("no-wd-nvlamb", dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True), None),
    ("max-trust-ratio", LAMB_CLAMP, None),
    ("l2-mode", dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False), None),
    (
        "no-bias-correction-two-groups",
        dict(lr=1e-2, weight_decay=0.1, bias_correction=False, betas=(0.8, 0.99), eps=1e-8),
        dict(lr=3e-3, weight_decay=0.0),
    ),
]
LION_CASES = [
    ("defaults", {}, None),
    ("wd", dict(lr=1e-3, weight_decay=0.1), None),
    ("two-groups", dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.5), dict(lr=1e-3, weight_decay=0.0)),
]
RMSPROP_CASES = [
    ("defaults", {}, None),
    ("alpha-wd", dict(lr=1e-3, alpha=0.9, weight_decay=0.1), None),
    ("two-groups", dict(lr=5e-3, alpha=0.5, eps=1e-6), dict(alpha=0.95, weight_decay=0.2)),
]
ADAFACTOR_CASES = [
    ("defaults", {}, None),
    ("warmup-init", dict(warmup_init=True), None),
    ("trainer", dict(lr=1e-3, relative_step=False, scale_parameter=False), None),
    ("beta1", dict(beta1=0.9), None),
    ("weight-decay", dict(weight_decay=0.1), None),
    ("clip-threshold", dict(clip_threshold=0.5), None),
    (
        "everything-two-groups",
        dict(lr=1e-2, relative_step=False, beta1=0.9, weight_decay=0.1, clip_threshold=0.5),
        dict(lr=3e-3, weight_decay=0.0, decay_rate=-0.5, beta1=None),
    ),
]


def cases(table):
    return [pytest.param(kwargs, group2, id=name) for name, kwargs, group2 in table]


def classes(*names):
    return pytest.mark.parametrize("cls", [getattr(hf_optim, n) for n in names], ids=list(names))


dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])


# --------------------------------------------------------------------------------------------------------------
# AdamW
@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(ADAMW_CASES))
@classes("AdamW", "AdamW32bit", "PagedAdamW32bit")
def test_adamw_matches_torch(cls, kwargs, group2, dtype):
    """AdamW equals torch.optim.AdamW (single-tensor) on an fp32 master copy rounded to the param dtype."""
    ours = run(lambda groups: cls(groups, **kwargs), dtype, group2)
    reference = run_fp32_master(lambda groups: torch.optim.AdamW(groups, foreach=False, **kwargs), dtype, group2)
    assert_results_close(ours, reference, tolerance(dtype))


@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(ADAMW_CASES))
def test_adamw_matches_bitsandbytes(kwargs, group2, dtype):
    """AdamW32bit equals bitsandbytes' CPU AdamW32bit (the same math, arithmetic in another order)."""
    ours = run(lambda groups: hf_optim.AdamW32bit(groups, **kwargs), dtype, group2)
    theirs = run(lambda groups: bnb.optim.AdamW32bit(groups, **kwargs), dtype, group2)
    assert_results_close(ours, theirs, tolerance(dtype, BNB_FP32_TOL))


@dtypes
def test_adamw_is_not_adam_with_l2(dtype):
    """Coupled L2 weight decay (torch.optim.Adam) gives a clearly different result: the comparison has teeth."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    ours = run(lambda groups: hf_optim.AdamW(groups, **kwargs), dtype)
    wrong = run_fp32_master(lambda groups: torch.optim.Adam(groups, foreach=False, **kwargs), dtype)
    assert_results_differ(ours, wrong, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# AdEMAMix
@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(ADEMAMIX_CASES))
@classes("AdEMAMix", "AdEMAMix32bit", "PagedAdEMAMix32bit")
def test_ademamix_matches_reference(cls, kwargs, group2, dtype):
    """AdEMAMix (alpha and beta3 warm-ups included) equals the spec formulas."""
    ours = run(lambda groups: cls(groups, **kwargs), dtype, group2)
    reference = run(lambda groups: ReferenceAdEMAMix(groups, **kwargs), dtype, group2)
    assert_results_close(ours, reference, tolerance(dtype))


@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(ADEMAMIX_CASES))
def test_ademamix_matches_bitsandbytes(kwargs, group2, dtype):
    """AdEMAMix32bit equals bitsandbytes' 32-bit AdEMAMix on CPU, whose warm-up schedules are the same formulas.

    bitsandbytes 0.50's ``AdEMAMix32bit`` class derives from ``Optimizer2State`` instead of ``AdEMAMix``: it
    allocates a single-row state1 and crashes on CPU, so the reference is ``AdEMAMix(optim_bits=32)``, which is
    what transformers' ``optim="ademamix"`` builds.
    """
    ours = run(lambda groups: hf_optim.AdEMAMix32bit(groups, **kwargs), dtype, group2)
    theirs = run(lambda groups: bnb.optim.AdEMAMix(groups, optim_bits=32, **kwargs), dtype, group2)
    assert_results_close(ours, theirs, tolerance(dtype, BNB_FP32_TOL))


@dtypes
@pytest.mark.parametrize(
    "wrong_kwargs",
    [dict(t_alpha=None, t_beta3=None), dict(bias_corrected_m2=True), dict(alpha=0.0)],
    ids=["without-warmup", "bias-corrected-m2", "alpha-zero"],
)
def test_ademamix_wrong_variants_differ(wrong_kwargs, dtype):
    """Dropping the warm-ups, bias-correcting m2 or dropping the slow EMA each change the result."""
    kwargs = dict(lr=1e-2, t_alpha=5, t_beta3=5)
    ours = run(lambda groups: hf_optim.AdEMAMix32bit(groups, **kwargs), dtype)
    wrong = run(lambda groups: ReferenceAdEMAMix(groups, **{**kwargs, **wrong_kwargs}), dtype)
    assert_results_differ(ours, wrong, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# LAMB. apex's formulas; bitsandbytes' LAMB32bit (Adam with an update-norm clip, no trust ratio) is the
# "bitsandbytes-lamb" case, written from its CUDA kernel (its CPU backend clips on the norm before bias correction).
@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(LAMB_CASES))
@classes("LAMB", "LAMB32bit", "PagedLAMB32bit")
def test_lamb_matches_reference(cls, kwargs, group2, dtype):
    """LAMB equals apex FusedLAMB's formulas: whole-tensor trust ratio, use_nvlamb, clamp, L2 mode, no bias fix."""
    ours = run(lambda groups: cls(groups, **kwargs), dtype, group2)
    reference = run(lambda groups: ReferenceLAMB(groups, **kwargs), dtype, group2)
    assert_results_close(ours, reference, tolerance(dtype))


@dtypes
def test_lamb_max_trust_ratio_binds(dtype):
    """The max_trust_ratio case really clamps (so its comparison covers the clamp) and changes the result."""
    kwargs = LAMB_CLAMP
    optimizers = []

    def make(groups):
        optimizers.append(ReferenceLAMB(groups, **kwargs))
        return optimizers[-1]

    clamped = run(make, dtype)
    total = STEPS * len(SHAPES)
    assert 0 < optimizers[0].clamped < total, f"clamp bound {optimizers[0].clamped} of {total} times"
    unclamped = run(lambda groups: ReferenceLAMB(groups, **{**kwargs, "max_trust_ratio": None}), dtype)
    assert_results_differ(clamped, unclamped, tolerance(dtype))


@pytest.mark.parametrize("kwargs, binds", [(LAMB_BNB, "some"), (LAMB_UNORM_WITH_RATIO, "all"),
                                           ({**LAMB_UNORM_WITH_RATIO, "max_unorm": 1.0}, "none")],
                         ids=["bitsandbytes-lamb", "below-one", "one-with-trust-ratio"])
def test_lamb_max_unorm_binds(kwargs, binds):
    """The max_unorm cases really clip (so their comparisons cover it) and change the result; at 1.0 the clip never
    binds where the trust ratio applies, and leaves the result bit for bit."""
    optimizers = []

    def make(groups):
        optimizers.append(ReferenceLAMB(groups, **kwargs))
        return optimizers[-1]

    clipped = run(make, torch.float32)
    total = STEPS * len(SHAPES)
    count = optimizers[0].unorm_clipped
    assert {"some": 0 < count < total, "all": count == total, "none": count == 0}[binds], (count, total)
    ours = run(lambda groups: hf_optim.LAMB32bit(groups, **kwargs), torch.float32)
    off = run(lambda groups: hf_optim.LAMB32bit(groups, **{**kwargs, "max_unorm": 0.0}), torch.float32)
    if binds == "none":
        assert all(torch.equal(a, b) for a, b in zip(ours, off))
    else:
        assert_results_differ(clipped, off, FP32_TOL)


def test_lamb_max_unorm_moves_a_zero_tensor_where_bitsandbytes_keeps_it_at_zero():
    """The documented difference: bitsandbytes' clip scales a zero-norm tensor's update to 0 (its bound is
    ``max_unorm * ||p|| = 0``), so LoRA's B, which starts at zero, never moves; hf_optim clips only where
    ``||p|| > 0``."""
    import bitsandbytes.optim

    results = {}
    for name, cls in [("bitsandbytes", bitsandbytes.optim.LAMB), ("hf_optim", hf_optim.LAMB)]:
        zero = torch.nn.Parameter(torch.zeros(16, 8))
        optimizer = cls([zero], lr=1e-2, eps=1e-8, weight_decay=0.0, max_unorm=1.0)
        for step in range(3):
            zero.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        results[name] = zero.detach().norm().item()
    assert results["bitsandbytes"] == 0.0 and results["hf_optim"] > 0.0


@dtypes
def test_lamb_trust_ratio_changes_the_result(dtype):
    """Without weight decay (and no nvlamb) LAMB is exactly Adam; with it the trust ratio makes it differ from AdamW."""
    no_ratio = run(lambda groups: hf_optim.LAMB32bit(groups, lr=1e-2, weight_decay=0.0), dtype)
    adam = run_fp32_master(lambda groups: torch.optim.Adam(groups, foreach=False, lr=1e-2, eps=1e-6), dtype)
    assert_results_close(no_ratio, adam, tolerance(dtype))
    # With the ratio fixed at 1, LAMB's decoupled decay would be AdamW's up to an O(lr^2 * wd) term.
    ours = run(lambda groups: hf_optim.LAMB32bit(groups, lr=1e-2, weight_decay=0.1), dtype)
    adamw = run_fp32_master(
        lambda groups: torch.optim.AdamW(groups, foreach=False, lr=1e-2, weight_decay=0.1, eps=1e-6), dtype
    )
    assert_results_differ(ours, adamw, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# Lion
@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(LION_CASES))
@classes("Lion", "Lion32bit", "PagedLion32bit")
def test_lion_matches_reference(cls, kwargs, group2, dtype):
    """Lion (decoupled weight decay, sign of the interpolation, EMA after the step) equals the spec."""
    ours = run(lambda groups: cls(groups, **kwargs), dtype, group2)
    reference = run(lambda groups: ReferenceLion(groups, **kwargs), dtype, group2)
    assert_results_close(ours, reference, tolerance(dtype))


@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(LION_CASES))
def test_lion_matches_bitsandbytes(kwargs, group2, dtype):
    """Lion32bit equals bitsandbytes' CPU Lion32bit."""
    ours = run(lambda groups: hf_optim.Lion32bit(groups, **kwargs), dtype, group2)
    theirs = run(lambda groups: bnb.optim.Lion32bit(groups, **kwargs), dtype, group2)
    assert_results_close(ours, theirs, tolerance(dtype, BNB_FP32_TOL))


@dtypes
def test_lion_momentum_order_matters(dtype):
    """Updating the EMA before taking the sign (a classic Lion bug) gives a clearly different result."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    ours = run(lambda groups: hf_optim.Lion32bit(groups, **kwargs), dtype)
    wrong = run(lambda groups: ReferenceLion(groups, momentum_first=True, **kwargs), dtype)
    assert_results_differ(ours, wrong, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# RMSprop
def bnb_rmsprop_group(group2: dict | None) -> dict | None:
    """bitsandbytes stores RMSprop's alpha as ``betas[0]`` in its param groups."""
    if group2 is None or "alpha" not in group2:
        return group2
    rest = {k: v for k, v in group2.items() if k != "alpha"}
    return {**rest, "betas": (group2["alpha"], 0.0)}


@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(RMSPROP_CASES))
@classes("RMSprop", "RMSprop32bit")
def test_rmsprop_matches_reference(cls, kwargs, group2, dtype):
    """RMSprop (L2 weight decay in the gradient, eps outside the sqrt) equals the spec and torch.optim.RMSprop."""
    ours = run(lambda groups: cls(groups, **kwargs), dtype, group2)
    reference = run(lambda groups: ReferenceRMSprop(groups, **kwargs), dtype, group2)
    assert_results_close(ours, reference, tolerance(dtype))
    torch_rmsprop = run_fp32_master(lambda groups: torch.optim.RMSprop(groups, foreach=False, **kwargs), dtype, group2)
    assert_results_close(ours, torch_rmsprop, tolerance(dtype))


@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(RMSPROP_CASES))
def test_rmsprop_matches_bitsandbytes(kwargs, group2, dtype):
    """RMSprop32bit equals bitsandbytes' CPU RMSprop32bit."""
    ours = run(lambda groups: hf_optim.RMSprop32bit(groups, **kwargs), dtype, group2)
    theirs = run(lambda groups: bnb.optim.RMSprop32bit(groups, **kwargs), dtype, bnb_rmsprop_group(group2))
    assert_results_close(ours, theirs, tolerance(dtype, BNB_FP32_TOL))


@dtypes
def test_rmsprop_weight_decay_is_l2(dtype):
    """Decoupled (AdamW-style) decay gives a clearly different result than the L2 decay RMSprop uses."""
    kwargs = dict(lr=1e-2, alpha=0.9, weight_decay=0.5)
    ours = run(lambda groups: hf_optim.RMSprop32bit(groups, **kwargs), dtype)
    wrong = run(lambda groups: ReferenceRMSprop(groups, decoupled=True, **kwargs), dtype)
    assert_results_differ(ours, wrong, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# Adafactor
@dtypes
@pytest.mark.parametrize("kwargs, group2", cases(ADAFACTOR_CASES))
def test_adafactor_matches_transformers(kwargs, group2, dtype):
    """Adafactor equals transformers' Adafactor (factored 2-D and 3-D, unfactored 1-D; every option)."""
    ours = run(lambda groups: hf_optim.Adafactor(groups, **kwargs), dtype, group2)
    theirs = run(lambda groups: TransformersAdafactor(groups, **kwargs), dtype, group2)
    assert_results_close(ours, theirs, tolerance(dtype))


@dtypes
@pytest.mark.parametrize(
    "kwargs, wrong_kwargs",
    [
        (dict(clip_threshold=0.5), dict(clip_threshold=1.0)),
        (dict(warmup_init=True), {}),
        (dict(beta1=0.9), {}),
        (dict(weight_decay=0.1), {}),
        (dict(lr=1e-3, relative_step=False, scale_parameter=False), dict(lr=1e-3, relative_step=False)),
    ],
    ids=["clip-binds", "warmup-init", "beta1", "weight-decay", "scale-parameter"],
)
def test_adafactor_options_change_the_result(kwargs, wrong_kwargs, dtype):
    """Each option tested above changes transformers' result, so its comparison is not vacuous."""
    ours = run(lambda groups: hf_optim.Adafactor(groups, **kwargs), dtype)
    wrong = run(lambda groups: TransformersAdafactor(groups, **wrong_kwargs), dtype)
    assert_results_differ(ours, wrong, tolerance(dtype))


# --------------------------------------------------------------------------------------------------------------
# State precision
@pytest.mark.parametrize(
    "cls", [hf_optim.AdamW32bit, hf_optim.AdEMAMix32bit, hf_optim.LAMB32bit, hf_optim.Lion32bit, hf_optim.RMSprop32bit]
)
def test_32bit_state_is_fp32_for_bf16_params(cls):
    """bf16 parameters get fp32 state (the mixed-precision contract every bf16 reference above assumes)."""
    params = [torch.nn.Parameter(v) for v in initial_values(torch.bfloat16)]
    optimizer = cls(params)
    for index, p in enumerate(params):
        p.grad = gradient(1, index, torch.bfloat16)
    optimizer.step()
    for p in params:
        slots = {k: v for k, v in optimizer.state[p].items() if k.startswith("state")}
        assert slots and all(v.dtype == torch.float32 for v in slots.values()), {k: v.dtype for k, v in slots.items()}
        assert p.dtype == torch.bfloat16
