"""Muon (Jordan et al. 2024) with ``torch.optim.Muon`` semantics, in every state format and paged, with an AdamW
rule for the parameters Muon is not for (embeddings, LM head, norms, biases) in the same optimizer.

A Muon step has two parts. The momentum update is elementwise and goes through the state formats like every other
algorithm (decode the momentum, :func:`muon_momentum_rule` in fp32, encode): the one ``state1`` slot (signed) is
what 8-bit and 4-bit Muon store in 1 or 0.5 bytes per element. The orthogonalization (:func:`newton_schulz`) is five
bf16 matmul iterations on the whole matrix, batched over the same-shaped matrices of a param group (the projections
of every layer share shapes: one ``baddbmm`` per iteration instead of one ``addmm`` per matrix; on CPU both give the
same bits). The parameter update is torch's: ``p.mul_(1 - lr * wd)`` then ``p.add_(O, alpha=-adjusted_lr)``.

Each param group says which rule its parameters take (``use_muon``: True, False, or None to route each parameter
by its shape and by the marks :func:`hf_optim.optim.muon.routing.route_model` puts on a model's parameters),
so state dicts, paging and formats stay those of one :class:`~hf_optim.optim.base.HfOptimizer`. A parameter under
the AdamW rule keeps bitsandbytes' two AdamW slots (``state1`` signed, ``state2`` unsigned) in the group's format and
steps exactly as :class:`hf_optim.AdamW` (the same rule and scalars).

Non-finite gradient elements follow hf_optim's elementwise convention: their momentum is left as it was and they
enter Newton-Schulz as 0, so one NaN does not turn the whole matrix into NaN (torch.optim.Muon's would).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from hf_optim.core.algorithm import Algorithm
from hf_optim.core.own_update import OwnUpdate
from hf_optim.core.partition import Partition, PartRule
from hf_optim.core.state_store import StateSpec
from hf_optim.formats import StateFormat
from hf_optim.kernels.torch_path import multi_tensor
from hf_optim.numerics import exact_math, rounding
from hf_optim.optim import sharding
from hf_optim.optim._validation import as_tuple, check_betas, check_eps, check_lr, check_real, check_weight_decay
from hf_optim.optim.adamw import ADAMW
from hf_optim.optim.base import HfOptimizer
from hf_optim.optim.muon.newton_schulz import (
    ADJUST_LR_FNS,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    adjusted_lr,
    newton_schulz,
)
from hf_optim.optim.muon.routing import MUON_ROUTE_ATTR, MuonRoutes, route_model, takes_muon
from hf_optim.optim.registry import register_algorithm
from hf_optim.optim.trainer_mapping import TrainerMapping

BATCH_BYTES = 256 << 20
"""Most bytes of fp32 updates orthogonalized in one batched matmul (a larger matrix is a batch alone)."""

MUON_SLOTS = (StateSpec("state1", signed=True),)


class MuonHyper(NamedTuple):
    """The scalars of the momentum update."""

    one_minus_momentum: float  # buf.lerp_(grad, 1 - momentum)
    update_weight: float  # grad.lerp(buf, momentum) with Nesterov; 1.0 without (lerp(grad, buf, 1) is buf exactly)


def muon_momentum_rule(param, grad, states, h: MuonHyper):
    """Muon's momentum on fp32 tensors, as torch.optim.Muon computes it: returns the update to orthogonalize."""
    (buf,) = states
    buf = exact_math.lerp(buf, grad, h.one_minus_momentum)
    update = exact_math.lerp(grad, buf, h.update_weight)
    return update, [buf]


def muon_hyper(group: dict, step: int) -> MuonHyper:
    momentum = group["momentum"]
    return MuonHyper(one_minus_momentum=1.0 - momentum, update_weight=momentum if group["nesterov"] else 1.0)


def _adjust_trainer_kwargs(kwargs: dict, args: Any, betas: list, optim_args: dict, state_format: StateFormat) -> None:
    """The Trainer's AdamW betas and eps go to the AdamW side (``optim_args`` adamw_betas=b1;b2 overrides them);
    Muon's lr adjustment is :data:`TRAINER_ADJUST_LR_FN` (``optim_args`` adjust_lr_fn=... overrides it)."""
    kwargs.update(adamw_betas=(args.adam_beta1, args.adam_beta2), adamw_eps=args.adam_epsilon,
                  adjust_lr_fn=TRAINER_ADJUST_LR_FN)


