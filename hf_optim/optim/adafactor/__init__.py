"""Adafactor (Shazeer & Stern 2018) with the semantics of ``transformers.optimization.Adafactor``.

This is what ``optim="adafactor"`` runs in the Trainer today (not ``torch.optim.Adafactor``, a different
variant that always uses a relative step and has no first moment). State keys match transformers, so its
checkpoints load here.

Its Triton twin is :mod:`hf_optim.optim.adafactor.triton_passes`, beside this module (its ``launch_specs`` lists the
passes' kernels for ahead-of-time compilation, through ``TritonPlan.specs``), imported only when a Triton step
runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch

from hf_optim.core.algorithm import Algorithm, TritonPlan, fp32_reciprocal
from hf_optim.core.own_update import OwnUpdate
from hf_optim.core.state_store import StateSpec, slot_bytes
from hf_optim.formats import FP32, StateFormat, loaded_format
from hf_optim.numerics import rounding
from hf_optim.optim import sharding
from hf_optim.optim._validation import as_tuple, check_beta, check_eps, check_lr, check_real, check_weight_decay
from hf_optim.optim.base import HfOptimizer, StateDictError, local_tensor
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping

FIRST_MOMENT = StateSpec("exp_avg", signed=True)


class AdafactorHyper(NamedTuple):
    """The host scalars of one Adafactor step (what its Triton passes take; the PyTorch path computes the same)."""

    step_size: float  # the step's learning rate before scale_parameter's RMS factor (see relative_step_size)
    eps1: float
    eps2: float
    beta2t: float  # 1 - t**decay_rate
    one_minus_beta2t: float
    inv_clip_threshold: float  # fp32 reciprocal: the kernels multiply, as torch's CUDA division does
    negative_decay: float  # -weight_decay
    beta1: float  # 0 without a first moment
    one_minus_beta1: float


def relative_step_size(group: dict, step: int) -> float:
    """The step's learning rate before ``scale_parameter``'s RMS factor (a host float)."""
    step_size = group["lr"]
    # A relative-step group's lr is None or what RelativeStepSchedule reports (always > 0). An lr of exactly 0
    # means "take no step": torch.distributed.checkpoint's get/set_optimizer_state_dict create missing state
    # by stepping with zero gradients and lr=0, and weight decay must not move the weights then.
    if group["relative_step"] and step_size != 0:
        floor = 1e-6 * step if group["warmup_init"] else 1e-2
        step_size = min(floor, 1.0 / math.sqrt(step))
    return step_size


def adafactor_hyper(group: dict, step: int) -> AdafactorHyper:
    beta1 = group["beta1"] if group["beta1"] is not None else 0.0
    beta2t = 1.0 - math.pow(step, group["decay_rate"])
    return AdafactorHyper(
        step_size=relative_step_size(group, step),
        eps1=group["eps"][0],
        eps2=group["eps"][1],
        beta2t=beta2t,
        one_minus_beta2t=1.0 - beta2t,
        inv_clip_threshold=fp32_reciprocal(group["clip_threshold"]),
        negative_decay=-group["weight_decay"],
        beta1=beta1,
        one_minus_beta1=1.0 - beta1,
    )


def adafactor_state_bytes(shape: tuple[int, ...], quantized: bool, fmt: StateFormat) -> int:
    """Factored second moment (rows + columns, fp32) for >= 2-D tensors, a full one for vectors, the RMS scalar,
    and, for a quantized Trainer name (which sets beta1), the first moment (in ``fmt`` when ``quantized``)."""
    numel = math.prod(shape)
    if len(shape) >= 2:
        total = 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]))
    else:
        total = 4 * numel
    total += 4  # RMS
    if fmt.quantized:
        total += slot_bytes(FIRST_MOMENT, numel, fmt if quantized else FP32)
    return total


def _trainer_adjust(kwargs: dict, args, betas: list, optim_args: dict, state_format: StateFormat) -> None:
    """The Trainer's ``optim="adafactor"`` (external lr, no relative step, no parameter scaling: in ``fixed``);
    ``adafactor_8bit`` keeps a first moment (the state kept in 8-bit) with ``adam_beta1``; optim_args ``beta1``
    sets it, and ``relative_step=True`` without an ``lr`` lets Adafactor's own step replace the Trainer's lr."""
    if state_format.quantized:
        kwargs.update(state_format=state_format.name, beta1=args.adam_beta1)
    if betas and betas[0] is not None:
        kwargs["beta1"] = betas[0]
    if optim_args.get("relative_step") and "lr" not in optim_args:
        kwargs["lr"] = None


def finite_mask(grad: torch.Tensor) -> torch.Tensor | None:
    """Where ``grad`` is finite, or None when it is finite everywhere (then no element needs skipping). On CPU one
    sum decides: a sum is NaN or infinite whenever an element is (a sum of finite values that overflows only takes
    the masked path, which gives the same result). The mask is what costs: three passes to build, two to apply, on
    a step of about ten. On other devices the mask is always built (reading the sum back would wait for them)."""
    if grad.device.type == "cpu" and bool(torch.isfinite(grad.sum())):
        return None
    return torch.isfinite(grad)


def rms(tensor: torch.Tensor) -> torch.Tensor:
    """Root mean square of all elements."""
    return tensor.norm(2) / math.sqrt(tensor.numel())


def factored_inverse_sqrt(row: torch.Tensor, col: torch.Tensor, row_mean: torch.Tensor | None = None) -> torch.Tensor:
    """``1/sqrt(V)`` of the rank-1 factored second moment ``V = row col^T / mean(row)``.

    ``row_mean`` (keepdim) replaces ``row.mean(dim=-1)`` when ``row`` is only a shard of the rows.
    """
    if row_mean is None:
        row_mean = row.mean(dim=-1, keepdim=True)
    row_factor = (row / row_mean).rsqrt().unsqueeze(-1)
    col_factor = col.unsqueeze(-2).rsqrt()
    return row_factor * col_factor


SCHEDULER_REFUSAL = (
    "Adafactor(relative_step=True) computes its own step size, so its param groups hold no lr for a torch lr "
    "scheduler to scale: use hf_optim.RelativeStepSchedule(optimizer) to report the relative step (transformers' "
    "AdafactorSchedule drives transformers' Adafactor), or Adafactor(relative_step=False, lr=...) to schedule a "
    "learning rate"
)


class _LocalStatistics:
    """Means and RMS of a whole (unsharded) parameter: the exact operations of transformers' Adafactor."""

    @staticmethod
    def rms(tensor: torch.Tensor) -> torch.Tensor:
        return rms(tensor)

    @staticmethod
    def mean(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor.mean(dim=dim)

    @staticmethod
    def row_mean(row: torch.Tensor) -> None:
        return None  # factored_inverse_sqrt takes the mean itself


class _ShardedStatistics:
    """The same statistics of a sharded parameter ``full``: local sums all-reduced over the shard group and
    divided by global sizes (a mean over dimension ``d`` of the gradient is over parameter dimension ``d``)."""

    def __init__(self, full) -> None:
        self.full = full

    def rms(self, tensor: torch.Tensor) -> torch.Tensor:
        return sharding.rms(tensor, self.full)

    def mean(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return sharding.mean(tensor, dim, self.full, dim)

    def row_mean(self, row: torch.Tensor) -> torch.Tensor:
        # row statistics drop the parameter's last dimension: their last dimension is parameter dim -2
        return sharding.mean(row, -1, self.full, -2, keepdim=True)


def init_adafactor_state(ctx, full: torch.Tensor, group: dict, state: dict) -> None:
    """The factored statistics (rows and columns for tensors of 2 or more dimensions), the RMS scalar and, with
    ``beta1``, the first moment in the group's state format."""
    param = local_tensor(full)
    state["step"] = 0
    state["RMS"] = torch.zeros((), dtype=torch.float32, device=param.device)
    if param.dim() >= 2:
        shape = param.shape
        state["exp_avg_sq_row"] = torch.zeros(shape[:-1], dtype=torch.float32, device=param.device)
        state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:], dtype=torch.float32, device=param.device)
    else:
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    if group["beta1"] is not None:
        ctx.store.init_slot(state, FIRST_MOMENT, full, ctx.store.format_of(full, group))


