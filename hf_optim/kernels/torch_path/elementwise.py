"""Elementwise optimizer updates over 32-bit or 8-bit state: the PyTorch path, and the reference of every other.

An algorithm supplies a *rule*: a pure function on fp32 tensors

    rule(param, grad, states, hyper) -> (output, new_states)

where ``param``/``grad`` are ``(1, n)``, each state is ``(rows, n)`` and ``hyper`` is the algorithm's named
tuple of scalars (``hf_optim.core.algorithm.Algorithm.hyper``). The output is either the new parameter or, for
two-pass algorithms such as LAMB, an update direction written to a scratch buffer. This module loads the states
(dequantizing 8-bit ones), runs the rule, masks non-finite gradients and stores everything back (re-quantizing),
so each algorithm is written once for every precision.

Non-finite gradients: an element whose gradient is NaN or +-Inf is skipped for that step. Its parameter and its
state keep their values (an 8-bit state is re-encoded against its block's new absmax), a direction output is 0,
and the rest of the tensor updates normally. One bad gradient therefore never poisons a block's absmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_optim.formats import SlotLayout
from hf_optim.numerics import rounding

Rule = Callable[
    [torch.Tensor, torch.Tensor, list[torch.Tensor], tuple], tuple[torch.Tensor, list[torch.Tensor]]
]


def scalar_tensors(hyper: tuple) -> tuple:
    """The named tuple ``hyper`` with every scalar an fp32 0-d tensor (a no-op on values that already are)."""
    return type(hyper)(*(torch.as_tensor(value, dtype=torch.float32) for value in hyper))



def update(
    rule: Rule,
    layouts: Sequence[SlotLayout],
    param: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    tensors: Sequence[torch.Tensor],
    hyper: tuple,
    stochastic: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run ``rule`` over ``param``/``grad`` and the slots' raw ``tensors``, in place.

    Shapes: ``param``/``grad``/``out`` are flat ``(n,)`` and each slot's raw tensors ``(rows, n)`` (see its
    format), or, in the multi-tensor kernels, ``(blocks, 256)`` and the block form ``(rows, blocks, 256)``
    (block-aligned chunks: inductor compiles that form to clean vectorized loops for any number of blocks).
    ``layouts`` holds, per slot, its format and map signedness (``state_store.slot_layouts``). If ``out`` is
    given the rule's output goes there (fp32, masked to 0 where the gradient is not finite), else into ``param``.
    ``stochastic`` (bf16 ``param`` only): ``(per-block counter bases, key words)`` of
    :mod:`hf_optim.numerics.rounding`, which then rounds the new parameter into bf16 stochastically instead of
    to nearest.
    """
    raws, olds, index = [], [], 0
    for layout in layouts:
        raw = tensors[index : index + layout.width]
        raws.append(raw)
        olds.append(layout.format.dequantize(raw, layout.signed, None if param.dim() > 1 else param.shape[-1]))
        index += layout.width

    news = update_values(rule, param, grad, out, olds, hyper, stochastic)

    for layout, raw, new in zip(layouts, raws, news):
        layout.format.store(new, raw, layout.signed)


def update_values(
    rule: Rule,
    param: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor | None,
    olds: Sequence[torch.Tensor],
    hyper: tuple,
    stochastic: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The middle of :func:`update`, for callers that read and store the state themselves (a sharded
    parameter's part, ``hf_optim.optim.sharded_blocks``): runs ``rule`` on ``param``/``grad`` and the fp32 state
    values ``olds`` (same form), writes the parameter (or ``out``) in place, and returns the new state values, an
    element whose gradient is not finite keeping its old ones."""
    # Scalars enter the rule as fp32 0-d tensors on every path, so any scalar arithmetic inside a rule rounds
    # the same way eagerly and compiled (a Python float would be combined in double precision).
    hyper = scalar_tensors(hyper)
    p32 = param.float().unsqueeze(0)
    g32 = grad.float().unsqueeze(0)
    finite = torch.isfinite(g32)
    g32 = torch.where(finite, g32, torch.zeros_like(g32))

    result, news = rule(p32, g32, olds, hyper)
    news = [torch.where(finite, new, old) for old, new in zip(olds, news)]

    if out is None:
        new_param = torch.where(finite, result, p32)[0]
        if stochastic is not None:  # an unchanged (skipped) element is exact in bf16: rounding keeps it
            bases, key = stochastic
            new_param = rounding.round_to_bf16(new_param, rounding.element_counters(bases, new_param.shape), key)
        param.copy_(new_param)
    else:
        out.copy_(torch.where(finite, result, torch.zeros_like(result))[0])
    return news
