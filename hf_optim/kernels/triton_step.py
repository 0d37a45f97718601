"""One optimizer step of a param group on the Triton kernels: a launch (or one per pass) for all its tensors.

Called by ``HfOptimizer.step`` for the parameters :mod:`hf_optim.kernels.backend` assigns to Triton. The
scalars (learning rate, bias corrections, schedules) come from the algorithm's own ``_hyper`` on the host, as in
the PyTorch path, and travel as kernel arguments: nothing here reads a device value, so a step never waits for
the GPU, and changing scalars never recompiles. Tensors whose step counters differ (a parameter that had no
gradient for a while) go in separate launches, one per distinct step.

Adafactor runs six passes (``triton_adafactor``: statistics, finalize, update, clip, apply), each one launch
over every tensor of the batch.

What takes the PyTorch path instead, with identical math: non-contiguous parameters; for LAMB and Adafactor,
sharded (DTensor) parameters, whose norms and statistics need a reduction across shards; for Adafactor, empty
parameters (nothing to reduce); optimizers whose class replaces the algorithm's ``rule`` or ``_update`` (the
kernels would not run that code).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch

from hf_optim.kernels import rounding, triton_adafactor, triton_lamb, triton_rules
from hf_optim.kernels import triton_multi_tensor as mt
from hf_optim.kernels.dynamic_map import dynamic_map, encoder_table
from hf_optim.kernels.triton_elementwise import TILE_BLOCKS, fused_update

LAMB_SCRATCH_NUMEL = 1 << 26
"""Most elements of LAMB directions held at once (256 MiB of fp32): larger groups run in several buckets."""

CACHE_ATTR = "_hf_optim_triton_plans"


@functools.cache
def _maps(device: torch.device) -> tuple[torch.Tensor, ...]:
    return (dynamic_map(True, device), dynamic_map(False, device), encoder_table(True, device),
            encoder_table(False, device))


def supported(optimizer, param: torch.Tensor, sharded: bool) -> bool:
    """Whether ``param`` (a local tensor) can be updated by this optimizer's Triton kernels."""
    algorithm = optimizer.algorithm
    if algorithm not in (*triton_rules.RULES, "adafactor") or not param.is_contiguous():
        return False
    if _customized(type(optimizer)):
        return False
    if algorithm in ("lamb", "adafactor") and sharded:
        return False
    if algorithm == "adafactor" and param.numel() == 0:  # no rows to reduce; the PyTorch path handles it
        return False
    return param.dtype in (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _customized(cls: type) -> bool:
    """Whether a subclass replaced the algorithm's rule or update (its kernels would not run that code)."""
    base = next(klass for klass in cls.__mro__ if "algorithm" in vars(klass))
    return cls._update is not base._update or cls.rule is not base.rule


def step_group(optimizer, group: dict, group_index: int, items: list, ordinals=None) -> None:
    """Update ``items`` = [(param, grad, state), ...] (local, contiguous tensors, state created, step counted).
    ``ordinals`` (``id(state)`` -> parameter ordinal), when the group has ``bf16_stochastic_round``: bf16
    parameters are rounded stochastically (:mod:`hf_optim.kernels.triton_rounding`)."""
    cache = optimizer.__dict__.get(CACHE_ATTR)
    if cache is None:
        cache = optimizer.__dict__[CACHE_ATTR] = mt.PlanCache()
    batches = defaultdict(list)
    for param, grad, state in items:
        batches[(param.device, state["step"])].append((param, grad.contiguous(), state))
    for (device, step), batch in batches.items():
        stochastic = None
        if ordinals is not None:
            values = [ordinals[id(state)] for _, _, state in batch]
            stochastic = (cache.table(("bf16 ordinals", group_index, device, step), values, torch.int64, device),
                          mt.to_device(rounding.key_tensor(group["bf16_stochastic_round_seed"], step), torch.int64,
                                       device))
        with _on(device):
            if optimizer.algorithm == "adafactor":
                triton_adafactor.step(optimizer, group, (group_index, device, step), batch, step, cache, device,
                                      stochastic)
            else:
                _step_batch(optimizer, group, group_index, device, step, batch, cache, stochastic)


def _on(device: torch.device):
    """Make ``device`` current while launching: Triton launches on the current device and stream."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "xpu":
        return torch.xpu.device(device)
    return contextlib.nullcontext()


def _step_batch(optimizer, group, group_index, device, step, batch, cache, stochastic=None) -> None:
    """One launch (LAMB: three per bucket) over tensors on one device sharing one step counter."""
    hyper = triton_rules.hyper_tuple(optimizer.algorithm, optimizer._hyper(group, step))
    key = (group_index, device, step)
    if optimizer.algorithm == "lamb":
        _lamb(optimizer, group, key, batch, hyper, cache, device, stochastic)
        return
    launch = cache.launch(key, batch, optimizer.state_specs, TILE_BLOCKS, device)
    signed = mt.row_signedness(optimizer.state_specs)
    rows = sum(spec.rows for spec in optimizer.state_specs)
    fused_update(triton_rules.RULES[optimizer.algorithm], rows, signed, launch, _maps(device), hyper, device=device,
                 stochastic=stochastic)


def _buckets(batch: list, limit: int) -> list[list]:
    buckets, current, size = [], [], 0
    for item in batch:
        n = item[0].numel()
        if current and size + n > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        buckets.append(current)
    return buckets


def _lamb(optimizer, group, key, batch, hyper, cache, device, stochastic=None) -> None:
    """LAMB: update pass (moments, direction, per-tile sums of squares), norm pass, apply pass."""
    specs = optimizer.state_specs
    adapt = group["weight_decay"] != 0 or group["use_nvlamb"]
    first = 0  # index in the batch of the bucket's first tensor
    for index, bucket in enumerate(_buckets(batch, LAMB_SCRATCH_NUMEL)):
        total = sum(param.numel() for param, _, _ in bucket)
        scratch = torch.empty(total, dtype=torch.float32, device=device)
        out_addresses, offset = [], 0
        for param, _, _ in bucket:
            out_addresses.append(scratch.data_ptr() + 4 * offset)
            offset += param.numel()
        launch = cache.launch((*key, index), bucket, specs, TILE_BLOCKS, device, out_addresses)
        partials = torch.empty(2 * launch.num_tiles, dtype=torch.float32, device=device)
        fused_update(triton_rules.lamb, 2, mt.row_signedness(specs), launch, _maps(device), hyper,
                     write_out=True, partials=partials, device=device)
        ratios = torch.empty(len(bucket), dtype=torch.float32, device=device)
        triton_lamb.trust_ratios(launch, partials, ratios, adapt=adapt, max_trust_ratio=group["max_trust_ratio"],
                                 device=device)
        rounding_args = None
        if stochastic is not None:  # this bucket's slice of the batch's ordinals
            rounding_args = (stochastic[0][first : first + len(bucket)], stochastic[1])
        first += len(bucket)
        triton_lamb.apply(launch, ratios, group["lr"], device, rounding_args)
