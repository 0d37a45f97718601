"""hf_optim optimizers as DeepSpeed ZeRO's client optimizer: what ZeRO hands them, and what hf_optim refuses.

How ZeRO partitions (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py``, ``runtime/bf16_optimizer.py``,
``runtime/zero/stage3.py``): the client optimizer never sees the model's tensors.

- ZeRO-1 and ZeRO-2 flatten each param group's parameters into one buffer, pad it to a multiple of the
  data-parallel size and cut it into equal parts, one per rank; each group's ``params`` becomes that rank's part
  as one 1-D fp32 tensor (``single_partition_of_fp32_groups``; the ZeRO-1 DeepSpeed picks for bf16 weights with
  fp32 gradient accumulation, ``BF16_Optimizer``, hands over flat partitions too). A part holds the tail of one
  tensor, whole tensors and the head of the next; a tensor can straddle two ranks.
- ZeRO-3 cuts every parameter into equal pieces, one per rank, and hands the optimizer the concatenation of this
  rank's pieces (``fp32_partitioned_groups_flat``): every tensor is split across all ranks.

Elementwise algorithms (AdamW, AdEMAMix, Lion, RMSprop) compute each element from that element alone, so they
step a partition as they would the tensors. Algorithms with an update of their own over the whole tensor (LAMB's
trust ratio: norms of the weight and the update; Adafactor's factored row and column statistics; Muon's
Newton-Schulz on the matrix, a hybrid whose parts are chosen by the tensor's shape) and state formats whose scales
span the whole tensor (rank-1 4-bit: row and column maxima) need the tensor's shape and all of its elements. A
partition has neither: no shape, and pieces of tensors whose other pieces live on other ranks. Computing them
right would need the partition's map of tensor pieces from DeepSpeed's internals and, for Adafactor's column
statistics and Muon's matrix, every rank's pieces of each tensor at every step; hf_optim does not do that.
It refuses them before the first step instead: FSDP2 shards along tensor dimensions, and hf_optim reduces
those algorithms' statistics across its shards (``hf_optim.optim.sharding``).

Under ZeRO-Offload accelerate replaces a client optimizer with DeepSpeed's CPU Adam unless the DeepSpeed config
sets ``zero_force_ds_cpu_optimizer: false`` (``accelerate.utils.deepspeed.map_pytorch_optim_to_deepspeed``: it
copies only lr and weight decay, and makes AdamW's decoupled weight decay L2). hf_optim refuses that config
before accelerate builds (and compiles) the replacement.

DeepSpeed logs "You are using ZeRO with an untested optimizer" for every optimizer that is not one of its own
(torch's Adam, AdamW and Adagrad, its fused and CPU optimizers, Lion): the Trainer and accelerate set
``zero_allow_untested_optimizer: true`` for any client optimizer, and the warning follows. What stands behind an
hf_optim optimizer under ZeRO is the check here and the tests in ``tests/integrations/test_deepspeed.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_optim.errors import UserValueError


class DeepSpeedConflict(UserValueError):
    """The Trainer's arguments cannot run as asked under the DeepSpeed config (one line: what and why).
    ``setting``: the training key at fault (``optim`` or ``bf16``)."""

    def __init__(self, message: str, setting: str = "optim") -> None:
        super().__init__(message)
        self.setting = setting


FSDP2_WAY = ("use FSDP2 (accelerate launch --config_file recipes/accelerate/fsdp2.yaml), which shards along tensor "
             "dimensions and reduces these statistics across shards")


def deepspeed_config(args: Any) -> Mapping | None:
    """The DeepSpeed config the Trainer will run with (``TrainingArguments.deepspeed`` or the one ``accelerate
    launch`` passes in its environment), None when DeepSpeed is off."""
    plugin = getattr(args, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    return config if isinstance(config, Mapping) else None


def zero_stage(config: Mapping) -> int:
    """The ZeRO stage of a DeepSpeed config (0: no ZeRO)."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    return stage if isinstance(stage, int) else 0


def offloads_optimizer(config: Mapping) -> bool:
    """Whether the optimizer runs on an offload device (ZeRO-Offload: ``offload_optimizer.device`` cpu or nvme)."""
    device = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def replaces_client_optimizer(config: Mapping) -> bool:
    """accelerate's rule (``Accelerator._prepare_deepspeed``): under optimizer offload it swaps a client optimizer
    for DeepSpeed's CPU optimizer unless ``zero_force_ds_cpu_optimizer`` is false."""
    return offloads_optimizer(config) and bool(config.get("zero_force_ds_cpu_optimizer", True))