TRAINER_ADJUST_LR_FN = "match_rms_adamw"
"""The Trainer names' lr adjustment: with it the Trainer's one ``learning_rate`` suits both the Muon and the AdamW
side (Moonshot, arXiv 2502.16982). Measured on the tiny model (``docs/muon_defaults.md``): the best final loss at one
shared lr, and better than AdamW's best at every shared lr from 1e-3 to 1e-2. The class default stays torch's
(None, Keller Jordan's scaling), so ``hf_optim.Muon`` and ``torch.optim.Muon`` agree."""

def muon_label(p: torch.Tensor, group: dict) -> str:
    """``"muon"`` or ``"adamw"``: the rule of parameter ``p`` in ``group`` (its ``use_muon``, else the route the
    Trainer integration marked on it, else its shape)."""
    if group["use_muon"] is not None:
        return "muon" if group["use_muon"] else "adamw"
    return "muon" if takes_muon(getattr(p, MUON_ROUTE_ATTR, None), p.ndim, bool(group["muon_lora"])) else "adamw"


def label_for_mark(route: str | None, ndim: int, kwargs: dict) -> str:
    """The rule of a tensor marked ``route`` (None: unmarked) with ``ndim`` dimensions in a Trainer-built Muon (one
    group, ``use_muon=None``) with constructor ``kwargs``: what the memory estimate prices."""
    return "muon" if takes_muon(route, ndim, bool(kwargs.get("muon_lora", False))) else "adamw"


def mark_model(model: torch.nn.Module, kwargs: dict) -> MuonRoutes:
    """Mark which rule each trainable parameter of ``model`` takes (:func:`route_model`), for the Trainer."""
    return route_model(model, muon_lora=kwargs.get("muon_lora", False))


def muon_group_update(ctx, group: dict, items: list) -> None:
    """The Muon-ruled ``(param, grad, state, full)`` items of a group: batched by the whole matrix's shape (a
    sharded parameter's local part is smaller), each batch through :func:`_muon_batch`."""
    by_shape: dict[tuple[int, ...], list] = {}
    for item in items:
        by_shape.setdefault(tuple(item[3].shape), []).append(item)
    for shape, same in by_shape.items():
        for batch in multi_tensor.consecutive_pieces(same, lambda item: 4 * item[0].numel(), BATCH_BYTES):
            _muon_batch(ctx, group, shape, batch)


def _muon_batch(ctx, group: dict, shape: tuple[int, ...], batch: list) -> None:
    """Momentum of each matrix through its state format, one batched Newton-Schulz of the whole matrices of
    ``shape``, then torch's update.

    A sharded (FSDP2/DTensor) matrix's momentum and update stay on its local part; only the update to
    orthogonalize is all-gathered, every rank runs Newton-Schulz on the whole matrix (the same bits on every
    rank), and keeps its own part of the result: one all-gather per sharded matrix per step, and the
    Newton-Schulz work of every matrix on every rank."""
    updates = torch.empty((len(batch), *shape), dtype=torch.float32, device=batch[0][0].device)
    sharded = [sharding.is_sharded(full) for *_, full in batch]
    for row, (param, grad, state, full), split in zip(updates, batch, sharded):
        hyper = ctx.hyper(group, state["step"])
        if split:
            local = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            ctx.run_rule(param, grad, state, hyper, out=local.view(-1), full=full)
            row.copy_(sharding.gathered(local, full))
        else:
            ctx.run_rule(param, grad, state, hyper, out=row.view(-1))
    orthogonal = newton_schulz(updates, group["ns_coefficients"], group["ns_steps"], group["eps"])
    lr = float(group["lr"])
    step_lr = adjusted_lr(lr, group["adjust_lr_fn"], shape)
    decay = 1 - lr * group["weight_decay"]
    for (param, _, state, full), update, split in zip(batch, orthogonal, sharded):
        if split:
            update = sharding.local_part(update, full)
        stream = ctx.stream(group, state, param)
        if stream is None:
            param.mul_(decay)
            param.add_(update, alpha=-step_lr)
        else:  # bf16 stochastic rounding of the new value, computed in fp32
            values = param.float().mul_(decay).add_(update.float(), alpha=-step_lr)
            rounding.write_rounded(param, values, stream.ordinal, stream.key)