def learning_rate(group: dict, step: int, param_rms: torch.Tensor) -> torch.Tensor:
    step_size = relative_step_size(group, step)
    if group["scale_parameter"]:
        return param_rms.clamp(min=group["eps"][1]) * step_size
    return torch.as_tensor(step_size, dtype=torch.float32, device=param_rms.device)  # a float or a tensor lr


def adafactor_update(ctx, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, full=None) -> None:
    """One Adafactor step of the local tensor ``param`` (``full``: the parameter, a DTensor when sharded: the
    statistics are then all-reduced over its shards)."""
    step = state["step"]
    p32 = param.float()
    grad = grad.float()
    finite = finite_mask(grad)
    if finite is not None:
        grad = torch.where(finite, grad, torch.zeros_like(grad))  # skipped elements count as zero gradient
    reduce = _ShardedStatistics(full) if full is not None and sharding.is_sharded(full) else _LocalStatistics()

    state["RMS"] = reduce.rms(p32)
    lr = learning_rate(group, step, state["RMS"])
    # ``**``, not math.pow: torch.compile traces it on a symbolic step; math.pow would recompile at every step
    beta2t = 1.0 - step ** group["decay_rate"]
    squared = grad * grad + group["eps"][0]
    if "exp_avg_sq_row" in state:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        row.mul_(beta2t).add_(reduce.mean(squared, -1), alpha=1.0 - beta2t)
        col.mul_(beta2t).add_(reduce.mean(squared, -2), alpha=1.0 - beta2t)
        update = factored_inverse_sqrt(row, col, reduce.row_mean(row)) * grad
    else:
        sq = state["exp_avg_sq"]
        sq.mul_(beta2t).add_(squared, alpha=1.0 - beta2t)
        update = sq.rsqrt() * grad
    update = update / (reduce.rms(update) / group["clip_threshold"]).clamp(min=1.0)
    update = update * lr
    if group["beta1"] is not None:  # an empty shard too: a sharded 8-bit slot's split runs wait for every rank
        old = ctx.read_slot(state, FIRST_MOMENT, update.numel(), full).view_as(update)
        exp_avg = old * group["beta1"] + update * (1.0 - group["beta1"])
        if finite is not None:
            exp_avg = torch.where(finite, exp_avg, old)
        ctx.write_slot(state, FIRST_MOMENT, exp_avg.reshape(1, -1), full)  # reshape: a transposed param is not
        update = exp_avg  # contiguous
    if param.numel() == 0:  # an empty shard has joined every reduction; nothing of its own to update
        return
    _apply(ctx, param, p32, update, lr, finite, state, group)


