"""``hf-optim validate RECIPE --fit 24GiB``: which setups of a full fine-tune fit one card, with the largest batch.

The search covers optimizer state precision (the recipe's algorithm in every state format hf_optim has a name
for, and torch's ``adamw_torch`` as the baseline), paging, gradient release and gradient checkpointing. Each
setup's peak is the larger of two moments:

* backward: weights + optimizer state on the GPU + activations and gradients at their joint peak
  (:func:`hf_optim.recipes.activations.backward_peak_bytes`, an estimate calibrated on the tiny model);
* the optimizer step: weights + state + all gradients (kept) + the step's temporaries (torch's foreach AdamW makes
  one parameter-sized temporary; hf_optim's fused kernels update in place).

Assumptions, printed with the table: a fixed reserve for the CUDA context and cuBLAS workspaces
(:data:`CUDA_CONTEXT_BYTES`) plus a share of the card for allocator fragmentation (:data:`FRAGMENTATION_SHARE`);
paged state counts as not on the GPU (it moves to host memory when the GPU is short, which slows steps); with
gradient release, each gradient is freed once its parameter has stepped, so at most one or two embedding-sized
gradients are alive (:meth:`~hf_optim.recipes.activations.DecoderShape.released_gradient_bytes`, instead of 2 bytes
per parameter in bf16), and release rules out gradient accumulation and global-norm clipping. Release lowers the
peaks after backward has made its first gradients and at the step; the loss head's, before any gradient exists, it
leaves as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hf_optim.errors import UserValueError
from hf_optim.formats import StateFormat
from hf_optim.formats.base import TORCH_STATE_RANK
from hf_optim.integrations.names import OPTIMIZER_NAMES
from hf_optim.recipes.activations import DecoderShape, backward_peak_bytes
from hf_optim.recipes.estimate import TORCH_STATE_COUNT, MemoryEstimate, estimate, state_bytes
from hf_optim.recipes.schema import Recipe

CUDA_CONTEXT_BYTES = 2**30
"""CUDA context, cuBLAS/cuDNN workspaces and kernels loaded on the card, outside torch's allocator (~0.5-1 GiB)."""
FRAGMENTATION_SHARE = 0.05
"""Part of the card kept free for the caching allocator's fragmentation."""
MAX_BATCH = 1 << 16
TORCH_BASELINE = "adamw_torch"
TORCH_STATE, TORCH_RANK = "bf16 (torch)", TORCH_STATE_RANK
"""torch's AdamW state with bf16 weights, as the planner labels and ranks it: after fp32 state (rank 0), before
the quantized formats (their ``rank``: exact state first, then the smaller ones)."""

