"""The base class of every hf_optim optimizer: construction, common options and the public step.

Subclasses set ``definition``, the algorithm's description (:class:`hf_optim.kernels.algorithm.Algorithm`: its
state slots, elementwise ``rule`` and scalars), and override ``_init_state`` / ``_update`` when the algorithm is
not elementwise (LAMB's trust ratio, Adafactor's factored statistics). Precision is never handled here: the state
store decides 32-bit or 8-bit per tensor, the kernels dequantize and requantize.

:class:`HfOptimizer` is built from three mixins: :mod:`hf_optim.optim.stepping` (planning and running a step,
per-parameter overrides, stochastic rounding streams, gradient release), :mod:`hf_optim.optim.dispatch` (the update
hooks, lazy state creation, the Triton / multi-tensor / per-tensor dispatch) and :mod:`hf_optim.optim.state_dicts`
(bitsandbytes-format state dicts, their checks on loading, pickling).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from hf_optim.kernels.algorithm import Algorithm
from hf_optim.kernels.formats import StateFormat, formats_by_rank
from hf_optim.kernels.formats.base import StateDictError
from hf_optim.kernels.state_store import StateSpec
from hf_optim.kernels.torch_path.flat_state import FlatStates
from hf_optim.optim import options as common_options
from hf_optim.optim._validation import check_min_8bit_size, check_stochastic_round
from hf_optim.optim.dispatch import Dispatch
from hf_optim.optim.overrides import PARAM_OVERRIDES_ATTR
from hf_optim.optim.release import GradientRelease
from hf_optim.optim.sharding import local_tensor
from hf_optim.optim.state_dicts import ALGORITHM_KEY, QUANT_STATE_KEY, TORCH_ADAM_KEYS, StateDicts
from hf_optim.optim.stepping import SR_KEY, SR_SEED_KEY, Stepping
from hf_optim.paging import state_allocator

__all__ = [  # HfOptimizer, and names other modules import from here (defined in the modules they belong to)
    "ALGORITHM_KEY",
    "PARAM_OVERRIDES_ATTR",
    "QUANT_STATE_KEY",
    "SR_KEY",
    "SR_SEED_KEY",
    "TORCH_ADAM_KEYS",
    "HfOptimizer",
    "StateDictError",
    "local_tensor",
]


class HfOptimizer(Stepping, Dispatch, StateDicts, torch.optim.Optimizer):
    """Base class: subclasses set ``definition`` (or override the hooks)."""

    definition: ClassVar[Algorithm | None] = None
    """The algorithm's description; a subclass that sets it gets ``algorithm``, ``state_specs``, ``rule`` and
    ``_hyper`` from it (unless it defines them itself)."""
    algorithm: ClassVar[str] = ""
    state_specs: ClassVar[tuple[StateSpec, ...]] = ()
    supported_formats: ClassVar[tuple[str, ...] | None] = None
    """The names of the state formats the algorithm runs with; None (elementwise algorithms): every registered
    format that suits its slots (``hf_optim.kernels.formats``), so a new format needs no change to any algorithm."""
    pages: ClassVar[bool] = True
    """Whether the class takes ``is_paged`` (and has ``Paged*`` twins)."""
    bitsandbytes_order: ClassVar[tuple[str, ...]] = ("optim_bits", "min_8bit_size", "is_paged")
    """Where the common options (:mod:`hf_optim.optim.options`) go in a class's signature: bitsandbytes' order from
    ``optim_bits`` on, naming the class's own arguments between them (``args``, LAMB's ``max_unorm``)."""
    group_keys: ClassVar[tuple[str, ...]] = ()
    """Param-group keys the algorithm reads (filled from defaults when a foreign state dict lacks them)."""
    twins_keep_optim_bits: ClassVar[bool] = False
    """Whether the 8-bit and 32-bit twins (``AdamW8bit``, ``PagedAdamW32bit``, ...) keep an ``optim_bits`` argument,
    as bitsandbytes' namesakes of some algorithms do (AdamW: default 32, which they ignore); see
    :func:`hf_optim.optim.variants.precision_variant`."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        **options: Any,
    ) -> None:
        """``defaults``: the algorithm's hyperparameters; ``options``: the common options given (see
        :mod:`hf_optim.optim.options`; the others take their defaults)."""
        chosen = common_options.resolve(type(self), options, self._supported_formats())
        defaults = {**defaults, **common_options.group_entries(chosen), SR_SEED_KEY: 0}
        # The arguments are checked before ``params`` is read, as torch's optimizers do, so a bad value is reported
        # as itself whatever ``params`` is (torch's own error tests pass params=None with a bad lr).
        self._check_group({**defaults, "params": []})
        super().__init__(params, defaults)
        self.is_paged = chosen.get("is_paged", False)
        self._allocate = state_allocator(self.is_paged, type(self).__name__)
        self._flat = FlatStates()  # where the multi-tensor path keeps each parameter's state
        self._ordinals: dict[int, int] = {}  # during a step with stochastic rounding: id(state) -> param ordinal
        for group in self.param_groups:
            self._check_group(group)
        self.release_gradients = chosen["release_gradients"]
        self._release: GradientRelease | None = None
        if self.release_gradients:
            self._start_release()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own_init = cls.__dict__.get("__init__")
        if own_init is not None and "options" in inspect.signature(own_init).parameters:
            common_options.with_common_options(cls)
        definition = cls.__dict__.get("definition")
        if definition is None:
            return
        own = cls.__dict__
        cls.algorithm = definition.name
        cls.state_specs = definition.slots
        if "rule" not in own and definition.rule is not None:
            cls.rule = staticmethod(definition.rule)
        if "_hyper" not in own:
            cls._hyper = staticmethod(definition.hyper_values)

    # ----------------------------------------------------------------------------------------------------
    # Hooks for subclasses: the options (the update's: hf_optim.optim.dispatch; param-group keys for bitsandbytes:
    # hf_optim.optim.state_dicts)
    def _check_group(self, group: dict) -> None:
        """Validate a param group's hyperparameters (called for every group, including added ones)."""
        common_options.check_group_format(group, self._supported_formats(), type(self).__name__)
        check_min_8bit_size(group["min_8bit_size"])
        check_stochastic_round(group.get(SR_KEY, False), group.get(SR_SEED_KEY, 0))

    @classmethod
    def _supported_formats(cls) -> tuple[StateFormat, ...]:
        """The formats the class runs with, in table order: its :attr:`supported_formats`, or every registered format
        that suits its state slots (``StateFormat.suits``: ``rank1_4bit`` only changes second moments, so Lion and
        RMSprop, whose only slot is a signed first moment, do not get it)."""
        if cls.supported_formats is not None:
            return tuple(formats_by_rank(cls.supported_formats))
        return tuple(fmt for fmt in formats_by_rank() if fmt.suits(getattr(cls, "state_specs", ())))

    # ----------------------------------------------------------------------------------------------------
    # The public step and param groups
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan_step()
        if self._release is not None:
            self._release.check_not_stepped(plan)
        self._run_plan(plan)
        if self._release is not None:
            self._release.step_done()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        release = self.__dict__.get("_release")
        if release is not None:  # a group added after construction: its parameters release too
            release.watch(self.param_groups[-1]["params"])
        # Per-parameter overrides are also recorded by position: accelerate's FSDP2 preparation swaps each
        # parameter for a new DTensor parameter at the same place in param_groups, and the attribute stays behind.
        recorded = self.__dict__.setdefault("_overrides_by_position", {})
        group_index = len(self.param_groups) - 1
        for index, p in enumerate(self.param_groups[-1]["params"]):
            overrides = getattr(p, PARAM_OVERRIDES_ATTR, None)
            if overrides:
                recorded[group_index, index] = dict(overrides)
        if hasattr(self, "_allocate"):  # torch calls this from __init__ before our attributes exist
            self._check_group(self.param_groups[-1])

    def __repr__(self) -> str:
        paged = ", paged" if self.is_paged else ""
        return f"{super().__repr__()}\n(hf_optim: backend={self.backend}{paged})"
