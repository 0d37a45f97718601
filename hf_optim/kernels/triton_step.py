"""One optimizer step of a param group on the Triton kernels: a launch (or one per pass) for all its tensors.

Called by ``HfOptimizer.step`` for the parameters :mod:`hf_optim.kernels.backend` assigns to Triton. Everything
algorithm-specific comes from the optimizer's description (``definition``, an
:class:`~hf_optim.kernels.algorithm.Algorithm`): its Triton rule, its scalars (``hyper_at``, computed on the host
as in the PyTorch path, passed as kernel arguments in the field order of its ``hyper`` class: nothing here reads a
device value, so a step never waits for the GPU, and changing scalars never recompiles) and its
:class:`~hf_optim.kernels.algorithm.TritonPlan`: one launch of the fused elementwise kernel, or the algorithm's own
passes (LAMB: ``triton_lamb.step``; Adafactor: ``triton_adafactor.step``). Tensors whose step counters differ (a
parameter that had no gradient for a while) go in separate launches, one per distinct step; so do tensors whose
kernels are specialized differently (parameter or gradient dtype, state formats: :func:`kernel_group`), since each
compiled kernel holds exactly one such combination.

What takes the PyTorch path instead, with identical math: non-contiguous parameters; algorithms with no Triton
rule or plan; shards of sharded (DTensor) parameters when the plan reduces over the whole tensor (LAMB's norms,
Adafactor's statistics); empty parameters when the plan cannot take them (Adafactor: nothing to reduce);
optimizers whose class replaces the algorithm's ``rule`` or ``_update`` (the kernels would not run that code);
tensors of 2^31 elements or more (the kernels index elements with 32-bit offsets).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import defaultdict

import torch

from hf_optim.kernels import rounding, triton_guard
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.algorithm import Algorithm, kernel_scalars, resolve
from hf_optim.kernels.triton_elementwise import FusedConfig, format_label
from hf_optim.kernels.triton_elementwise import launch as launch_fused
from hf_optim.kernels.triton_tile import BF16, DTYPE_NAMES, dtype_code

CACHE_ATTR = "_hf_optim_triton_plans"
MAX_NUMEL = (1 << 31) - 1
"""Largest tensor the kernels index (32-bit element offsets); larger ones take the PyTorch path."""


def supported(optimizer, param: torch.Tensor, sharded: bool) -> bool:
    """Whether ``param`` (a local tensor) can be updated by this optimizer's Triton kernels."""
    algorithm: Algorithm | None = getattr(optimizer, "definition", None)
    if algorithm is None or not algorithm.runs_on_triton or not param.is_contiguous():
        return False
    if _customized(type(optimizer)):
        return False
    plan = algorithm.triton_plan
    if (sharded and not plan.shards) or (param.numel() == 0 and not plan.empty) or param.numel() > MAX_NUMEL:
        return False
    return param.dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _customized(cls: type) -> bool:
    """Whether a subclass replaced the algorithm's rule or update (its kernels would not run that code)."""
    base = next(klass for klass in cls.__mro__ if "definition" in vars(klass))
    return cls._update is not base._update or cls.rule is not base.rule


def kernel_group(specs, param: torch.Tensor, grad: torch.Tensor, state: dict) -> tuple:
    """What a tensor's kernels are specialized on: ``(parameter dtype code, gradient dtype code, format code of each
    state row, aligned)`` (rows of the slots its state holds, a stacked slot giving one per row; ``aligned``: every
    address the kernels stream is 16-byte aligned, which whole tiles need for vector accesses. An AdEMAMix state's
    second row is not when ``n`` is not a multiple of 16: such tensors get launches of their own, so that they do
    not take the vector accesses away from the rest)."""
    present = tuple(spec for spec in specs if spec.key in state)
    rows = mt.state_rows(state, present)
    aligned = all(address % 16 == 0 for address in (param.data_ptr(), grad.data_ptr(), *(row[0] for row in rows)))
    return dtype_code(param.dtype), dtype_code(grad.dtype), tuple(row[2] for row in rows), aligned


