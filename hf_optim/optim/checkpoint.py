"""An :class:`~hf_optim.optim.base.HfOptimizer`'s state dicts: bitsandbytes' format on saving, and the checks and
placement on loading. Functions of the optimizer, called by its ``state_dict`` and ``load_state_dict``.

A saved state dict is torch's, with every quantization tensor of a parameter nested under
``__bnb_optimizer_quant_state__`` and the algorithm's name in each param group, so bitsandbytes loads it and
hf_optim refuses another algorithm's.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from hf_optim.core.state_store import QUANT_KEYS, QUANT_STATE_KEY
from hf_optim.formats import FORMATS, format_for_bits, loaded_format
from hf_optim.formats.base import StateDictError
from hf_optim.optim import shard_layout, sharded_state, sharding
from hf_optim.optim.sharding import local_tensor
from hf_optim.paging import on_host

TORCH_ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""torch.optim.AdamW's (and torchao's AdamW4bit/8bit's) per-parameter state keys."""
ALGORITHM_KEY = "hf_optim_algorithm"
"""Param-group key recording which algorithm wrote a state dict (ignored by bitsandbytes)."""


def state_dict(opt) -> dict[str, Any]:
    """torch's state dict of ``opt``, nested as bitsandbytes' (see the module); hooks as torch runs them."""
    post_hooks = opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_post_hooks = OrderedDict()  # they run below, on the dict this function returns
    try:
        saved = torch.optim.Optimizer.state_dict(opt)
    finally:
        opt._optimizer_state_dict_post_hooks = post_hooks
    params = [p for group in opt.param_groups for p in group["params"]]  # torch's index order
    first_index: dict[int, int] = {}
    for index, p in enumerate(params):
        first_index.setdefault(id(p), index)  # torch numbers a repeated parameter by its first place
    param_indices = {first_index[id(k)] for k in opt.state if isinstance(k, torch.Tensor) and id(k) in first_index}
    saved["state"] = {
        index: _nested(opt, param_state, params[index]) if index in param_indices and isinstance(
            param_state, Mapping) else param_state
        for index, param_state in saved["state"].items()
    }
    saved["param_groups"] = [
        {**opt.to_bitsandbytes_group(group), ALGORITHM_KEY: opt.algorithm} for group in saved["param_groups"]
    ]
    for hook in post_hooks.values():
        replacement = hook(opt, saved)
        if replacement is not None:
            saved = replacement
    return saved


def _nested(opt, param_state: Mapping, param) -> dict:
    param_state = dict(param_state)
    dtensors = sharding.is_dtensor(param)
    if dtensors:  # for torch.distributed.checkpoint: DTensors of the whole tensor's state (sharded_state)
        # (on the parameter's device mesh, paged or not: DCP moves the local shards itself)
        param_state = sharded_state.export_state(opt._rules, param_state, param)
    quant = {k: param_state.pop(k) for k in list(param_state) if k in QUANT_KEYS}
    if quant:
        param_state[QUANT_STATE_KEY] = quant
    if opt.is_paged and not dtensors:  # a paged optimizer's state dict holds CPU tensors: loading needs no GPU memory
        return on_host(param_state)
    return param_state