def _apply(ctx, param, p32, update, lr, finite, state: dict, group: dict) -> None:
    """``p -= weight_decay * lr * p + update``, skipping non-finite gradient elements."""
    if finite is None and p32 is param:  # an fp32 parameter with nothing to skip: the same values, in place
        if group["weight_decay"] != 0:
            param.add_(param * (-group["weight_decay"] * lr))
        param.sub_(update)
        return
    new = p32
    if group["weight_decay"] != 0:
        new = new + new * (-group["weight_decay"] * lr)
    new = new - update
    new = new if finite is None else torch.where(finite, new, p32)
    stream = ctx.stream(group, state, param)
    if stream is None:
        param.copy_(new)
    else:
        rounding.write_rounded(param, new, stream.ordinal, stream.key)


def state_dims(key: str, ndim: int, state=None):
    """Row statistics follow every dimension but the last, column statistics every one but the second to
    last; reduced (sharded) dimensions are replicated, as the all-reduces keep them identical."""
    if key == "exp_avg_sq_row":
        return tuple(range(ndim - 1))
    if key == "exp_avg_sq_col":
        return tuple(range(ndim - 2)) + (ndim - 1,)
    if key in ("exp_avg_sq", FIRST_MOMENT.key):
        return tuple(range(ndim))
    if key == FIRST_MOMENT.absmax_key:
        return sharding.ABSMAX
    return None


