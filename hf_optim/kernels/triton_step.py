"""One optimizer step of a param group on the Triton kernels: a launch (or one per pass) for all its tensors.

Called by ``HfOptimizer.step`` for the parameters :mod:`hf_optim.kernels.backend` assigns to Triton. Everything
algorithm-specific comes from the optimizer's description (``definition``, an
:class:`~hf_optim.kernels.algorithm.Algorithm`): its Triton rule, its scalars (``hyper_at``, computed on the host
as in the PyTorch path, passed as kernel arguments in the field order of its ``hyper`` class: nothing here reads a
device value, so a step never waits for the GPU, and changing scalars never recompiles) and its
:class:`~hf_optim.kernels.algorithm.TritonPlan`: one launch of the fused elementwise kernel, or the algorithm's own
passes (LAMB: ``triton_lamb.step``; Adafactor: ``triton_adafactor.step``). Tensors whose step counters differ (a
parameter that had no gradient for a while) go in separate launches, one per distinct step.

What takes the PyTorch path instead, with identical math: non-contiguous parameters; algorithms with no Triton
rule or plan; shards of sharded (DTensor) parameters when the plan reduces over the whole tensor (LAMB's norms,
Adafactor's statistics); empty parameters when the plan cannot take them (Adafactor: nothing to reduce);
optimizers whose class replaces the algorithm's ``rule`` or ``_update`` (the kernels would not run that code).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch

from hf_optim.kernels import rounding, triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.algorithm import Algorithm, kernel_scalars, resolve
from hf_optim.kernels.triton_elementwise import TILE_BLOCKS, fused_update, maps_table

CACHE_ATTR = "_hf_optim_triton_plans"


def supported(optimizer, param: torch.Tensor, sharded: bool) -> bool:
    """Whether ``param`` (a local tensor) can be updated by this optimizer's Triton kernels."""
    algorithm: Algorithm | None = getattr(optimizer, "definition", None)
    if algorithm is None or not algorithm.runs_on_triton or not param.is_contiguous():
        return False
    if _customized(type(optimizer)):
        return False
    plan = algorithm.triton_plan
    if (sharded and not plan.shards) or (param.numel() == 0 and not plan.empty):
        return False
    return param.dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _customized(cls: type) -> bool:
    """Whether a subclass replaced the algorithm's rule or update (its kernels would not run that code)."""
    base = next(klass for klass in cls.__mro__ if "definition" in vars(klass))
    return cls._update is not base._update or cls.rule is not base.rule


def step_group(optimizer, group: dict, group_index: int, items: list, ordinals=None) -> list:
    """Update ``items`` = [(param, grad, state), ...] (local, contiguous tensors, state created, step counted).
    ``ordinals`` (``id(state)`` -> parameter ordinal), when the group has ``bf16_stochastic_round``: bf16
    parameters are rounded stochastically (:mod:`hf_optim.kernels.triton_rounding`).

    Returns the items it did NOT update, untouched: those of kernel configurations that failed to compile or load
    on their device (:mod:`hf_optim.kernels.triton_guard`); the caller runs them on the PyTorch path."""
    cache = optimizer.__dict__.get(CACHE_ATTR)
    if cache is None:
        cache = optimizer.__dict__[CACHE_ATTR] = mt.PlanCache()
    algorithm: Algorithm = optimizer.definition
    plan = algorithm.triton_plan
    config = configuration(algorithm, stochastic=ordinals is not None)
    batches = defaultdict(list)
    for param, grad, state in items:
        batches[(param.device, state["step"])].append((param, grad.contiguous(), state))
    skipped = []
    for (device, step), batch in batches.items():
        if triton_guard.failed(config, device):
            skipped.extend(batch)
            continue
        hyper = optimizer._hyper(group, step)
        key = (group_index, device, step)
        stochastic = None
        if ordinals is not None:
            values = [ordinals[id(state)] for _, _, state in batch]
            stochastic = (cache.table(("bf16 ordinals", group_index, device, step), values, torch.int64, device),
                          mt.to_device(rounding.key_tensor(group["bf16_stochastic_round_seed"], step), torch.int64,
                                       device))
        if plan.elementwise:
            work = functools.partial(_elementwise, algorithm, key, batch, hyper, cache, device, stochastic)
        else:
            work = functools.partial(resolve(plan.step), optimizer, algorithm, group, key, batch, step, hyper, cache,
                                     device, stochastic)
        with _on(device):
            if not triton_guard.run(config, device, work):
                skipped.extend(batch)
    return skipped


def configuration(algorithm: Algorithm, stochastic: bool) -> triton_guard.KernelConfig:
    """The kernel configuration of an algorithm's Triton step (:mod:`triton_guard`): the fused kernel with its rule,
    or its own passes, each with or without bf16 stochastic rounding (a compile-time switch of the kernels)."""
    kind = "fused" if algorithm.triton_plan.elementwise else "passes"
    label = f"{kind}/{algorithm.name}" + (" (bf16 stochastic rounding)" if stochastic else "")
    return triton_guard.KernelConfig((kind, algorithm.name, stochastic), label)


def _on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current device and stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "xpu":
        return torch.xpu.device(device)
    return contextlib.nullcontext()


def _elementwise(algorithm: Algorithm, key, batch, hyper, cache, device, stochastic=None) -> None:
    """One launch of the fused kernel over tensors on one device sharing one step counter (``stochastic``: bf16
    stochastic rounding's ``(ordinals, key)``, see :func:`fused_update`)."""
    specs = algorithm.slots
    launch = cache.launch(key, batch, specs, TILE_BLOCKS, device)
    fused_update(resolve(algorithm.triton_rule), algorithm.state_rows, mt.row_signedness(specs), launch,
                 maps_table(device), kernel_scalars(hyper), device=device, stochastic=stochastic)