def step_group(optimizer, group: dict, group_index: int, items: list, ordinals=None) -> list:
    """Update ``items`` = [(param, grad, state), ...] (local, contiguous tensors, state created, step counted).
    ``ordinals`` (``id(state)`` -> parameter ordinal), when the group has ``bf16_stochastic_round``: bf16
    parameters are rounded stochastically (:mod:`hf_optim.kernels.triton_rounding`).

    Tensors go in batches of one device, one step counter and one kernel group (:func:`kernel_group`): each batch
    is one run of the algorithm's kernels, compiled for exactly its dtypes and formats, through
    :mod:`hf_optim.kernels.triton_guard` (every kernel of the batch compiled and loaded before any launches).

    Returns the items it did NOT update, untouched: those of kernel configurations that failed to compile or load
    on their device; the caller runs them on the PyTorch path."""
    cache = optimizer.__dict__.get(CACHE_ATTR)
    if cache is None:
        cache = optimizer.__dict__[CACHE_ATTR] = mt.PlanCache()
    algorithm: Algorithm = optimizer.definition
    plan = algorithm.triton_plan
    batches = defaultdict(list)
    for param, grad, state in items:
        grad = grad.contiguous()
        kinds = kernel_group(algorithm.slots, param, grad, state)
        batches[(param.device, state["step"], kinds)].append((param, grad, state))
    skipped = []
    for (device, step, kinds), batch in batches.items():
        rounded = ordinals is not None and kinds[0] == BF16.value
        config = configuration(algorithm, kinds, stochastic=rounded)
        if triton_guard.failed(config, device):
            skipped.extend(batch)
            continue
        hyper = optimizer._hyper(group, step)
        key = (group_index, device, step, kinds)
        stochastic = None
        if rounded:
            values = [ordinals[id(state)] for _, _, state in batch]
            stochastic = (cache.table(("bf16 ordinals", *key), values, torch.int64, device),
                          mt.to_device(rounding.key_tensor(group["bf16_stochastic_round_seed"], step), torch.int64,
                                       device))
        if plan.elementwise:
            work = functools.partial(_elementwise, algorithm, key, kinds, batch, hyper, cache, device, stochastic)
        else:
            work = functools.partial(resolve(plan.step), optimizer, algorithm, group, key, batch, step, hyper, cache,
                                     device, stochastic)
        with _on(device):
            if not triton_guard.run(config, device, work):
                skipped.extend(batch)
    return skipped


def configuration(algorithm: Algorithm, kinds: tuple, stochastic: bool) -> triton_guard.KernelConfig:
    """The kernel configuration of a batch (:mod:`triton_guard`): the fused kernel with the algorithm's rule, or its
    own passes, specialized for the batch's kernel group (:func:`kernel_group`) and bf16 stochastic rounding; its
    whole-tile and partial-tile kernels (and LAMB's or Adafactor's other passes) are prepared together."""
    kind = "fused" if algorithm.triton_plan.elementwise else "passes"
    param_dtype, grad_dtype, formats, aligned = kinds
    grads = "" if grad_dtype == param_dtype else f" ({DTYPE_NAMES[grad_dtype]} gradients)"
    states = "/".join(sorted({format_label(code) for code in formats})) or "no state"
    label = (f"{kind}/{algorithm.name} {DTYPE_NAMES[param_dtype]}{grads} {states}"
             f"{'' if aligned else ' unaligned'}{' (bf16 stochastic rounding)' if stochastic else ''}")
    return triton_guard.KernelConfig((kind, algorithm.name, *kinds, stochastic), label)


def _on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current device and stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "xpu":
        return torch.xpu.device(device)
    return contextlib.nullcontext()


def fused_config(algorithm: Algorithm, kinds: tuple, device: torch.device, *, stochastic: bool,
                 write_out: bool = False) -> FusedConfig:
    """The fused kernel's configuration for a batch of kernel group ``kinds`` on ``device`` (whole tiles: the
    launch makes the partial-tile twin)."""
    param_dtype, grad_dtype, formats, aligned = kinds
    signed = mt.row_signedness(algorithm.slots)[: len(formats)]
    return FusedConfig(algorithm.name, resolve(algorithm.triton_rule), formats, signed, param_dtype, grad_dtype,
                       full=True, stochastic=stochastic, write_out=write_out, aligned=aligned,
                       arch=device_arch(device))


@functools.cache
def device_arch(device: torch.device) -> int:
    """CUDA compute capability ``major * 10 + minor`` of ``device`` (the kernels' tile width and register limit
    depend on it); 0 for other devices (the interpreter, ROCm, XPU): no NVIDIA-specific choice."""
    if device.type == "cuda" and not torch.version.hip:
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor
    return 0


def _elementwise(algorithm: Algorithm, key, kinds, batch, hyper, cache, device, stochastic=None) -> None:
    """The fused kernel over tensors of one kernel group on one device sharing one step counter: a launch for the
    whole tiles, one for the partial ones (``stochastic``: bf16 stochastic rounding's ``(ordinals, key)``)."""
    config = fused_config(algorithm, kinds, device, stochastic=stochastic is not None)
    launch = cache.launch(key, batch, algorithm.slots, config.tile_blocks, device)
    for whole, table, count in launch.tables():
        launch_fused(dataclasses.replace(config, full=whole, aligned=config.aligned and launch.aligned), launch.meta,
                     table, count, kernel_scalars(hyper), device, stochastic=stochastic)