def needs_whole_tensors(algorithm: Any, state_format: Any) -> str | None:
    """Why an algorithm / state format cannot step ZeRO's flat partitions (None: it can): an update of its own
    over the whole tensor, a hybrid that routes tensors by shape, or scales that span the whole tensor."""
    if getattr(algorithm, "partition", None) is not None:
        return "it routes each tensor to a rule by its shape, and Newton-Schulz needs the whole matrix"
    if getattr(algorithm, "update", None) is not None:
        return "its update reduces over the whole tensor (norms or factored row/column statistics)"
    if getattr(state_format, "whole_tensor", False):
        return f"the {state_format.name} state format scales by row and column maxima of the whole tensor"
    return None


def zero_problems(label: str, algorithm: Any, state_format: Any, config: Mapping) -> list[str]:
    """What keeps optimizer ``label`` (``hf_optim.LAMB8bit``) from running as itself under DeepSpeed ``config``."""
    problems = []
    stage = zero_stage(config)
    reason = needs_whole_tensors(algorithm, state_format)
    if stage >= 1 and reason is not None:
        problems.append(f"{label} cannot run under DeepSpeed ZeRO-{stage}: ZeRO hands the optimizer flat 1-D "
                        f"partitions of the parameters, not the tensors, and {reason}; {FSDP2_WAY}")
    if replaces_client_optimizer(config):
        problems.append(f"{label} would be replaced by DeepSpeed's CPU Adam: with offload_optimizer on, accelerate "
                        "swaps a client optimizer for it (copying only lr and weight decay, as L2) unless the "
                        "DeepSpeed config sets \"zero_force_ds_cpu_optimizer\": false; add that to the config "
                        "(recipes/accelerate/deepspeed_zero2_offload.json does)")
    return problems


def zero_state_note(state_format: Any, args: Any) -> str | None:
    """What ZeRO changes about quantized state (one line for the log), None when DeepSpeed ZeRO is off or the state
    is fp32. The optimizer steps one partition per param group: its 256-element blocks are blocks of the
    partition, and whether it gets quantized state follows the partition's size (``min_8bit_size``), so the
    embedding's 32-bit state that the Trainer keeps elsewhere cannot be kept apart from the other tensors."""
    config = deepspeed_config(args)
    if config is None or zero_stage(config) < 1 or not getattr(state_format, "quantized", False):
        return None
    return (f"DeepSpeed ZeRO-{zero_stage(config)}: the optimizer steps one flat partition per param group, so "
            f"{state_format.label} state covers whole partitions (blocks span tensors; embeddings are not kept "
            "32-bit; a partition under min_8bit_size elements keeps fp32 state)")


def precision_mismatch(config: Mapping, args: Any) -> tuple[str, str] | None:
    """``(key, one line)`` when the DeepSpeed config turns ``bf16`` or ``fp16`` on and the Trainer's arguments do
    not: the Trainer refuses that (transformers' ``trainer_config_finalize``, a multi-line error when training
    starts); None when they agree or the config says ``auto``."""
    for key in ("bf16", "fp16"):
        enabled = config.get(key, {}).get("enabled", "auto")
        if isinstance(enabled, bool) and enabled and not getattr(args, key, False):
            return key, (f"the DeepSpeed config turns {key} on ({key}.enabled; an accelerate config's mixed_precision: "
                         f"{key}) but the Trainer runs without it ({key}=False; a recipe's {key}: auto is off on "
                         f"CPU): launch with --mixed_precision no, or set training.{key}: true")
    return None


def check_under_deepspeed(label: str, algorithm: Any, state_format: Any, args: Any) -> None:
    """Raise :class:`DeepSpeedConflict` (a ``ValueError``; one line) when the Trainer's DeepSpeed config would change
    the math of ``label`` or replace it; nothing when DeepSpeed is off."""
    config = deepspeed_config(args)
    if config is None:
        return
    problems = zero_problems(label, algorithm, state_format, config)
    if problems:
        raise DeepSpeedConflict(problems[0])
    mismatch = precision_mismatch(config, args)
    if mismatch:
        key, message = mismatch
        raise DeepSpeedConflict(message, setting=key)
