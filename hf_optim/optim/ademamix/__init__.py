"""AdEMAMix (Pagliardini et al. 2024, arXiv 2409.03137): Adam plus a slow EMA, with alpha and beta3 warm-ups.

Its Triton twin is :mod:`hf_optim.optim.ademamix.triton_rule` (beside this module, imported only when a Triton
step runs, so this package imports without triton).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from hf_optim.core.algorithm import Algorithm, fp32_reciprocal
from hf_optim.core.state_store import StateSpec
from hf_optim.numerics import exact_math
from hf_optim.optim._validation import (
    as_tuple,
    check_betas,
    check_eps,
    check_lr,
    check_optional_steps,
    check_real,
    check_weight_decay,
)
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping


class AdEMAMixHyper(NamedTuple):
    """The scalars of one AdEMAMix step, in the Triton rule's argument order. Every derived scalar comes from the
    host in double precision: ``1 - beta3`` computed in fp32 would lose four digits."""

    decay: float  # 1 - lr*wd
    beta1: float
    beta2: float
    beta3: float  # the scheduled beta3_t
    one_minus_beta1: float
    one_minus_beta2: float
    one_minus_beta3: float
    alpha: float  # the scheduled alpha_t
    bias_correction1: float  # the PyTorch rule divides by the bias corrections (torch's CPU kernels) ...
    inv_bias_correction1: float  # ... the Triton rule multiplies by their fp32 reciprocals (torch's CUDA kernels)
    bias_correction2_sqrt: float
    inv_bias_correction2_sqrt: float
    eps: float
    lr: float


def ademamix_rule(param, grad, states, h: AdEMAMixHyper):
    """One AdEMAMix step on fp32 tensors. ``states[0]`` stacks (fast EMA m1, slow EMA m2); ``states[1]`` is nu."""
    stacked, nu = states
    m1, m2 = stacked[0:1], stacked[1:2]
    param = param * h.decay
    m1 = h.beta1 * m1 + h.one_minus_beta1 * grad
    m2 = h.beta3 * m2 + h.one_minus_beta3 * grad
    nu = h.beta2 * nu + h.one_minus_beta2 * grad * grad
    denom = exact_math.sqrt(nu) / h.bias_correction2_sqrt + h.eps
    param = param - h.lr * (m1 / h.bias_correction1 + h.alpha * m2) / denom
    return param, [torch.cat([m1, m2], dim=0), nu]


def alpha_schedule(alpha: float, step: int, t_alpha: int | None) -> float:
    """Linear warm-up of alpha from 0 over ``t_alpha`` steps (constant alpha when ``t_alpha`` is None)."""
    return alpha if not t_alpha else alpha * min(1.0, step / t_alpha)


def beta3_schedule(beta1: float, beta3: float, step: int, t_beta3: int | None) -> float:
    """Warm-up of beta3 from beta1 to beta3, linear in half-life space, over ``t_beta3`` steps."""
    if not t_beta3:
        return beta3
    s = step / t_beta3
    log1, log3 = math.log(beta1), math.log(beta3)
    return min(math.exp(log1 * log3 / ((1.0 - s) * log3 + s * log1)), beta3)


def ademamix_hyper(group: dict, step: int) -> AdEMAMixHyper:
    beta1, beta2, beta3 = group["betas"]
    beta3_t = beta3_schedule(beta1, beta3, step, group["t_beta3"])
    lr = group["lr"]
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    return AdEMAMixHyper(
        decay=1.0 - lr * group["weight_decay"],
        beta1=beta1,
        beta2=beta2,
        beta3=beta3_t,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        one_minus_beta3=1.0 - beta3_t,
        alpha=alpha_schedule(group["alpha"], step, group["t_alpha"]),
        bias_correction1=bias_correction1,
        inv_bias_correction1=fp32_reciprocal(bias_correction1),
        bias_correction2_sqrt=bias_correction2_sqrt,
        inv_bias_correction2_sqrt=fp32_reciprocal(bias_correction2_sqrt),
        eps=group["eps"],
        lr=lr,
    )


ADEMAMIX = Algorithm(
    name="ademamix",
    class_name="AdEMAMix",
    slots=(StateSpec("state1", signed=True, rows=2), StateSpec("state2", signed=False)),
    hyper=AdEMAMixHyper,
    hyper_at=ademamix_hyper,
    rule=ademamix_rule,
    triton_rule=".triton_rule:ademamix",
    # transformers reads optim_args beta1, beta2, beta3, alpha, eps, t_alpha, t_beta3 for its ademamix names
    variant_formats=None,  # every registered format: 4-bit and any later one get classes and names
    trainer=TrainerMapping(
        names=("ademamix", "ademamix_8bit", "paged_ademamix_8bit", "paged_ademamix_32bit", "ademamix_32bit",
               "ademamix_4bit", "paged_ademamix_4bit"),
        takes_over=("ademamix", "ademamix_8bit", "paged_ademamix_8bit", "paged_ademamix_32bit"),
        betas=("adam_beta1", "adam_beta2", 0.9999),
        eps=True,
        fixed={"alpha": 5.0},
    ),
)


class AdEMAMix(HfOptimizer):
    """AdEMAMix: AdamW whose numerator mixes a fast EMA with ``alpha`` times a slow EMA (no bias correction).

    Drop-in for ``bitsandbytes.optim.AdEMAMix``. State layout as bitsandbytes: ``state1`` stacks the fast and
    slow EMAs as ``(2, *p.shape)`` (both signed maps when 8-bit; the slow EMA's absmax is row 1 of
    ``absmax1``), ``state2`` holds the second moment. bitsandbytes' CUDA kernels index the slow EMA's absmax
    differently when ``p.numel() % 256 != 0``, so such 8-bit states from bitsandbytes' GPU path are not portable.

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-3): learning rate.
        betas (tuple[float, float, float], default (0.9, 0.999, 0.9999)): fast EMA, second moment, slow EMA.
        alpha (float, default 5.0): weight of the slow EMA.
        t_alpha (int | None, default None): steps of linear alpha warm-up (None: no warm-up).
        t_beta3 (int | None, default None): steps of beta3 warm-up from beta1 (None: no warm-up).
        eps (float, default 1e-8): added to the denominator.
        weight_decay (float, default 1e-2): decoupled weight decay, applied before the update.
    """

    definition = ADEMAMIX

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **options,
    ) -> None:
        defaults = dict(
            lr=lr, betas=as_tuple(betas), alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, **options)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_betas(group["betas"], 3)
        check_real("alpha", group["alpha"], low=0.0)
        check_optional_steps("t_alpha", group["t_alpha"])
        check_optional_steps("t_beta3", group["t_beta3"])
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        if group["t_beta3"] and min(group["betas"][0], group["betas"][2]) == 0.0:
            raise ValueError("t_beta3 needs beta1 > 0 and beta3 > 0 (the warm-up works on their logarithms)")


_family = register_algorithm(ADEMAMIX, AdEMAMix)
(AdEMAMix4bit, AdEMAMix8bit, AdEMAMix32bit, PagedAdEMAMix,
 PagedAdEMAMix4bit, PagedAdEMAMix8bit, PagedAdEMAMix32bit) = _family.take(
    "AdEMAMix4bit", "AdEMAMix8bit", "AdEMAMix32bit", "PagedAdEMAMix",
    "PagedAdEMAMix4bit", "PagedAdEMAMix8bit", "PagedAdEMAMix32bit")
