"""RMSprop with bitsandbytes semantics (no momentum, not centered, L2 weight decay); one state.

Its Triton twin is :mod:`hf_optim.optim.rmsprop.triton_rule` (beside this module, imported only when a Triton
step runs, so this package imports without triton).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from hf_optim.core.algorithm import Algorithm
from hf_optim.core.state_store import StateSpec
from hf_optim.numerics import exact_math
from hf_optim.optim._validation import check_beta, check_eps, check_lr, check_unsupported, check_weight_decay
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping


class RMSpropHyper(NamedTuple):
    """The scalars of one RMSprop step, in the Triton rule's argument order."""

    weight_decay: float  # L2, added to the gradient
    alpha: float
    one_minus_alpha: float
    eps: float
    lr: float


def rmsprop_rule(param, grad, states, h: RMSpropHyper):
    """One RMSprop step on fp32 tensors."""
    (square_avg,) = states
    grad = grad + h.weight_decay * param
    square_avg = h.alpha * square_avg + h.one_minus_alpha * grad * grad
    param = param - h.lr * grad / (exact_math.sqrt(square_avg) + h.eps)
    return param, [square_avg]


def rmsprop_hyper(group: dict, step: int) -> RMSpropHyper:
    return RMSpropHyper(
        weight_decay=group["weight_decay"],
        alpha=group["alpha"],
        one_minus_alpha=1.0 - group["alpha"],
        eps=group["eps"],
        lr=group["lr"],
    )


RMSPROP = Algorithm(
    name="rmsprop",
    class_name="RMSprop",
    slots=(StateSpec("state1", signed=True),),
    hyper=RMSpropHyper,
    hyper_at=rmsprop_hyper,
    rule=rmsprop_rule,
    triton_rule=".triton_rule:rmsprop",
    # transformers passes only lr and optim_args for its rmsprop_bnb names; so does hf_optim.
    trainer=TrainerMapping(
        names=("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "rmsprop_8bit"),
        takes_over=("rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit"),
    ),
)


class RMSprop(HfOptimizer):
    """RMSprop: ``v = alpha*v + (1-alpha)*g*g; p -= lr * g / (sqrt(v) + eps)``; every state format.

    Drop-in for ``bitsandbytes.optim.RMSprop``. Weight decay is L2 (added to the gradient), as in
    bitsandbytes. The 8-bit ``state1`` uses the signed dynamic map, as bitsandbytes' 1-state optimizers do,
    so checkpoints move both ways.

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-2): learning rate.
        alpha (float, default 0.99): EMA coefficient of the squared gradient.
        eps (float, default 1e-8): added to the denominator.
        weight_decay (float, default 0): L2 penalty added to the gradient.
        momentum (float, default 0): only 0 is supported (as in bitsandbytes).
        centered (bool, default False): only False is supported (as in bitsandbytes).
        args (default None): bitsandbytes' config object; only None is accepted.
        percentile_clipping (int, default 100): only 100 (off) is supported; clip with the Trainer's
            ``max_grad_norm`` instead.
        block_wise (bool, default True): only blockwise quantization is supported.
    """

    definition = RMSPROP
    bitsandbytes_order = ("optim_bits", "args", "min_8bit_size", "percentile_clipping", "block_wise")
    pages = False

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        args=None,
        percentile_clipping: int = 100,
        block_wise: bool = True,
        **options,
    ) -> None:
        if momentum != 0.0:  # torch's wording for a bad momentum, then why no other value works
            raise ValueError(f"Invalid momentum value: {momentum}; hf_optim's RMSprop supports only momentum=0 "
                             "(RMSprop with momentum is not implemented, nor in bitsandbytes)")
        check_unsupported("centered", centered, False, "centered RMSprop is not implemented (nor in bitsandbytes)")
        check_unsupported("args", args, None, "pass hyperparameters as keyword arguments or param groups")
        check_unsupported("percentile_clipping", percentile_clipping, 100, "use the Trainer's max_grad_norm")
        check_unsupported("block_wise", block_wise, True, "hf_optim stores 8-bit state blockwise only")
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, **options)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_beta("alpha", group["alpha"], "alpha value")
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])

    def to_bitsandbytes_group(self, group: dict) -> dict:
        return {**group, "betas": (group["alpha"], 0.0)}  # bitsandbytes keeps alpha as betas[0]

    def from_bitsandbytes_group(self, saved: dict) -> dict:
        if "alpha" in saved or "betas" not in saved:
            return saved
        return {**saved, "alpha": saved["betas"][0]}


_family = register_algorithm(RMSPROP, RMSprop)  # no paged twins: bitsandbytes' RMSprop takes no is_paged
RMSprop8bit, RMSprop32bit = _family.take("RMSprop8bit", "RMSprop32bit")
