"""Whether the sharding a launch asked for took effect.

``accelerate launch --config_file recipes/accelerate/fsdp2.yaml`` on CPU processes sets ``ACCELERATE_USE_FSDP``
for them, but accelerate builds FSDP only for GPU processes (its ``AcceleratorState`` turns a FSDP config into
``DistributedType.FSDP`` only from ``MULTI_GPU`` and the like): on CPU it wraps the model in DDP, and the run
trains with every rank holding and stepping all parameters, without a word. :func:`unapplied_sharding` names
that case so that the run can say it in one line.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


def fsdp_requested(args: Any) -> str | None:
    """Where FSDP was asked for (``TrainingArguments.fsdp`` or an ``accelerate launch`` FSDP config), or None."""
    if getattr(args, "fsdp", None):
        return f"TrainingArguments.fsdp={args.fsdp!r}"
    if _truthy(os.environ.get("ACCELERATE_USE_FSDP")):
        return "the accelerate config (ACCELERATE_USE_FSDP=true)"
    return None


def fsdp_applied(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP: FSDP2 (``fully_shard``: DTensor parameters) or FSDP1 modules."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed support
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def unapplied_sharding(args: Any, model: nn.Module | None, world_size: int) -> str | None:
    """One line saying that the FSDP sharding asked for did not take effect on ``model``, or None."""
    where = fsdp_requested(args)
    if where is None or model is None or fsdp_applied(model):
        return None
    count = sum(p.numel() for p in model.parameters())
    devices = {p.device.type for p in model.parameters()}
    why = "accelerate applies FSDP to GPU processes only, and these run on the CPU" if devices <= {"cpu"} \
        else "the model was not wrapped"
    return (f"FSDP was asked for by {where} but did not take effect: no parameter is sharded ({why}), so each of "
            f"the {world_size} processes holds and steps all {count:,} parameters, as under DDP")
