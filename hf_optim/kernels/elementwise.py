"""Elementwise optimizer updates over 32-bit or 8-bit state: the PyTorch path (reference) and its compiled twin.

An algorithm supplies a *rule*: a pure function on fp32 tensors

    rule(param, grad, states, hyper) -> (output, new_states)

where ``param``/``grad`` are ``(1, n)``, each state is ``(rows, n)`` and ``hyper`` maps names to scalars. The
output is either the new parameter or, for two-pass algorithms such as LAMB, an update direction written to a
scratch buffer. This module loads the states (dequantizing 8-bit ones), runs the rule, masks non-finite
gradients and stores everything back (re-quantizing), so each algorithm is written once for every precision.

Non-finite gradients: an element whose gradient is NaN or +-Inf is skipped for that step. Its parameter and its
state keep their values (an 8-bit state is re-encoded against its block's new absmax), a direction output is 0,
and the rest of the tensor updates normally. One bad gradient therefore never poisons a block's absmax.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from hf_optim.kernels import blockwise

Rule = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], dict], tuple[torch.Tensor, list[torch.Tensor]]
]

CHUNK = 1 << 18
"""Elements per compiled call: a multiple of the block size, small enough that temporaries stay in cache."""

COMPILE_MIN_NUMEL = CHUNK
"""Tensors smaller than this run eagerly; compiling pays off only on large tensors."""


def slot_width(kind: bool | None) -> int:
    """How many raw tensors a slot of this kind passes (see ``state_store.slot_tensors``)."""
    return 1 if kind is None else 4


def update(
    rule: Rule,
    kinds: Sequence[bool | None],
    param: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    hyper: dict,
) -> None:
    """Run ``rule`` over flat ``param``/``grad`` (n,) and the slots' raw ``tensors``, in place.

    ``kinds`` holds, per slot, None (fp32 values) or the signedness of an 8-bit slot. If ``out`` is given the
    rule's output goes there (fp32, masked to 0 where the gradient is not finite), else into ``param``.
    """
    # Scalars enter the rule as fp32 0-d tensors on every path, so any scalar arithmetic inside a rule rounds
    # the same way eagerly and compiled (a Python float would be combined in double precision).
    hyper = {name: torch.as_tensor(value, dtype=torch.float32) for name, value in hyper.items()}
    p32 = param.float().view(1, -1)
    g32 = grad.float().view(1, -1)
    finite = torch.isfinite(g32)
    g32 = torch.where(finite, g32, torch.zeros_like(g32))

    olds, index = [], 0
    for kind in kinds:
        if kind is None:
            olds.append(tensors[index])
        else:
            codes, absmax, qmap = tensors[index : index + 3]
            olds.append(blockwise.dequantize(codes, absmax, qmap))
        index += slot_width(kind)

    result, news = rule(p32, g32, olds, hyper)

    index = 0
    for kind, old, new in zip(kinds, olds, news):
        new = torch.where(finite, new, old)
        if kind is None:
            tensors[index].copy_(new)
        else:
            codes, absmax, _, table = tensors[index : index + 4]
            new_codes, new_absmax = blockwise.quantize(new, table, kind)
            codes.copy_(new_codes)
            absmax.copy_(new_absmax)
        index += slot_width(kind)

    if out is None:
        param.copy_(torch.where(finite, result, p32).view(-1))
    else:
        out.copy_(torch.where(finite, result, torch.zeros_like(result)).view(-1))


def _chunk_tensors(
    kinds: Sequence[bool | None], tensors: Sequence[torch.Tensor], start: int, stop: int
) -> list[torch.Tensor]:
    chunk, index = [], 0
    first_block, last_block = start // blockwise.BLOCK_SIZE, blockwise.num_blocks(stop)
    for kind in kinds:
        if kind is None:
            chunk.append(tensors[index][:, start:stop])
        else:
            codes, absmax, qmap, table = tensors[index : index + 4]
            chunk += [codes[:, start:stop], absmax[:, first_block:last_block], qmap, table]
        index += slot_width(kind)
    return chunk


_compiled_update: Callable | None = None



def compile_enabled() -> bool:
    """Whether CPU updates of large tensors use ``torch.compile`` (set ``HF_OPTIM_COMPILE=0`` to disable)."""
    return os.environ.get("HF_OPTIM_COMPILE", "1") != "0"


def _compiled() -> Callable:
    global _compiled_update
    if _compiled_update is None:
        _compiled_update = torch.compile(update, dynamic=False, fullgraph=True)
    return _compiled_update


def update_chunked(
    rule: Rule,
    kinds: Sequence[bool | None],
    param: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    hyper: dict,
) -> None:
    """:func:`update` compiled once per (rule, slot kinds, dtypes), run over fixed-size chunks.

    Full chunks share one static-shape kernel; the tail runs eagerly. Hyperparameters become 0-d tensors so
    changing learning rates and bias corrections never trigger a recompile.
    """
    n = param.numel()
    full = n - n % CHUNK
    if full:
        fn = _compiled()
        hyper_t = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in hyper.items()}
        # Each (rule, kinds, dtype) is its own specialization; allow enough of them.
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
            for start in range(0, full, CHUNK):
                stop = start + CHUNK
                args = (param[start:stop], grad[start:stop], None if out is None else out[start:stop])
                chunk = _chunk_tensors(kinds, tensors, start, stop)
                fn(rule, tuple(kinds), *args, chunk, hyper_t)
    if full < n:
        update(
            rule,
            kinds,
            param[full:],
            grad[full:],
            None if out is None else out[full:],
            _chunk_tensors(kinds, tensors, full, n),
            hyper,
        )
