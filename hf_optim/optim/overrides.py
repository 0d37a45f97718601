"""Per-parameter settings that override a param group's: hf_optim's attribute and bitsandbytes' GlobalOptimManager.

Two sources, merged in this order (later wins):

1. ``p.hf_optim_overrides`` (:data:`PARAM_OVERRIDES_ATTR`), hf_optim's own mechanism (the Trainer integration sets
   ``{"optim_bits": 32}`` on embedding weights), or the same dict recorded at the parameter's position when the
   optimizer was built (accelerate's FSDP2 preparation swaps parameters for new ones at the same place).
2. bitsandbytes' ``GlobalOptimManager``, when ``bitsandbytes`` has been imported (hf_optim never imports it
   itself: a program that uses the manager has imported it already). It is read the way bitsandbytes'
   ``Optimizer8bit.get_config`` reads it: the config registered at the parameter's ``(group index, index)`` by
   ``register_parameters``, then the config keyed by ``id(p)`` from ``override_config``, where a module override
   (``register_module_override``, which ``bnb.nn.StableEmbedding`` and ``bnb.nn.Embedding`` use for their weight)
   replaces the ``override_config`` one, as bitsandbytes' ``check_overrides`` does. The manager is only read,
   never changed.

Keys that decide how state is created (``optim_bits``, ``state_format``, ``min_8bit_size``) take effect when a
parameter's state is created; every other key is a hyperparameter of the group (``lr``, ``betas``, ...) and applies
at every step, as in bitsandbytes, whose optimizers read the manager at every step. A key the optimizer does not
have is an error.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Mapping
from typing import Any

import torch

PARAM_OVERRIDES_ATTR = "hf_optim_overrides"
"""A parameter attribute holding per-parameter settings (e.g. ``{"optim_bits": 32}`` for embeddings) that
override its group's, like bitsandbytes' ``GlobalOptimManager`` overrides."""

STATE_CREATION_KEYS = frozenset({"optim_bits", "state_format", "min_8bit_size"})
"""Override keys that only matter when a parameter's state is created."""

NOT_OVERRIDABLE = frozenset({"params", "param_names"})


def bitsandbytes_manager() -> Any | None:
    """bitsandbytes' ``GlobalOptimManager`` instance when bitsandbytes is imported and it holds any override."""
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    manager_cls = getattr(module, "GlobalOptimManager", None)
    manager = getattr(manager_cls, "_instance", None)
    if manager is None:
        return None
    if not (manager.pid2config or manager.index2config or manager.module_weight_config_triple):
        return None
    return manager


def module_overrides(manager) -> dict[int, dict]:
    """``id(weight) -> config`` of the manager's module overrides (the last registration of a weight wins)."""
    found = {}
    for module, attr, config in manager.module_weight_config_triple:
        weight = getattr(module, attr, None)
        if isinstance(weight, torch.Tensor):
            found[id(weight)] = config
    return found


def bitsandbytes_config(manager, by_module: dict[int, dict], p: torch.Tensor, position: tuple[int, int]) -> dict:
    """The manager's settings for parameter ``p`` at ``position`` (group index, index), merged as bitsandbytes
    merges them: a module override replaces both other sources (bitsandbytes' ``check_overrides`` writes it over
    them), else the ``id(p)`` config is applied over the positional one."""
    if id(p) in by_module:
        return dict(by_module[id(p)])
    config = dict(manager.index2config.get(position, {}))
    config.update(manager.pid2config.get(id(p), {}))
    return config


def check_override_keys(overrides: Mapping, group: Mapping, owner: str, where: str) -> None:
    """Refuse override keys that are not hyperparameters of ``group`` (naming the closest valid ones)."""
    valid = sorted(k for k in group if k not in NOT_OVERRIDABLE)
    for key in overrides:
        if key in NOT_OVERRIDABLE or key not in group:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"{where} overrides {key!r}, which {owner} does not have{hint} "
                f"(overridable: {', '.join(valid)})"
            )


def update_overrides(overrides: Mapping | None) -> dict:
    """The part of ``overrides`` that changes how a step updates (everything but the state-creation keys)."""
    if not overrides:
        return {}
    return {k: v for k, v in overrides.items() if k not in STATE_CREATION_KEYS}
