"""AdamW (Loshchilov & Hutter), with torch.optim.AdamW semantics, in every state format and paged.

Its Triton twin is :mod:`hf_optim.optim.adamw.triton_rule` (beside this module, imported only when a Triton
step runs, so this package imports without triton).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from hf_optim.core.algorithm import Algorithm, fp32_reciprocal
from hf_optim.core.state_store import StateSpec
from hf_optim.numerics import exact_math
from hf_optim.optim._validation import as_tuple, check_betas, check_eps, check_lr, check_unsupported, check_weight_decay
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping


class AdamWHyper(NamedTuple):
    """The scalars of one AdamW step, in the Triton rule's argument order."""

    decay: float  # 1 - lr*wd
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float  # sqrt(1 - beta2**t): the PyTorch rule divides by it, as torch's CPU kernels do
    inv_bias_correction2_sqrt: float  # its fp32 reciprocal: the Triton rule multiplies, as torch's CUDA kernels do
    eps: float
    step_size: float  # lr / (1 - beta1**t)


def adamw_rule(param, grad, states, h: AdamWHyper):
    """One AdamW step on fp32 tensors, written as torch.optim.AdamW computes it (decay before the step)."""
    exp_avg, exp_avg_sq = states
    param = param * h.decay
    exp_avg = exact_math.lerp(exp_avg, grad, h.one_minus_beta1)
    exp_avg_sq = exp_avg_sq * h.beta2 + h.one_minus_beta2 * grad * grad
    denom = exact_math.sqrt(exp_avg_sq) / h.bias_correction2_sqrt + h.eps
    param = param - h.step_size * (exp_avg / denom)
    return param, [exp_avg, exp_avg_sq]


def adamw_hyper(group: dict, step: int) -> AdamWHyper:
    """Host-side scalars of :func:`adamw_rule` at ``step`` (>= 1)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    return AdamWHyper(
        decay=1.0 - lr * group["weight_decay"],
        one_minus_beta1=1.0 - beta1,
        beta2=beta2,
        one_minus_beta2=1.0 - beta2,
        bias_correction2_sqrt=bias_correction2_sqrt,
        inv_bias_correction2_sqrt=fp32_reciprocal(bias_correction2_sqrt),
        eps=group["eps"],
        step_size=lr / (1.0 - beta1**step),
    )


ADAMW = Algorithm(
    name="adamw",
    class_name="AdamW",
    slots=(StateSpec("state1", signed=True), StateSpec("state2", signed=False)),
    hyper=AdamWHyper,
    hyper_at=adamw_hyper,
    rule=adamw_rule,
    triton_rule=".triton_rule:adamw",
    variant_formats=None,  # every registered format: 4-bit and any later one get classes and names
    trainer=TrainerMapping(
        names=("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_32bit", "adamw_4bit",
               "paged_adamw_4bit", "adamw_torch_4bit", "adamw_4bit_blockwise", "adamw_torch_8bit"),
        # adamw_torch_4bit / adamw_torch_8bit are transformers' torchao-backed names: hf_optim's AdamW runs them
        # with torchao's 4-bit format (blockwise4: its maps, blocks and codes, so a run keeps torchao's results
        # under the takeover) and bitsandbytes' 8-bit format. adamw_4bit is the accurate default, stochastic4.
        takes_over=("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adamw_torch_4bit",
                    "adamw_torch_8bit"),
        formats={"adamw_torch_4bit": "blockwise4"},
        betas=("adam_beta1", "adam_beta2"),
        eps=True,
    ),
)


class AdamW(HfOptimizer):
    """AdamW with decoupled weight decay, the same math as ``torch.optim.AdamW``, in every state format.

    Drop-in for ``bitsandbytes.optim.AdamW`` (same arguments). State follows bitsandbytes' layout: ``state1``
    (first moment, signed map when 8-bit) and ``state2`` (second moment, unsigned map).

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-3): learning rate.
        betas (tuple[float, float], default (0.9, 0.999)): EMA coefficients of the first and second moment.
        eps (float, default 1e-8): added to the denominator.
        weight_decay (float, default 1e-2): decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``
            before the update (torch semantics).
        amsgrad (bool, default False): not supported; True raises ValueError (bitsandbytes ignores it).
        args (default None): bitsandbytes' config object; only None is accepted.
    """

    definition = ADAMW
    bitsandbytes_order = ("optim_bits", "args", "min_8bit_size", "is_paged")
    twins_keep_optim_bits = True  # bitsandbytes' AdamW8bit, PagedAdamW8bit, AdamW32bit, ... take optim_bits=32

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        args=None,
        **options,
    ) -> None:
        check_unsupported("amsgrad", amsgrad, False, "AMSGrad needs a third state; use amsgrad=False")
        check_unsupported("args", args, None, "pass hyperparameters as keyword arguments or param groups")
        defaults = dict(lr=lr, betas=as_tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **options)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_betas(group["betas"], 2)
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])


_family = register_algorithm(ADAMW, AdamW)
AdamW4bit, AdamW8bit, AdamW32bit, PagedAdamW, PagedAdamW4bit, PagedAdamW8bit, PagedAdamW32bit = _family.take(
    "AdamW4bit", "AdamW8bit", "AdamW32bit", "PagedAdamW", "PagedAdamW4bit", "PagedAdamW8bit", "PagedAdamW32bit")
