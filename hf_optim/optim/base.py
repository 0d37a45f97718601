"""The base class of every hf_optim optimizer: construction, the public step, param groups and checkpoints, over
named parts that each have one job.

- :class:`~hf_optim.optim.states.StateStore`: allocation (plain or paged), flat buffers, lazy creation;
- :class:`~hf_optim.optim.step_plan.StepPlan`: what a step updates, checked first; overrides; stochastic rounding's
  numbering;
- :class:`~hf_optim.optim.rules.Rules`: one :class:`~hf_optim.optim.runner.Runner` per rule (a hybrid has several),
  each choosing Triton, the multi-tensor path or the per-tensor path;
- :mod:`~hf_optim.optim.checkpoint` and :mod:`~hf_optim.optim.pickling`: state dicts in bitsandbytes' format,
  pickling.

An algorithm is a description (``definition``: :class:`hf_optim.core.algorithm.Algorithm`): its slots, its
elementwise ``rule`` and scalars, its own update when it is not elementwise, its partition when it is a hybrid. The
documented extension hooks of a class are three: :meth:`HfOptimizer.validate_group`, ``rule`` (a subclass may replace
the algorithm's; it then never takes the Triton kernels), and :meth:`HfOptimizer.to_bitsandbytes_group` /
:meth:`HfOptimizer.from_bitsandbytes_group`. Precision is never handled here: the state store decides 32-bit or 8-bit
per tensor, the kernels dequantize and requantize.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from hf_optim.core.algorithm import Algorithm
from hf_optim.core.state_store import QUANT_STATE_KEY, StateSpec
from hf_optim.formats import StateFormat, formats_by_rank
from hf_optim.formats.base import StateDictError
from hf_optim.formats.blockwise8 import one_map_note_per_load
from hf_optim.kernels import backend as kernel_backend
from hf_optim.optim import checkpoint, pickling
from hf_optim.optim import options as common_options
from hf_optim.optim._validation import check_min_8bit_size, check_stochastic_round
from hf_optim.optim.checkpoint import ALGORITHM_KEY, TORCH_ADAM_KEYS
from hf_optim.optim.overrides import PARAM_OVERRIDES_ATTR
from hf_optim.optim.release import GradientRelease, start_release
from hf_optim.optim.rules import Rules
from hf_optim.optim.sharding import local_tensor
from hf_optim.optim.states import StateStore
from hf_optim.optim.step_plan import SR_KEY, SR_SEED_KEY, Plan, Positions, StepPlan

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


class HfOptimizer(torch.optim.Optimizer):
    """Base class: subclasses set ``definition`` and their constructor's defaults (see the module)."""

    definition: ClassVar[Algorithm | None] = None
    """The algorithm's description; a subclass that sets it gets ``algorithm``, ``state_specs`` and ``rule``."""
    algorithm: ClassVar[str] = ""
    state_specs: ClassVar[tuple[StateSpec, ...]] = ()
    supported_formats: ClassVar[tuple[str, ...] | None] = None
    """The names of the state formats the algorithm runs with; None (elementwise algorithms): every registered
    format that suits its slots (``hf_optim.formats``), so a new format needs no change to any algorithm."""
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
    rule = None
    """The elementwise rule (the description's; a subclass may replace it, and then takes the PyTorch path)."""

    def __init__(self, params: Iterable, defaults: dict[str, Any], **options: Any) -> None:
        """``defaults``: the algorithm's hyperparameters; ``options``: the common options given (see
        :mod:`hf_optim.optim.options`; the others take their defaults)."""
        chosen = common_options.resolve(type(self), options, self._supported_formats())
        defaults = {**defaults, **common_options.group_entries(chosen), SR_SEED_KEY: 0}
        # The arguments are checked before ``params`` is read, as torch's optimizers do, so a bad value is reported
        # as itself whatever ``params`` is (torch's own error tests pass params=None with a bad lr).
        self.validate_group({**defaults, "params": []})
        super().__init__(params, defaults)
        self.is_paged = chosen.get("is_paged", False)
        self._build_parts()
        for group in self.param_groups:
            self.validate_group(group)
        self.release_gradients = chosen["release_gradients"]
        self._release: GradientRelease | None = start_release(self) if self.release_gradients else None

    def _build_parts(self) -> None:
        name = type(self).__name__
        self._store = StateStore(name, self.is_paged)
        self._plan = StepPlan(name, self.validate_group, self._positions)
        self._rules = Rules(name, self.definition, type(self).rule, self._supported_formats, self._store,
                            self._plan)  # the runners (one per rule of a hybrid) and the step of a plan

    @property
    def _positions(self) -> Positions:
        """Overrides and route marks recorded by position (torch's ``__init__`` adds groups before the parts)."""
        found = self.__dict__.get("_recorded")
        if found is None:
            partition = self.definition.partition if self.definition is not None else None
            found = self.__dict__["_recorded"] = Positions(partition.mark_attr if partition else None)
        return found

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own_init = cls.__dict__.get("__init__")
        if own_init is not None and "options" in inspect.signature(own_init).parameters:
            common_options.with_common_options(cls)
        definition = cls.__dict__.get("definition")
        if definition is None:
            return
        cls.algorithm = definition.name
        cls.state_specs = definition.slots
        if "rule" not in cls.__dict__ and definition.rule is not None:
            cls.rule = staticmethod(definition.rule)

    # ----------------------------------------------------------------------------------------------------
    # Extension hooks
    def validate_group(self, group: dict) -> None:
        """Validate a param group's hyperparameters (called for every group, including added ones, and for a
        group with a parameter's overrides). A subclass checks its own keys after calling this."""
        common_options.check_group_format(group, self._supported_formats(), type(self).__name__)
        check_min_8bit_size(group["min_8bit_size"])
        check_stochastic_round(group.get(SR_KEY, False), group.get(SR_SEED_KEY, 0))

    def to_bitsandbytes_group(self, group: dict) -> dict:
        """Add the param-group keys bitsandbytes' namesake reads, so a saved state dict loads there too."""
        return group

    def from_bitsandbytes_group(self, saved: dict) -> dict:
        """Map a bitsandbytes param group's keys to this optimizer's (inverse of :meth:`to_bitsandbytes_group`)."""
        return saved

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
        plan = self._planned()
        if self._release is not None:
            self._release.check_not_stepped(plan)
        self._run(plan)
        if self._release is not None:
            self._release.step_done()
        return loss

    def _planned(self, only: tuple[int, int] | None = None) -> Plan:
        """The step plan, after refusing state whose slots are another rule's (a hybrid's)."""
        plan = self._plan.plan(self.param_groups, only)
        self._rules.check_plan(plan, self.state)
        return plan

    def _run(self, plan: Plan) -> None:
        if self.is_paged:
            self._store.allocate.begin_step()
        self._rules.run(plan, self.state, self.param_groups)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        release = self.__dict__.get("_release")
        if release is not None:  # a group added after construction: its parameters release too
            release.watch(self.param_groups[-1]["params"])
        self._positions.record(len(self.param_groups) - 1, self.param_groups[-1]["params"])
        if "_rules" in self.__dict__:  # torch calls this from __init__ before the parts exist
            self.validate_group(self.param_groups[-1])

    @property
    def backend(self) -> str:
        """The kernels that update this optimizer's parameters: ``triton``, ``torch-compile`` (the multi-tensor path
        compiled by inductor, CPU and CUDA) or ``torch`` (eager), per device type when they differ (see
        ``hf_optim.kernels.backend``)."""
        devices = {local_tensor(p).device for group in self.param_groups for p in group["params"]}
        return kernel_backend.describe(devices)

    def __repr__(self) -> str:
        paged = ", paged" if self.is_paged else ""
        return f"{super().__repr__()}\n(hf_optim: backend={self.backend}{paged})"

    # ----------------------------------------------------------------------------------------------------
    # Gradient release (hf_optim.optim.release)
    @torch.no_grad()
    def _step_released(self, group_index: int, index: int) -> None:
        """Step the one parameter at ``(group_index, index)`` (called by its gradient-release hook)."""
        if any(group[SR_KEY] for group in self.param_groups):
            self._plan.number_states(self.param_groups, self.state)  # a loaded state dict may have replaced them
        self._run(self._planned(only=(group_index, index)))

    @property
    def released_grad_norm(self) -> torch.Tensor | None:
        """With ``release_gradients``: the global 2-norm of the gradients released since the last ``step()``
        (what the Trainer logs as ``grad_norm``), or None."""
        return self._release.grad_norm() if self._release is not None else None

    def remove_release_hooks(self) -> None:
        """Stop releasing gradients: remove the hooks; ``step()`` steps every gradient again."""
        if self._release is not None:
            self._release.remove()
        self._release = None
        self.release_gradients = False

    # ----------------------------------------------------------------------------------------------------
    # Checkpoints (hf_optim.optim.checkpoint, hf_optim.optim.pickling)
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with every quantization tensor nested under ``__bnb_optimizer_quant_state__``.

        Hooks follow torch's contract: state-dict pre-hooks run first, post-hooks receive the final (nested) dict
        and may return a replacement. Entries of ``optimizer.state`` that are not a parameter's state (a hook may
        add some) are passed through unchanged, as torch does.
        """
        return checkpoint.state_dict(self)

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
        if isinstance(state_dict, dict):
            state_dict = dict(state_dict)  # shallow copy: hooks may change it in place
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            replacement = hook(self, state_dict)
            if replacement is not None:
                state_dict = replacement
        checkpoint.check_shape(self, state_dict)
        new_state = checkpoint.loaded_states(self, state_dict)
        new_groups = checkpoint.loaded_groups(self, state_dict)
        self.state.clear()
        self._store.clear()  # the loaded state moves into new flat buffers at its first step
        self.state.update(new_state)
        self.param_groups = new_groups
        self._store.replaced()  # the Triton path's cached tables name the old state's addresses
        if self._release is not None:
            self._release.groups_changed()
            self._release.step_done()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    _PICKLED_ATTRS: ClassVar[tuple[str, ...]] = ("is_paged", "_recorded", "release_gradients")
    """What hf_optim adds to torch's pickled state (defaults, state, param_groups). The parts are rebuilt; caches
    (Triton launch plans) are rebuilt when next needed; with ``release_gradients`` the unpickled optimizer hooks
    its own (unpickled) parameters."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._PICKLED_ATTRS if name in self.__dict__})
        state["state"] = pickling.picklable_states(self.state, self.is_paged)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)
        pickling.restore_float8(self.state)
        if not had_differentiable:  # torch's __setstate__ adds this key for its own optimizers; hf_optim has none
            self.defaults.pop("differentiable", None)
        self.__dict__.setdefault("is_paged", False)
        self.__dict__.setdefault("release_gradients", False)
        if "_recorded" not in self.__dict__:  # pickled by hf_optim before the parts: its records by position
            self._positions.overrides.update(self.__dict__.pop("_overrides_by_position", {}) or {})
            self._positions.marks.update(self.__dict__.pop("_routes_by_position", {}) or {})
        self._build_parts()  # unpickled state is standalone: the multi-tensor path moves it in at the next step
        self._release = start_release(self) if self.release_gradients else None
        if self.is_paged:
            self._store.page_again(self.state, self._rules.all_slots())