_UNITS = {"": None, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 2**30, "gb": 10**9,
          "t": 2**40, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
FIT_EXAMPLES = "24GiB (a 24 GB card: RTX 4090, L4, A10G), 80GiB (A100/H100 80GB), 80G, 40GB, 24000MB, 22.5GiB"


def parse_memory(text: str) -> int:
    """Bytes in a memory size: ``24GiB``/``24G`` (binary, 2**30), ``24GB`` (decimal, 10**9), ``24000MB``,
    ``512MiB``. A bare ``G``/``T`` is binary, as GPU memory is (a "24 GB" card has 24 GiB); a number without a
    unit is refused, since it could mean either."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS or _UNITS[unit] is None or float(match.group(1)) <= 0:
        why = "no unit" if match and unit == "" else "not a memory size"
        raise UserValueError(f"--fit {text!r}: {why}; write a positive size with a unit, e.g. {FIT_EXAMPLES}")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Setup:
    """One combination the planner tries."""

    optim: str
    state: str  # the state format's label ("8-bit blockwise"; "bf16 (torch)": torch's AdamW with bf16 weights)
    rank: int  # the state's place in the planner's preference (the format's rank; torch's bf16 state between)
    paged: bool
    release: bool
    checkpointing: bool

    def label(self) -> str:
        parts = [self.optim, "release" if self.release else "grads kept", "ckpt" if self.checkpointing else "no ckpt"]
        return ", ".join(parts)


@dataclass
class SetupFit:
    """A setup's memory: parts on the GPU (bytes), its largest batch (0: not even one sequence fits)."""

    setup: Setup
    state_bytes: int
    state_on_gpu: int
    gradient_bytes: int  # kept: all of them; released: the ones alive at once
    step_bytes: int  # peak at the optimizer step
    batch_bytes: dict[int, int]  # peak at the batch sizes asked about
    max_batch: int
    bytes_per_param: float  # weights + gradients + state (paged included), per model parameter

    @property
    def fits(self) -> bool:
        return self.max_batch > 0


@dataclass
class FitPlan:
    """The planner's answer for a recipe on a card."""

    estimate: MemoryEstimate
    card_bytes: int
    usable_bytes: int
    seq_len: int
    recipe_batch: int
    fits: list[SetupFit]
    misfits: list[SetupFit]
    assumptions: list[str] = field(default_factory=list)


def family_names(optim: str) -> dict[tuple[StateFormat, bool], str]:
    """hf_optim names of ``optim``'s algorithm by (state format, paged), in the formats' table order; adamw for
    torch's and unknown names."""
    entry = OPTIMIZER_NAMES.get(optim)
    family = entry.family if entry is not None else "adamw"
    found: dict[tuple[StateFormat, bool], list[str]] = {}
    for name, other in OPTIMIZER_NAMES.items():
        if other.family == family:
            found.setdefault((other.state_format, other.paged), []).append(name)
    # the canonical name: "<paged_><family>_<suffix>" when it exists (adamw_8bit rather than adamw_bnb_8bit)
    chosen = {}
    for (fmt, paged), names in found.items():
        canonical = f"{'paged_' if paged else ''}{family}_{fmt.optim_suffix}"
        chosen[(fmt, paged)] = canonical if canonical in names else min(names, key=len)
    return dict(sorted(chosen.items(), key=lambda item: (item[0][0].rank, item[0][1])))


def setups(optim: str) -> list[Setup]:
    """Every combination the planner tries for a recipe whose optimizer is ``optim``."""
    found = [Setup(TORCH_BASELINE, TORCH_STATE, TORCH_RANK, False, False, ckpt)
             for ckpt in (False, True)]  # torch: no release
    for (fmt, paged), name in family_names(optim).items():
        found += [Setup(name, fmt.label, fmt.rank, paged, release, ckpt)
                  for release in (False, True) for ckpt in (False, True)]
    return found


def _peak(est: MemoryEstimate, shape: DecoderShape, setup: Setup, state_gpu: int, step: int, tokens: int) -> int:
    backward = est.weights_bytes + state_gpu + backward_peak_bytes(shape, tokens, setup.checkpointing, setup.release)
    return max(backward, step)


def plan(recipe: Recipe, card_bytes: int, batches: tuple[int, ...] = ()) -> FitPlan:
    """Fit every setup of ``recipe`` (a full fine-tune) on a card of ``card_bytes``; ``batches``: batch sizes to
    report the peak for besides the recipe's own."""
    if recipe.method != "full":
        raise ValueError(f"--fit plans full fine-tunes; this recipe is {recipe.method} (its trainable part is small: "
                         "hf-optim validate without --fit gives its memory)")
    est = estimate(recipe)
    element = max(t.element_size for t in est.tensors)
    shape = DecoderShape.from_config(est.config, element)
    seq_len = int(recipe.training.get("max_length") or recipe.training.get("max_seq_length") or 1024)
    recipe_batch = int(recipe.training.get("per_device_train_batch_size") or 8)
    usable = int(card_bytes * (1 - FRAGMENTATION_SHARE)) - CUDA_CONTEXT_BYTES
    released_grads = shape.released_gradient_bytes()
    results = []
    for setup in setups(recipe.optim):
        state = state_bytes(setup.optim, est.tensors, recipe.training.get("optim_args"))
        state_gpu = 0 if setup.paged else state
        gradients = released_grads if setup.release else est.gradient_bytes
        foreach_temporary = est.gradient_bytes if setup.optim in TORCH_STATE_COUNT else 0
        step = est.weights_bytes + state_gpu + (0 if setup.release else est.gradient_bytes) + foreach_temporary
        def peak(batch: int, setup=setup, state_gpu=state_gpu, step=step) -> int:
            return _peak(est, shape, setup, state_gpu, step, batch * seq_len)

        peaks = {b: peak(b) for b in sorted({1, recipe_batch, *batches})}
        max_batch = _largest_batch(lambda b: peak(b) <= usable)
        per_param = (est.weights_bytes + gradients + state) / est.total_params
        results.append(SetupFit(setup, state, state_gpu, gradients, step, peaks, max_batch, per_param))
    fits = sorted((r for r in results if r.fits), key=lambda r: _rank(r, recipe_batch))
    misfits = sorted((r for r in results if not r.fits), key=lambda r: r.batch_bytes[min(r.batch_bytes)])
    assumptions = [
        f"reserve: {CUDA_CONTEXT_BYTES / 2**30:.0f} GiB for the CUDA context and workspaces + "
        f"{FRAGMENTATION_SHARE:.0%} of the card for allocator fragmentation: {usable / 2**30:.2f} GiB usable",
        f"activations: an ESTIMATE for a Llama-shaped model in {_dtype_name(element)} with SDPA/flash attention, "
        f"unpadded sequences of {seq_len} tokens (training.max_length), calibrated on CPU against the tiny model "
        "(hf_optim/recipes/activations.py)",
        "gradients kept: one per parameter in the weights' dtype; released: freed once their parameter has stepped "
        f"(at most {released_grads / 2**30:.2f} GiB alive at once: {_released_what(shape)}), which lowers the "
        "peaks from the first gradient on, not the loss head's before it; release rules out gradient accumulation "
        "and global-norm clipping",
        "paged state counts as not on the GPU: it moves to host memory when the GPU is short (slower steps)",
        "adamw_torch (torch's foreach AdamW) keeps its two states in the weights' dtype and makes one "
        "parameter-sized temporary at the step; hf_optim's kernels update in place",
        "ranked by fewest compromises: reaches the recipe's batch, unpaged, gradients kept, no checkpointing, "
        "higher-precision state (paged: smaller state, less to move), then larger batch",
    ]
    return FitPlan(est, card_bytes, usable, seq_len, recipe_batch, fits, misfits, assumptions)


def _largest_batch(fits) -> int:
    """The largest batch for which ``fits(batch)`` holds (0 if not even 1); ``fits`` is monotone."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= MAX_BATCH and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _rank(result: SetupFit, recipe_batch: int) -> tuple:
    s = result.setup
    # paged state that does not fit crosses PCIe every step: there the smaller state is the faster one
    precision = -s.rank if s.paged else s.rank
    return (result.max_batch < recipe_batch, s.paged, s.release, s.checkpointing, precision, -result.max_batch)


def _released_what(shape: DecoderShape) -> str:
    if shape.tied:
        return "the tied embedding's two parts, the output head's held until the input embedding's is made"
    return "one embedding-sized gradient"


def _dtype_name(element_size: int) -> str:
    return {2: "bf16/fp16", 4: "fp32"}.get(element_size, f"{element_size}-byte elements")


def state_label(setup: Setup) -> str:
    """How a setup's state precision reads in the table."""
    return setup.state


def nothing_fits_message(result: FitPlan) -> str:
    """The plain sentence for a card that no setup fits, naming the closest one."""
    closest = result.misfits[0]
    need = min(closest.batch_bytes.values())
    batch = min(closest.batch_bytes)
    return (f"Nothing fits on {result.card_bytes / 2**30:.2f} GiB: the smallest setup ({closest.setup.label()}) "
            f"needs about {need / 2**30:.2f} GiB at batch {batch} of {result.seq_len} tokens, "
            f"{(need - result.usable_bytes) / 2**30:.2f} GiB more than the usable {result.usable_bytes / 2**30:.2f}"
            " GiB. Try a shorter training.max_length, LoRA/QLoRA, or a larger card.")


def release_note(result: FitPlan) -> str | None:
    """The line that says why gradient release leaves some setups' peak where gradients kept put it (the peak is
    the loss head's, before backward has made any gradient); None when release lowers every setup's peak."""
    fits = result.fits + result.misfits
    kept = {(f.setup.optim, f.setup.checkpointing): f for f in fits if not f.setup.release}
    batch = result.recipe_batch
    same = [f for f in fits if f.setup.release and (twin := kept.get((f.setup.optim, f.setup.checkpointing)))
            and f.batch_bytes[batch] == twin.batch_bytes[batch]]
    if not same:
        return None
    which = "every setup" if len(same) == len(fits) - len(kept) else f"{len(same)} setups"
    return (f"released = kept at batch {batch} for {which}: the peak comes at the loss head (full logits of "
            f"{result.seq_len}-token sequences), before release has freed any gradient; release lowers the later "
            "stages of backward and the optimizer step (B/param)")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f}"


__all__ = ["CUDA_CONTEXT_BYTES", "FRAGMENTATION_SHARE", "FitPlan", "Setup", "SetupFit", "family_names", "gib",
           "nothing_fits_message", "parse_memory", "plan", "release_note", "setups", "state_label"]
