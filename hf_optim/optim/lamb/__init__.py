"""LAMB (You et al. 2019, arXiv 1904.00962) with NVIDIA apex FusedLAMB semantics: a real layer-wise trust ratio.

bitsandbytes' ``LAMB`` is Adam with update-norm clipping and its ``LAMB8bit`` has no clipping at all; this is
the algorithm users mean by LAMB, in 32-bit and 8-bit state alike.

Its Triton twin, beside this module: the direction rule :mod:`hf_optim.optim.lamb.triton_rule` and the trust-ratio
passes :mod:`hf_optim.optim.lamb.triton_passes` (its ``launch_specs`` lists their kernels for ahead-of-time
compilation, through ``TritonPlan.specs``); both are imported only when a Triton step runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch

from hf_optim.core.algorithm import Algorithm, TritonPlan, fp32_reciprocal
from hf_optim.core.own_update import OwnUpdate
from hf_optim.core.state_store import StateSpec
from hf_optim.kernels.torch_path import multi_tensor
from hf_optim.numerics import exact_math, rounding
from hf_optim.optim import sharding
from hf_optim.optim._validation import (
    as_tuple,
    check_betas,
    check_eps,
    check_lr,
    check_real,
    check_unsupported,
    check_weight_decay,
)
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping


class LAMBHyper(NamedTuple):
    """The scalars of LAMB's first pass, in the Triton rule's argument order."""

    l2: float  # weight decay added to the gradient (Adam-W mode off)
    decoupled: float  # weight decay added to the direction (Adam-W mode on)
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    bias_correction1: float  # the PyTorch rule divides by the bias corrections (torch's CPU kernels) ...
    inv_bias_correction1: float  # ... the Triton rule multiplies by their fp32 reciprocals (torch's CUDA kernels)
    bias_correction2: float
    inv_bias_correction2: float
    eps: float


def lamb_rule(param, grad, states, h: LAMBHyper):
    """First LAMB pass on fp32 tensors: update the moments and return the Adam direction ``u``."""
    exp_avg, exp_avg_sq = states
    grad = grad + h.l2 * param
    exp_avg = h.beta1 * exp_avg + h.one_minus_beta1 * grad
    exp_avg_sq = h.beta2 * exp_avg_sq + h.one_minus_beta2 * grad * grad
    direction = (exp_avg / h.bias_correction1) / (exact_math.sqrt(exp_avg_sq / h.bias_correction2) + h.eps)
    direction = direction + h.decoupled * param
    return direction, [exp_avg, exp_avg_sq]


def lamb_hyper(group: dict, step: int) -> LAMBHyper:
    beta1, beta2 = group["betas"]
    corrected = group["bias_correction"]
    wd = group["weight_decay"]
    bias_correction1 = 1.0 - beta1**step if corrected else 1.0
    bias_correction2 = 1.0 - beta2**step if corrected else 1.0
    return LAMBHyper(
        l2=0.0 if group["adam_w_mode"] else wd,
        decoupled=wd if group["adam_w_mode"] else 0.0,
        beta1=beta1,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        bias_correction1=bias_correction1,
        inv_bias_correction1=fp32_reciprocal(bias_correction1),
        bias_correction2=bias_correction2,
        inv_bias_correction2=fp32_reciprocal(bias_correction2),
        eps=group["eps"],
    )


def trust_ratio(
    weight_norm: torch.Tensor,
    update_norm: torch.Tensor,
    *,
    adapt: bool,
    max_trust_ratio: float | None,
    max_unorm: float = 0.0,
) -> torch.Tensor:
    """The factor of the direction per tensor: ``||w|| / ||u||`` where both norms are positive and ``adapt`` holds,
    else 1; clamped at ``max_trust_ratio``; then, with ``max_unorm > 0`` and both norms positive, at most
    ``max_unorm * ||w|| / ||u||`` (bitsandbytes' update-norm clip, ``||ratio * u|| <= max_unorm * ||w||``, which
    never binds where the trust ratio applies unless ``max_unorm < 1``)."""
    one = torch.ones_like(weight_norm)
    valid = (weight_norm > 0) & (update_norm > 0)
    free = weight_norm / torch.where(valid, update_norm, one)  # read only where valid
    ratio = one
    if adapt:
        ratio = torch.where(valid, free, one)
        if max_trust_ratio is not None:
            ratio = ratio.clamp(max=max_trust_ratio)
    if max_unorm > 0:
        # free * 1.0 is free exactly: with max_unorm=1 the clip leaves an applied trust ratio bit for bit
        ratio = torch.where(valid, torch.minimum(ratio, free * max_unorm), ratio)
    return ratio


def _norms(weight: torch.Tensor, direction: torch.Tensor, full=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of the whole tensor; for a sharded ``full`` parameter the squared sums of the local shards are
    all-reduced over the shard group (one collective for both)."""
    if full is None or not sharding.is_sharded(full):
        return weight.float().norm(), direction.norm()
    weight_norm, direction_norm = sharding.square_sums([weight, direction], full).sqrt().unbind()
    return weight_norm, direction_norm