def adamw_settings(group: dict) -> dict:
    """The AdamW hyperparameters of ``group``'s AdamW-ruled parameters, as :func:`adamw_hyper` reads them."""
    lr = group["lr"]
    if group["adamw_lr"] is not None:
        initial = group.get("initial_lr")  # torch's LR schedulers keep it
        # Without a scheduler the AdamW side keeps adamw_lr, except where the group's lr is 0: torch's
        # get/set_optimizer_state_dict create state by a step with lr=0, which must move no weight.
        schedule = float(lr) / float(initial) if initial else float(float(lr) != 0.0)
        lr = group["adamw_lr"] * schedule
    weight_decay = group["weight_decay"] if group["adamw_weight_decay"] is None else group["adamw_weight_decay"]
    return {"lr": float(lr), "betas": group["adamw_betas"], "eps": group["adamw_eps"], "weight_decay": weight_decay}


MUON = Algorithm(
    name="muon",
    class_name="Muon",
    slots=MUON_SLOTS,
    hyper=MuonHyper,
    hyper_at=muon_hyper,
    rule=muon_momentum_rule,
    variant_formats=None,  # every registered format that suits a signed momentum: 32-bit, 8-bit, 4-bit, fp8
    trainer=TrainerMapping(names=None, adjust=_adjust_trainer_kwargs),
    update=OwnUpdate(group=muon_group_update),
    partition=Partition(
        rules=(PartRule("muon", title="Muon"), PartRule("adamw", ADAMW, settings=adamw_settings, title="AdamW")),
        label_of=muon_label,
        mark_attr=MUON_ROUTE_ATTR,
        mark_model=mark_model,
        label_for_mark=label_for_mark,
        setting="use_muon",
    ),
)


