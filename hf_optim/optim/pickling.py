"""Pickling an :class:`~hf_optim.optim.base.HfOptimizer` (``copy.deepcopy``, ``pickle``, ``torch.save`` of the
optimizer object): paged state travels as host copies and is paged again when unpickled; float8 state travels as its
bits (torch cannot unpickle float8 storages through plain ``pickle``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from hf_optim.paging import on_host


def picklable_states(states: Mapping, is_paged: bool) -> Mapping:
    """``states`` (the optimizer's ``state``) as it pickles."""
    if is_paged:  # managed buffers travel as host copies, as in state_dict(); unpickling pages them again
        states = defaultdict(dict, {p: on_host(s) if isinstance(s, Mapping) else s for p, s in states.items()})
    if any(_has_float8(s) for s in states.values()):
        states = defaultdict(dict, {p: _float8_as_bits(s) if isinstance(s, Mapping) else s
                                    for p, s in states.items()})
    return states


def restore_float8(states: Mapping) -> None:
    """Undo :func:`picklable_states`' float8 bits, in place."""
    for param_state in states.values():
        if isinstance(param_state, dict):
            param_state.update({k: v.restore() for k, v in param_state.items() if isinstance(v, Float8Bits)})


class Float8Bits:
    """A float8 state tensor as its raw bytes, for pickling: torch saves float8 storages but cannot load them back
    through plain ``pickle`` (``UntypedStorage`` has no ``dtype``), so pickling sends the bits as uint8 and
    unpickling views them as the float8 dtype again (the same bytes, nothing rounded)."""

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