def lamb_tensor_update(ctx, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, full=None) -> None:
    """LAMB on one tensor: the direction, the trust ratio of the whole tensor, then ``p -= lr * ratio * u``."""
    # Pass 1 writes the direction to scratch and leaves the parameter untouched, so its norm is "before".
    direction = torch.empty(param.shape, dtype=torch.float32, device=param.device)
    ctx.run_rule(param, grad, state, ctx.hyper(group, state["step"]), out=direction.view(-1), full=full)
    weight_norm, update_norm = _norms(param, direction, full)
    adapt = group["weight_decay"] != 0 or group["use_nvlamb"]
    ratio = trust_ratio(weight_norm, update_norm, adapt=adapt, max_trust_ratio=group["max_trust_ratio"],
                        max_unorm=group["max_unorm"])
    updated = param.float() - (group["lr"] * ratio) * direction
    stream = ctx.stream(group, state, param)
    if stream is None:
        param.copy_(updated)
    else:
        rounding.write_rounded(param, updated, stream.ordinal, stream.key)


def lamb_flat_update(ctx, group: dict, flat, members: list, hyper, stream: rounding.Stream | None = None) -> None:
    """The multi-tensor path: directions of a bucket of tensors in one flat buffer (one call per chunk), the
    norms with one ``_foreach_norm`` each, then ``p -= lr * ratio * u`` with foreach operations. Every value
    equals :func:`lamb_tensor_update`'s bit for bit."""
    adapt = group["weight_decay"] != 0 or group["use_nvlamb"]
    for run, params, grads in multi_tensor.runs_of(flat, members):
        for bucket in multi_tensor.buckets(flat, run, FLAT_DIRECTION_NUMEL):
            start = flat.members[bucket[0]].offset
            length = flat.members[bucket[-1]].padded_stop - start
            direction = ctx.scratch.buffer("lamb direction", torch.float32, flat.device, length)
            multi_tensor.step_run(ctx.rule, flat, multi_tensor.cached_chunks(flat, bucket), params, grads, hyper,
                                  ctx.scratch, out=direction, out_offset=start)
            weights = [params[i] for i in bucket]
            directions = [direction[flat.members[i].offset - start : flat.members[i].stop - start] for i in bucket]
            weight_norms = torch._foreach_norm([w.float() for w in weights])
            update_norms = torch._foreach_norm(directions)
            ratios = trust_ratio(torch.stack(weight_norms), torch.stack(update_norms), adapt=adapt,
                                 max_trust_ratio=group["max_trust_ratio"], max_unorm=group["max_unorm"])
            torch._foreach_mul_(directions, list((ratios * group["lr"]).unbind()))
            if weights[0].dtype == torch.float32:
                torch._foreach_sub_(weights, directions)
            elif stream is not None:  # bf16 stochastic rounding, each tensor with its own counters
                for index, weight, step in zip(bucket, weights, directions):
                    rounding.write_rounded(weight, weight.float() - step, stream.ordinals[index], stream.key)
            else:
                torch._foreach_copy_(weights, torch._foreach_sub([w.float() for w in weights], directions))


