"""Lion (Chen et al. 2023, arXiv 2302.06675): sign of an interpolated momentum; one state.

Its Triton twin is :mod:`hf_optim.optim.lion.triton_rule` (beside this module, imported only when a Triton
step runs, so this package imports without triton).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch

from hf_optim.core.algorithm import Algorithm
from hf_optim.core.state_store import StateSpec
from hf_optim.optim._validation import as_tuple, check_betas, check_lr, check_unsupported, check_weight_decay
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping


class LionHyper(NamedTuple):
    """The scalars of one Lion step (host math), in the Triton rule's argument order."""

    decay: float  # 1 - lr*wd
    lr: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float


def lion_rule(param, grad, states, h: LionHyper):
    """One Lion step on fp32 tensors."""
    (exp_avg,) = states
    param = param * h.decay
    direction = torch.sign(h.beta1 * exp_avg + h.one_minus_beta1 * grad)
    param = param - h.lr * direction
    exp_avg = h.beta2 * exp_avg + h.one_minus_beta2 * grad
    return param, [exp_avg]


def lion_hyper(group: dict, step: int) -> LionHyper:
    beta1, beta2 = group["betas"]
    return LionHyper(
        decay=1.0 - group["lr"] * group["weight_decay"],
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
    )


LION = Algorithm(
    name="lion",
    class_name="Lion",
    slots=(StateSpec("state1", signed=True),),
    hyper=LionHyper,
    hyper_at=lion_hyper,
    rule=lion_rule,
    triton_rule=".triton_rule:lion",
    variant_formats=None,  # every registered format: 4-bit and any later one get classes and names
    trainer=TrainerMapping(
        names=("lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit", "lion_4bit", "paged_lion_4bit"),
        takes_over=("lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit"),
        betas=("adam_beta1", "adam_beta2"),
    ),
)


class Lion(HfOptimizer):
    """Lion: ``p -= lr * sign(beta1*m + (1-beta1)*g)`` then ``m = beta2*m + (1-beta2)*g``; every state format.

    Drop-in for ``bitsandbytes.optim.Lion`` (same arguments). One state, ``state1`` (signed map when 8-bit).

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-4): learning rate.
        betas (tuple[float, float], default (0.9, 0.99)): interpolation and EMA coefficients.
        weight_decay (float, default 0): decoupled weight decay, applied before the update.
        args (default None): bitsandbytes' config object; only None is accepted.
    """

    definition = LION
    bitsandbytes_order = ("optim_bits", "args", "min_8bit_size", "is_paged")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        args=None,
        **options,
    ) -> None:
        check_unsupported("args", args, None, "pass hyperparameters as keyword arguments or param groups")
        defaults = dict(lr=lr, betas=as_tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, **options)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_betas(group["betas"], 2)
        check_weight_decay(group["weight_decay"])

    def to_bitsandbytes_group(self, group: dict) -> dict:
        return {**group, "eps": group.get("eps", 0.0)}  # bitsandbytes' Lion carries an unused eps


_family = register_algorithm(LION, Lion)
Lion4bit, Lion8bit, Lion32bit, PagedLion, PagedLion4bit, PagedLion8bit, PagedLion32bit = _family.take(
    "Lion4bit", "Lion8bit", "Lion32bit", "PagedLion", "PagedLion4bit", "PagedLion8bit", "PagedLion32bit")