def check_loaded(param: torch.Tensor, state: dict, where: str) -> None:
    factored = param.dim() >= 2
    needed = {"exp_avg_sq_row", "exp_avg_sq_col"} if factored else {"exp_avg_sq"}
    missing = needed - set(state)
    if missing:
        raise StateDictError(f"{where} lacks {sorted(missing)}: the state dict was not saved by Adafactor")
    if FIRST_MOMENT.key in state:
        fmt = loaded_format(state, FIRST_MOMENT)
        if fmt is None:
            raise StateDictError(f"{where}: {FIRST_MOMENT.key} is in no state format hf_optim knows")
        fmt.check_loaded(param, state, FIRST_MOMENT, where)


ADAFACTOR = Algorithm(
    name="adafactor",
    class_name="Adafactor",
    slots=(FIRST_MOMENT,),  # only with beta1; the factored statistics are not per-element slots
    hyper=AdafactorHyper,
    hyper_at=adafactor_hyper,
    # six passes (triton_passes.py); statistics over the whole tensor: shards and empty
    # tensors take PyTorch's path
    triton_plan=TritonPlan(step=".triton_passes:step", shards=False, empty=False,
                           specs=".triton_passes:launch_specs"),
    trainer=TrainerMapping(
        names=("adafactor", "adafactor_8bit"),
        takes_over=("adafactor",),
        fixed={"scale_parameter": False, "relative_step": False},
        adjust=_trainer_adjust,
    ),
    state_bytes=adafactor_state_bytes,
    update=OwnUpdate(tensor=adafactor_update, init_state=init_adafactor_state, state_dims=state_dims,
                     check_loaded=check_loaded),
)