def warn_zero_start(ctx, group: dict, params: list[torch.Tensor]) -> None:
    """Warn (once per optimizer) when the trust ratio applies to tensors that are all zero at their first step:
    LoRA's B matrices, which the ratio keeps near zero (docs/guide/optimizers.md, "LAMB and LoRA")."""
    if not (group["weight_decay"] != 0 or group["use_nvlamb"]) or "zero start" in ctx.notes:
        return
    params = [param for param in params if param.numel() > 0]
    if not params:
        return
    norms = torch._foreach_norm([param.float() for param in params])
    zero = int((torch.stack([norm.to(norms[0].device) for norm in norms]) == 0).sum())  # one sync
    if zero:
        ctx.notes.add("zero start")
        warnings.warn(ZERO_START_WARNING.format(name=ctx.name, count=zero), UserWarning, stacklevel=2)


LAMB_ALGORITHM = Algorithm(
    name="lamb",
    class_name="LAMB",
    slots=(StateSpec("state1", signed=True), StateSpec("state2", signed=False)),
    hyper=LAMBHyper,
    hyper_at=lamb_hyper,
    rule=lamb_rule,
    triton_rule=".triton_rule:lamb",
    # three passes (directions, norms, apply); the norms are of the whole tensor, so shards take the PyTorch path
    triton_plan=TritonPlan(step=".triton_passes:step", shards=False,
                           specs=".triton_passes:launch_specs"),
    update=OwnUpdate(tensor=lamb_tensor_update, flat=lamb_flat_update, created=warn_zero_start),
    trainer=TrainerMapping(
        names=("lamb", "lamb_32bit", "lamb_8bit", "paged_lamb_8bit", "paged_lamb_32bit"),
        betas=("adam_beta1", "adam_beta2"),
        eps=True,
    ),
)