class Muon(HfOptimizer):
    """Muon for 2-D hidden matrices, with torch.optim.Muon's math, and AdamW for every other parameter, in one
    optimizer and one state format.

    Muon: ``buf.lerp_(g, 1 - momentum)``; ``u = g.lerp(buf, momentum)`` (Nesterov) or ``buf``; ``O = NS(u)``
    (bf16 Newton-Schulz); ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O``. The momentum is stored in the
    state format (``state_format`` / ``optim_bits``): 8-bit Muon keeps 1 byte per element of state, 4-bit half one.

    Which rule a parameter takes is its param group's ``use_muon``: True (Muon; every parameter must be 2-D), False
    (AdamW, exactly :class:`hf_optim.AdamW`'s step with ``adamw_betas``/``adamw_eps`` and the lr and weight decay
    below), or None (default: per parameter, the route the Trainer integration marked on it, else Muon for 2-D
    tensors and AdamW for the rest; conv and other >2-D weights therefore take AdamW). Every hyperparameter may be
    set per group, as with any torch optimizer.

    Args:
        params: iterable of parameters or parameter groups.
        lr (float, default 1e-3): Muon's learning rate (torch's default); adjusted per matrix by ``adjust_lr_fn``.
        weight_decay (float, default 0.1): decoupled weight decay, ``p *= 1 - lr * weight_decay`` (torch's default).
        momentum (float, default 0.95): momentum factor, in [0, 1].
        nesterov (bool, default True): Nesterov momentum.
        ns_coefficients (tuple[float, float, float], default (3.4445, -4.775, 2.0315)): Newton-Schulz coefficients.
        eps (float, default 1e-7): the norm before Newton-Schulz is clamped at ``eps``.
        ns_steps (int, default 5): Newton-Schulz iterations (1 to 99).
        adjust_lr_fn (str | None, default None): None or ``"original"`` (``lr * sqrt(max(1, A/B))``), or
            ``"match_rms_adamw"`` (``0.2 * lr * sqrt(max(A, B))``, so AdamW's lr carries over).
        use_muon (bool | None, default None): the rule of the group's parameters (see above).
        muon_lora (bool, default False): with ``use_muon=None``, whether parameters marked as LoRA adapters (by the
            Trainer integration) take Muon (True) or AdamW (False). AdamW by default: on the tiny model Muon's
            adapters were level with AdamW's at AdamW's best lr and worse below it (``docs/muon_defaults.md``).
        adamw_lr (float | None, default None): the AdamW rule's learning rate; None: the group's ``lr``. A number is
            scaled by the group's schedule (``lr / initial_lr``, which torch's LR schedulers maintain), so the AdamW
            side follows the same schedule; without a scheduler it is used as it is, except that a group ``lr`` of 0
            stops it too (torch's ``get/set_optimizer_state_dict`` create state by a step with ``lr=0``).
        adamw_betas (tuple[float, float], default (0.9, 0.999)): the AdamW rule's betas.
        adamw_eps (float, default 1e-8): the AdamW rule's eps.
        adamw_weight_decay (float | None, default None): the AdamW rule's weight decay; None: the group's
            ``weight_decay``.
    """

    definition = MUON
    bitsandbytes_order = ("optim_bits", "min_8bit_size", "is_paged")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        use_muon: bool | None = None,
        muon_lora: bool = False,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        **options,
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=bool(nesterov),
            ns_coefficients=as_tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            use_muon=use_muon, muon_lora=bool(muon_lora), adamw_lr=adamw_lr, adamw_betas=as_tuple(adamw_betas),
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
        )
        super().__init__(params, defaults, **options)

    def validate_group(self, group: dict) -> None:
        super().validate_group(group)
        check_lr(group["lr"])
        check_weight_decay(group["weight_decay"])
        check_real("momentum", group["momentum"], low=0.0, high=1.0, label="momentum value")
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, tuple) or len(coefficients) != 3:
            raise ValueError(f"ns_coefficients must be a tuple of 3 floats (a, b, c), got {coefficients!r}")
        for name, value in zip("abc", coefficients):
            check_real(f"ns_coefficients {name}", value)
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
            raise ValueError(f"ns_steps must be an integer from 1 to 99, got {steps!r}")
        check_eps(group["eps"])
        fn = group["adjust_lr_fn"]
        if fn not in ADJUST_LR_FNS:
            close = difflib.get_close_matches(str(fn), [f for f in ADJUST_LR_FNS if f], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"Adjust learning rate function {fn} is not supported (adjust_lr_fn={fn!r}){hint}; "
                             "valid: None, 'original', 'match_rms_adamw'")
        if group["use_muon"] not in (True, False, None):
            raise ValueError(f"use_muon must be True, False or None (route by shape), got {group['use_muon']!r}")
        if group["adamw_lr"] is not None:
            check_lr(group["adamw_lr"])
        check_betas(group["adamw_betas"], 2)
        check_eps(group["adamw_eps"], "adamw_eps")
        if group["adamw_weight_decay"] is not None:
            check_weight_decay(group["adamw_weight_decay"])
        if group["use_muon"]:
            for index, p in enumerate(group["params"]):
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon orthogonalizes 2-D matrices; parameter {index} of a use_muon=True group has shape "
                        f"{tuple(p.shape)}. Put it in a group with use_muon=False (AdamW), or leave use_muon unset "
                        "(None) to route every parameter by its shape"
                    )

    @staticmethod
    def takes_muon(p: torch.Tensor, group: dict) -> bool:
        """Whether parameter ``p`` of ``group`` steps with Muon (else AdamW); see the class docstring."""
        return muon_label(p, group) == "muon"


_family = register_algorithm(MUON, Muon)
Muon4bit, Muon8bit, Muon32bit, PagedMuon, PagedMuon4bit, PagedMuon8bit, PagedMuon32bit = _family.take(
    "Muon4bit", "Muon8bit", "Muon32bit", "PagedMuon", "PagedMuon4bit", "PagedMuon8bit", "PagedMuon32bit")