class Adafactor(HfOptimizer):
    """Adafactor with factored second moments for tensors of 2 or more dimensions (transformers semantics).

    ``lr_t = (relative_step ? min(warmup_init ? 1e-6*t : 1e-2, 1/sqrt(t)) : lr) *
    (scale_parameter ? max(eps[1], RMS(p)) : 1)``; the second-moment decay is ``1 - t**decay_rate``; the update
    ``g / sqrt(V)`` is clipped to RMS ``clip_threshold`` and scaled by ``lr_t``; with ``beta1`` it is smoothed
    by a first moment ``exp_avg``; weight decay subtracts ``weight_decay * lr_t * p``.

    8-bit: with ``state_format="blockwise8"`` (``optim_bits=8``) and ``beta1`` set, the first moment ``exp_avg`` of
    tensors with at least ``min_8bit_size`` elements is kept in bitsandbytes' 8-bit blockwise format (keys
    ``exp_avg``, ``exp_avg_qmap``, ``exp_avg_absmax``). The factored statistics are tiny and stay fp32; without
    ``beta1`` there is no per-element state to quantize, so the state format changes nothing. Adafactor runs with
    fp32 and blockwise8 state (its Triton kernel reads those two).

    Args:
        params: iterable of parameters or parameter groups.
        lr (float | None, default None): external learning rate; must be None when ``relative_step`` (a
            scheduler may later write the relative step there; an lr set to exactly 0 takes no step).
        eps (tuple[float, float], default (1e-30, 1e-3)): regularizer added to the squared gradient, and the
            floor of the parameter scale.
        clip_threshold (float, default 1.0): threshold of the root-mean-square of the final update.
        decay_rate (float, default -0.8): exponent of the second-moment decay ``1 - t**decay_rate``.
        beta1 (float | None, default None): first-moment coefficient; None keeps no first moment.
        weight_decay (float, default 0.0): weight decay, scaled by the step's learning rate.
        scale_parameter (bool, default True): scale the learning rate by the parameter's RMS.
        relative_step (bool, default True): use the time-dependent relative step instead of ``lr``.
        warmup_init (bool, default False): warm the relative step up from 1e-6 (needs ``relative_step``).
    """

    definition = ADAFACTOR
    pages = False
    supported_formats = ("fp32", "blockwise8")  # the Triton kernel reads an 8-bit or fp32 first moment

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        **options,
    ) -> None:
        if lr is not None and relative_step:
            raise ValueError("Cannot combine a manual lr with relative_step=True; pass relative_step=False or lr=None")
        if warmup_init and not relative_step:
            raise ValueError("warmup_init=True requires relative_step=True")
        if lr is None and not relative_step:
            raise ValueError("relative_step=False needs an explicit lr")
        defaults = dict(
            lr=lr, eps=as_tuple(eps), clip_threshold=clip_threshold, decay_rate=decay_rate, beta1=beta1,
            weight_decay=weight_decay, scale_parameter=bool(scale_parameter), relative_step=bool(relative_step),
            warmup_init=bool(warmup_init),
        )
        super().__init__(params, defaults, **options)

    def __setattr__(self, name: str, value) -> None:
        """Refuse a torch lr scheduler on relative-step groups (see :data:`SCHEDULER_REFUSAL`).

        Every ``torch.optim.lr_scheduler.LRScheduler`` wraps its optimizer's ``step`` (``optimizer.step =
        wrapper``) while it is built, after it has only read the groups and before it computes any learning rate;
        on a relative-step group that computation would fail inside the scheduler (``NoneType * float``), scale
        nothing, or write ``lr=0.0`` (transformers' ``AdafactorSchedule``), which this Adafactor reads as "take
        no step". :class:`RelativeStepSchedule` announces itself first. (A param group cannot refuse it itself:
        torch.compile needs plain dicts there.)"""
        if (name == "step" and getattr(value, "_wrapped_by_lr_sched", False)
                and not self.__dict__.get("_relative_step_schedule")
                and any(group.get("relative_step") for group in self.param_groups)):
            for group in self.param_groups:  # the starting lr the refused scheduler recorded
                if group.get("relative_step"):
                    group.pop("initial_lr", None)
            raise ValueError(SCHEDULER_REFUSAL)
        super().__setattr__(name, value)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        if group["lr"] is not None:
            check_lr(group["lr"])
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"eps must be a tuple of two floats (eps1, eps2), got {eps!r}")
        for index, value in enumerate(eps):
            if isinstance(value, (int, float)) and value < 0:  # torch.optim.Adafactor's words for what it refuses
                raise ValueError(f"epsilon{index + 1} should be >= 0 but is: {value} (eps[{index}]); expected a value "
                                 "in (0.0, inf)")
            check_eps(value, f"eps[{index}]", f"epsilon{index + 1}")
        check_real("clip_threshold", group["clip_threshold"], low=0.0, low_open=True)
        check_real("decay_rate", group["decay_rate"], high=0.0, high_open=True)
        if group["beta1"] is not None:
            check_beta("beta1", group["beta1"])
        check_weight_decay(group["weight_decay"])


register_algorithm(ADAFACTOR, Adafactor, variants=False)


class RelativeStepSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The scheduler for ``Adafactor(relative_step=True)``, which computes its own step size.

    It changes nothing; it reports the relative step ``min(warmup_init ? 1e-6*t : 1e-2, 1/sqrt(t))`` of the next
    step (before ``scale_parameter``'s per-tensor RMS factor) as each group's ``lr``, so a Trainer can log it. The
    optimizer ignores ``group["lr"]`` in this mode, so no scheduler can change its math.
    """

    def __init__(self, optimizer: Adafactor, last_epoch: int = -1) -> None:
        for group in optimizer.param_groups:
            if not group["relative_step"]:
                raise ValueError("RelativeStepSchedule needs every param group to have relative_step=True")
        optimizer.__dict__["_relative_step_schedule"] = True  # Adafactor.__setattr__ lets this scheduler wrap step
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = self.last_epoch + 1  # the optimizer step the reported value applies to
        groups = self.optimizer.param_groups
        return [min(1e-6 * step if g["warmup_init"] else 1e-2, 1.0 / math.sqrt(step)) for g in groups]