class LAMB(HfOptimizer):
    """LAMB: Adam direction ``u`` (+ decoupled weight decay), scaled per tensor by ``||p|| / ||u||``.

    ``p -= lr * ratio * u`` with ``ratio = ||p|| / ||u||`` over the whole tensor (1 if either norm is 0), as
    NVIDIA apex's FusedLAMB. apex applies the ratio only to groups with weight decay unless ``use_nvlamb``.
    The global gradient-norm clipping apex folds in is left to the Trainer (``max_grad_norm``).

    Coming from ``bitsandbytes.optim.LAMB``: the arguments are bitsandbytes' (names and order; hf_optim's own
    ``is_paged``, ``use_nvlamb``, ``max_trust_ratio``, ... follow them), but the algorithm and three defaults differ
    on purpose. bitsandbytes' LAMB is Adam whose update is clipped to ``||u|| <= max_unorm * ||p||`` (no trust
    ratio; its LAMB8bit does not clip at all, and refuses ``max_unorm != 1``); this class is LAMB as apex runs it,
    so ``eps`` (1e-6, bitsandbytes 1e-8) and ``weight_decay`` (0.01, bitsandbytes 0: with 0 apex's LAMB applies no
    trust ratio) are apex's defaults, and ``max_unorm`` (0.0, bitsandbytes 1.0) is off. ``max_unorm`` keeps
    bitsandbytes' meaning where it is set, in both precisions: after the trust ratio, the factor is capped at
    ``max_unorm * ||p|| / ||u||``, except on a tensor whose norm is 0, which bitsandbytes' clip would keep at zero
    forever (LoRA's B matrices start at zero). ``LAMB(params, lr, eps=1e-8, weight_decay=0, max_unorm=1.0)``
    therefore runs bitsandbytes' 32-bit LAMB math as its CUDA kernel computes it (its CPU backend measures the
    update norm before bias correction, a clip tighter by ``(1 - beta1**t) / sqrt(1 - beta2**t)``).

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-3): learning rate.
        bias_correction (bool, default True): bias-correct the moments.
        betas (tuple[float, float], default (0.9, 0.999)): EMA coefficients of the moments.
        eps (float, default 1e-6): added to the denominator (apex's default; bitsandbytes' is 1e-8).
        weight_decay (float, default 0.01): weight decay (in ``u`` when ``adam_w_mode``, else L2 on the gradient);
            apex's default (bitsandbytes' is 0).
        amsgrad (bool, default False): not supported; True raises ValueError.
        adam_w_mode (bool, default True): decoupled weight decay (apex ``adam_w_mode``).
        args (default None): bitsandbytes' config object; only None is accepted.
        max_unorm (float, default 0.0): bitsandbytes' update-norm clip (see above); 0 turns it off (bitsandbytes'
            default is 1.0, which never binds where the trust ratio applies).
        use_nvlamb (bool, default False): apply the trust ratio also to groups with ``weight_decay == 0``.
        max_trust_ratio (float | None, default None): clamp the trust ratio (e.g. 10); None leaves it free.
    """

    definition = LAMB_ALGORITHM
    bitsandbytes_order = ("optim_bits", "args", "min_8bit_size", "max_unorm", "is_paged")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        args=None,
        max_unorm: float = 0.0,
        use_nvlamb: bool = False,
        max_trust_ratio: float | None = None,
        **options,
    ) -> None:
        check_unsupported("amsgrad", amsgrad, False, "AMSGrad needs a third state; use amsgrad=False")
        check_unsupported("args", args, None, "pass hyperparameters as keyword arguments or param groups")
        defaults = dict(
            lr=lr, bias_correction=bool(bias_correction), betas=as_tuple(betas), eps=eps, weight_decay=weight_decay,
            adam_w_mode=bool(adam_w_mode), use_nvlamb=bool(use_nvlamb), max_trust_ratio=max_trust_ratio,
            max_unorm=max_unorm,
        )
        super().__init__(params, defaults, **options)
        if not any(group["weight_decay"] != 0 or group["use_nvlamb"] or group["max_unorm"] > 0
                   for group in self.param_groups):
            # The Trainer's default weight_decay is 0: LAMB would then silently be Adam (apex semantics).
            warnings.warn(
                f"{type(self).__name__}: every parameter group has weight_decay=0 and use_nvlamb=False, so no group "
                "applies LAMB's trust ratio (NVIDIA apex semantics) and this runs as Adam. Set weight_decay > 0 "
                "(e.g. TrainingArguments(weight_decay=0.01)) or use_nvlamb=True (optim_args='use_nvlamb=True').",
                UserWarning,
                stacklevel=2,
            )

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_betas(group["betas"], 2)
        check_eps(group["eps"])
        check_weight_decay(group["weight_decay"])
        if group["max_trust_ratio"] is not None:
            check_real("max_trust_ratio", group["max_trust_ratio"], low=0.0, low_open=True)
        check_real("max_unorm", group["max_unorm"], low=0.0, high=math.inf, high_open=True)


ZERO_START_WARNING = (
    "{name}: {count} tensor(s) under LAMB's trust ratio start at zero (LoRA's B matrices: peft initializes them to "
    "0). The ratio ||p|| / ||u|| moves a tensor by lr * ||p|| per step, so such a tensor stays near zero at an "
    "AdamW-sized lr and LoRA barely trains (hf-optim's quickstart at lr 5e-3: final loss 6.32 against 2.78 for "
    "AdamW; at lr 0.05: 2.88). With LoRA give LAMB about 10x AdamW's lr, or use adamw_8bit "
    "(docs/guide/optimizers.md, \"LAMB and LoRA\")"
)

FLAT_DIRECTION_NUMEL = 1 << 22
"""Most LAMB directions the multi-tensor path holds at once (16 MiB of fp32); a larger tensor is a bucket alone."""

_family = register_algorithm(LAMB_ALGORITHM, LAMB)
LAMB8bit, LAMB32bit, PagedLAMB, PagedLAMB8bit, PagedLAMB32bit = _family.take(
    "LAMB8bit", "LAMB32bit", "PagedLAMB", "PagedLAMB8bit", "PagedLAMB32bit")