def check_shape(opt, state_dict: Any) -> None:
    """Refuse what is not a state dict of this optimizer's groups and algorithm."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        found = sorted(map(str, state_dict))[:5] if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise StateDictError(
            f"not an optimizer state dict (expected the keys 'state' and 'param_groups', got {found}); "
            "a model's state dict goes to model.load_state_dict"
        )
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise StateDictError(f"state dict has {len(saved_groups)} parameter groups, this optimizer has {len(groups)}")
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise StateDictError(
                f"parameter group {index} has {len(group['params'])} parameters, "
                f"the state dict's has {len(saved['params'])}"
            )
        saved_algorithm = saved.get(ALGORITHM_KEY)
        if saved_algorithm not in (None, opt.algorithm):
            raise StateDictError(
                f"state dict was saved by hf_optim's {saved_algorithm!r} optimizer; "
                f"{type(opt).__name__} runs {opt.algorithm!r}"
            )


def loaded_states(opt, state_dict: Mapping) -> dict:
    """The per-parameter state of ``state_dict``, checked and copied onto each parameter's device (state buffers
    through the optimizer's allocator, so a paged optimizer's state is paged again). Entries that are not a
    parameter's state (a hook's) are kept as they are, as torch does."""
    id_map = {
        saved_id: p
        for saved_group, group in zip(state_dict["param_groups"], opt.param_groups)
        for saved_id, p in zip(saved_group["params"], group["params"])
    }
    slots = {spec.key for spec in opt._rules.all_slots()}
    new_state: dict = {}
    for saved_id, param_state in state_dict["state"].items():
        if saved_id not in id_map:
            new_state[saved_id] = copy.deepcopy(param_state)
            continue
        p = id_map[saved_id]
        local = local_tensor(p)
        flat = dict(param_state)
        flat.update(flat.pop(QUANT_STATE_KEY, {}))
        part = shard_layout.part_of(p)
        if isinstance(part, shard_layout.Part):  # the whole tensor's state, checked whole
            flat = sharded_state.import_state(opt, flat, p, saved_id, check_loaded)
        else:
            if part is None:  # one process: a checkpoint in the old per-shard layout cannot load here
                sharded_state.refuse_per_shard_state(opt, flat, p, saved_id, shards=1)
            flat = sharding.import_state(flat, p, local, functools.partial(opt._rules.state_dims, state=flat))
            check_loaded(opt, local, flat, saved_id)
        # Copy: the loaded optimizer must never share (and mutate) the caller's tensors.
        new_state[p] = {
            k: (opt._store.allocate.copy_of(v, local.device, local.numel()) if k in slots
                else v.to(local.device, copy=True)) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in flat.items()
        }
        if isinstance(new_state[p].get("step"), torch.Tensor):
            new_state[p]["step"] = int(new_state[p]["step"].item())
    return new_state


LEGACY_BITS = {4: "blockwise4"}
"""What ``optim_bits`` meant in a param group saved without ``state_format`` where its alias has moved since:
hf_optim's 4-bit state was ``blockwise4`` until ``stochastic4`` became the default (a group that records
``state_format`` says which it is)."""


def loaded_groups(opt, state_dict: Mapping) -> list[dict]:
    """The param groups of ``state_dict`` with this optimizer's parameters, keys bitsandbytes named otherwise
    mapped, missing keys from the defaults, each group validated."""
    new_groups = []
    aliases = [f.optim_bits for f in FORMATS.values() if f.optim_bits is not None]  # None: no alias
    for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
        saved = opt.from_bitsandbytes_group(saved)
        merged = {k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", ALGORITHM_KEY)}
        if "state_format" not in merged and merged.get("optim_bits") in LEGACY_BITS:
            merged["state_format"] = LEGACY_BITS[merged["optim_bits"]]  # an older hf_optim's 4-bit dict
        elif "state_format" not in merged and merged.get("optim_bits") in aliases:
            merged["state_format"] = format_for_bits(merged["optim_bits"]).name  # bitsandbytes' (or older) dict
        for key, value in opt.defaults.items():
            merged.setdefault(key, value)
            if isinstance(value, tuple) and isinstance(merged[key], list):
                merged[key] = tuple(merged[key])  # a checkpoint format without tuples (DCP, JSON) saved a list
        merged["params"] = group["params"]
        if "param_names" in group and "param_names" not in merged:
            merged["param_names"] = group["param_names"]
        opt.validate_group(merged)
        new_groups.append(merged)
    return new_groups


def check_loaded(opt, param: torch.Tensor, state: dict, index) -> None:
    """Refuse state of another algorithm, shape or block size before it can corrupt training."""
    where = f"state of parameter {index} (shape {tuple(param.shape)})"
    definition = opt.definition
    own = definition.update.check_loaded if definition.update is not None else None
    if own is not None:
        own(param, state, where)
        return
    specs = opt._rules.slots_of_state(state)
    expected = {spec.key for spec in specs}
    present = {k for k in state if k.startswith("state")}
    foreign = sorted(TORCH_ADAM_KEYS & set(state))
    if foreign and not present:
        subclass = next((type(state[k]).__name__ for k in foreign if type(state[k]) is not torch.Tensor), None)
        source = f"torchao's low-bit AdamW ({subclass} state)" if subclass else "torch.optim.AdamW (or torchao)"
        raise StateDictError(
            f"{where} has {foreign}: a state dict of {source}, not of hf_optim or bitsandbytes "
            f"(slots {sorted(expected)} with their absmax and qmap). hf_optim does not convert it: torchao keeps "
            "its 4-bit and 8-bit moments as tensor subclasses that need torchao installed to load, with its "
            "own 8-bit map and block scales clipped at 1e-12, and torch's AdamW state is unquantized, in another "
            "layout. Resume the model weights and start the optimizer state afresh, or finish the "
            "run with the optimizer that saved it."
        )
    if present != expected:
        raise StateDictError(
            f"{where} has slots {sorted(present)}, but {type(opt).__name__} ({definition.name}) keeps "
            f"{sorted(expected)}: the state dict was saved by another algorithm"
        )
    for spec in specs:
        fmt = loaded_format(state, spec)
        if fmt is None:
            value = state[spec.key]
            raise StateDictError(
                f"{where}: {spec.key} has dtype {getattr(value, 'dtype', type(value).__name__)}, expected float32 "
                "or uint8 (fp32 values, or quantized codes with their absmax and qmap)"
            )
        fmt.check_loaded(param, state, spec, where)
