"""An :class:`~hf_optim.optim.base.HfOptimizer`'s state outside the process: state dicts in bitsandbytes' format,
the checks on loading one, and pickling (with paged state paged again when unpickled).

:class:`StateDicts` is a mixin of ``HfOptimizer``, placed before ``torch.optim.Optimizer`` in its bases: the
``super()`` calls here reach torch's ``state_dict``, ``__getstate__`` and ``__setstate__``.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hf_optim.kernels.formats import FORMATS, format_for_bits, loaded_format
from hf_optim.kernels.formats.base import StateDictError
from hf_optim.kernels.formats.blockwise8 import one_map_note_per_load
from hf_optim.kernels.state_store import QUANT_KEYS
from hf_optim.kernels.torch_path.flat_state import FlatStates
from hf_optim.optim import sharding
from hf_optim.optim.sharding import local_tensor
from hf_optim.paging import on_host, paging_unavailable_reason, state_allocator

QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"
TORCH_ADAM_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
"""torch.optim.AdamW's (and torchao's AdamW4bit/8bit's) per-parameter state keys."""
ALGORITHM_KEY = "hf_optim_algorithm"
"""Param-group key recording which algorithm wrote a state dict (ignored by bitsandbytes)."""


class StateDicts:
    """Mixin of :class:`~hf_optim.optim.base.HfOptimizer`: state dicts and pickling (see the module)."""

    # ----------------------------------------------------------------------------------------------------
    # Hooks for subclasses: bitsandbytes' param-group keys
    def _to_bnb_group(self, group: dict) -> dict:
        """Add the param-group keys bitsandbytes' namesake reads, so a saved state dict loads there too."""
        return group

    def _from_bnb_group(self, saved: dict) -> dict:
        """Map a bitsandbytes param group's keys to this optimizer's (inverse of :meth:`_to_bnb_group`)."""
        return saved

    def _all_slots(self) -> tuple:
        """Every slot a parameter's state may hold (their buffers are paged; their layouts are sharded): the
        algorithm's; a hybrid optimizer (Muon) returns the union of its rules' slots."""
        return self.state_specs

    def _slots_of_state(self, state: Mapping) -> tuple:
        """The slots one parameter's loaded ``state`` must hold: the algorithm's; a hybrid optimizer picks the set
        of the rule the state was saved under."""
        return self.state_specs

    def _state_dims(self, key: str, ndim: int, state: Mapping | None = None):
        """How state ``key`` of an ``ndim``-dim parameter is laid out, for sharded checkpoints (see
        :func:`hf_optim.optim.sharding.export_state`): the parameter dimension of each state dimension, a
        ``sharding.PerShard`` for state counted on the local shard (absmax vectors, packed 4-bit codes), or None
        for state that is the same on every rank. ``state`` (the parameter's state, nested or not) tells the
        slot's format."""
        for spec in self._all_slots():
            if key not in (spec.key, spec.absmax_key):
                continue
            flat = {**state, **state.get(QUANT_STATE_KEY, {})} if state is not None else {}
            fmt = loaded_format(flat, spec) if flat else None
            if key == spec.absmax_key:
                return sharding.PerShard(fmt.num_blocks) if fmt is not None and fmt.block_size else sharding.ABSMAX
            if fmt is not None and fmt.packed:
                return sharding.PerShard(fmt.main_length)
            return (None,) * (spec.rows > 1) + tuple(range(ndim))
        return None

    # ----------------------------------------------------------------------------------------------------
    # State dicts in bitsandbytes' format
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with every quantization tensor nested under ``__bnb_optimizer_quant_state__``.

        Hooks follow torch's contract: state-dict pre-hooks run first, post-hooks receive the final (nested) dict
        and may return a replacement. Entries of ``optimizer.state`` that are not a parameter's state (a hook may
        add some) are passed through unchanged, as torch does.
        """
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # they run below, on the dict this method returns
        try:
            state_dict = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        params = [p for group in self.param_groups for p in group["params"]]  # torch's index order
        first_index: dict[int, int] = {}
        for index, p in enumerate(params):
            first_index.setdefault(id(p), index)  # torch numbers a repeated parameter by its first place
        param_indices = {first_index[id(k)] for k in self.state if isinstance(k, torch.Tensor) and id(k) in first_index}
        nested = {}
        for index, param_state in state_dict["state"].items():
            if index not in param_indices or not isinstance(param_state, Mapping):
                nested[index] = param_state
                continue
            param_state = dict(param_state)
            quant = {k: param_state.pop(k) for k in list(param_state) if k in QUANT_KEYS}
            if quant:
                param_state[QUANT_STATE_KEY] = quant
            if sharding.is_dtensor(params[index]):  # for torch.distributed.checkpoint: DTensors like the param
                # (on the parameter's device mesh, paged or not: DCP moves the local shards itself)
                param_state = sharding.export_state(param_state, params[index],
                                                   functools.partial(self._state_dims, state=param_state))
            elif self.is_paged:  # a paged optimizer's state dict holds CPU tensors: loading needs no GPU memory
                param_state = on_host(param_state)
            nested[index] = param_state
        state_dict["state"] = nested
        state_dict["param_groups"] = [
            {**self._to_bnb_group(group), ALGORITHM_KEY: self.algorithm} for group in state_dict["param_groups"]
        ]
        for hook in post_hooks.values():
            replacement = hook(self, state_dict)
            if replacement is not None:
                state_dict = replacement
        return state_dict

    @torch._disable_dynamo  # as torch's own load_state_dict (imports dynamo only when first called)
    @one_map_note_per_load()  # one log line per load for 8-bit maps 1 ulp off ours, not one per parameter
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by hf_optim or bitsandbytes (nested or flat form).

        Tensors keep their dtype (uint8 codes stay uint8, fp32 state is never cast to the parameter dtype) and
        move to their parameter's device; state buffers are allocated by the optimizer's allocator, so a paged
        optimizer's state is paged again after loading. A state dict of another algorithm, of another parameter
        layout or of the old 2048-element block size raises :class:`StateDictError`.

        torch's contract otherwise: load-state-dict pre-hooks get a shallow copy of ``state_dict`` (and may return
        a replacement), post-hooks run after loading; entries of ``state`` that belong to no parameter are kept;
        a param group keeps its ``param_names`` when the state dict has none.
        """
        if isinstance(state_dict, Mapping):
            state_dict = dict(state_dict)  # shallow copy: hooks may change it in place
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            replacement = hook(self, state_dict)
            if replacement is not None:
                state_dict = replacement
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
            found = sorted(map(str, state_dict))[:5] if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise StateDictError(
                f"not an optimizer state dict (expected the keys 'state' and 'param_groups', got {found}); "
                "a model's state dict goes to model.load_state_dict"
            )
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise StateDictError(
                f"state dict has {len(saved_groups)} parameter groups, this optimizer has {len(groups)}"
            )
        for index, (group, saved) in enumerate(zip(groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise StateDictError(
                    f"parameter group {index} has {len(group['params'])} parameters, "
                    f"the state dict's has {len(saved['params'])}"
                )
            saved_algorithm = saved.get(ALGORITHM_KEY)
            if saved_algorithm not in (None, self.algorithm):
                raise StateDictError(
                    f"state dict was saved by hf_optim's {saved_algorithm!r} optimizer; "
                    f"{type(self).__name__} runs {self.algorithm!r}"
                )
        id_map = {
            saved_id: p
            for saved_group, group in zip(saved_groups, groups)
            for saved_id, p in zip(saved_group["params"], group["params"])
        }
        new_state: dict = {}
        for saved_id, param_state in state_dict["state"].items():
            if saved_id not in id_map:  # not a parameter's state (a hook's entry, say): kept as it is, as torch does
                new_state[saved_id] = copy.deepcopy(param_state)
                continue
            p = id_map[saved_id]
            flat = sharding.import_state(dict(param_state), p, local_tensor(p),
                                         functools.partial(self._state_dims, state=param_state))
            flat.update(flat.pop(QUANT_STATE_KEY, {}))
            self._check_loaded_state(local_tensor(p), flat, saved_id)
            # Copy: the loaded optimizer must never share (and mutate) the caller's tensors. State buffers go
            # through the allocator, which pages them for a paged optimizer as it did when they were created.
            device, elements = local_tensor(p).device, local_tensor(p).numel()
            slots = {spec.key for spec in self._all_slots()}
            new_state[p] = {
                k: (
                    (self._allocate.copy_of(v, device, elements) if k in slots else v.to(device, copy=True))
                    if isinstance(v, torch.Tensor)
                    else copy.deepcopy(v)
                )
                for k, v in flat.items()
            }
            if isinstance(new_state[p].get("step"), torch.Tensor):
                new_state[p]["step"] = int(new_state[p]["step"].item())

        new_groups = []
        for group, saved in zip(groups, saved_groups):
            saved = self._from_bnb_group(saved)
            merged = {k: copy.deepcopy(v) for k, v in saved.items() if k not in ("params", ALGORITHM_KEY)}
            aliases = [f.optim_bits for f in FORMATS.values() if f.optim_bits is not None]  # None: no alias
            if "state_format" not in merged and merged.get("optim_bits") in aliases:
                merged["state_format"] = format_for_bits(merged["optim_bits"]).name  # bitsandbytes' (or older) dict
            for key, value in self.defaults.items():
                merged.setdefault(key, value)
                if isinstance(value, tuple) and isinstance(merged[key], list):
                    merged[key] = tuple(merged[key])  # a checkpoint format without tuples (DCP, JSON) saved a list
            merged["params"] = group["params"]
            if "param_names" in group and "param_names" not in merged:
                merged["param_names"] = group["param_names"]
            self._check_group(merged)
            new_groups.append(merged)

        self.state.clear()
        self._flat.clear()  # the loaded state moves into new flat buffers at its first step
        self.state.update(new_state)
        self.param_groups = new_groups
        self._state_reallocated()  # the Triton path's cached tables name the old state's addresses
        if self._release is not None:
            self._release.groups_changed()
            self._release.step_done()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _check_loaded_state(self, param: torch.Tensor, state: dict, index) -> None:
        """Refuse state of another algorithm, shape or block size before it can corrupt training."""
        where = f"state of parameter {index} (shape {tuple(param.shape)})"
        specs = self._slots_of_state(state)
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
                f"{where} has slots {sorted(present)}, but {type(self).__name__} ({self.algorithm}) keeps "
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

    # ----------------------------------------------------------------------------------------------------
    # Pickling (copy.deepcopy, pickle, torch.save of the optimizer object)
    _PICKLED_ATTRS: ClassVar[tuple[str, ...]] = ("is_paged", "_overrides_by_position", "release_gradients")
    """What hf_optim adds to torch's pickled state (defaults, state, param_groups). The allocator is rebuilt from
    ``is_paged``; caches (Triton launch plans) are rebuilt when next needed; with ``release_gradients`` the
    unpickled optimizer hooks its own (unpickled) parameters."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._PICKLED_ATTRS})
        if self.is_paged:  # managed buffers travel as host copies, as in state_dict(); __setstate__ pages them again
            state["state"] = defaultdict(
                dict, {p: on_host(s) if isinstance(s, Mapping) else s for p, s in self.state.items()}
            )
        if any(_has_float8(s) for s in state["state"].values()):  # torch cannot unpickle float8 storages: bits travel
            state["state"] = defaultdict(
                dict, {p: _float8_as_bits(s) if isinstance(s, Mapping) else s for p, s in state["state"].items()}
            )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)
        for param_state in self.state.values():
            if isinstance(param_state, dict):
                param_state.update({k: v.restore() for k, v in param_state.items() if isinstance(v, Float8Bits)})
        if not had_differentiable:  # torch's __setstate__ adds this key for its own optimizers; hf_optim has none
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("is_paged", False)
        self.__dict__.setdefault("_overrides_by_position", {})
        self.__dict__.setdefault("release_gradients", False)
        self._release = None
        self._allocate = state_allocator(self.is_paged, type(self).__name__)
        self._flat = FlatStates()  # unpickled state is standalone: the multi-tensor path moves it in at the next step
        if self.release_gradients:
            self._start_release()
        if self.is_paged:
            self._page_state_again()

    def _page_state_again(self) -> None:
        """Move unpickled state to its parameter's device, state buffers through the allocator (managed memory
        where paging is available), exactly as :meth:`load_state_dict` places loaded state."""
        slots = {spec.key for spec in self._all_slots()}
        for p, param_state in self.state.items():
            if not isinstance(p, torch.Tensor) or not isinstance(param_state, dict):
                continue
            device = local_tensor(p).device
            pageable = paging_unavailable_reason(device) is None
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    paged = key in slots and pageable
                    elements = local_tensor(p).numel()
                    param_state[key] = self._allocate.copy_of(value, device, elements) if paged else value.to(device)


class Float8Bits:
    """A float8 state tensor as its raw bytes, for pickling: torch saves float8 storages but cannot load them back
    through plain ``pickle`` (``UntypedStorage`` has no ``dtype``), so ``__getstate__`` sends the bits as uint8 and
    ``__setstate__`` views them as the float8 dtype again (the same bytes, nothing rounded)."""

    def __init__(self, tensor: torch.Tensor):
        self.bits, self.dtype = tensor.view(torch.uint8), str(tensor.dtype).removeprefix("torch.")

    def restore(self) -> torch.Tensor:
        return self.bits.view(getattr(torch, self.dtype))


def _is_float8(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.element_size() == 1


def _has_float8(param_state: Any) -> bool:
    return isinstance(param_state, Mapping) and any(_is_float8(v) for v in param_state.values())


def _float8_as_bits(param_state: Mapping) -> dict:
    return {k: Float8Bits(v) if _is_float8(v) else v for k, v in param_state.items()}
