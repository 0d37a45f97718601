"""The rules of an optimizer: one :class:`~hf_optim.optim.runner.Runner` per rule, and which rule each parameter
takes.

A single-rule optimizer has one rule, labelled ``""``. A hybrid one (Muon + AdamW) reads its rules from its
description's :class:`~hf_optim.core.partition.Partition`: each parameter's label, each rule's slots and
hyperparameters, the slot set a loaded state must hold. Nothing here names an algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hf_optim.core.algorithm import Algorithm
from hf_optim.core.state_store import QUANT_STATE_KEY, StateSpec
from hf_optim.formats import loaded_format, with_overrides
from hf_optim.optim import sharding
from hf_optim.optim.overrides import update_overrides
from hf_optim.optim.runner import Runner
from hf_optim.optim.states import StateStore
from hf_optim.optim.step_plan import Plan, StepPlan


class Rules:
    """The runners of one optimizer (see the module).

    Args:
        name: the optimizer class's name, for messages.
        definition: the algorithm's description.
        rule: the class's elementwise rule (the description's, unless a subclass replaced it).
        formats: ``formats()`` -> the formats the optimizer runs with.
        store, plan: the optimizer's state store and step plan.
    """

    def __init__(self, name: str, definition: Algorithm, rule, formats: Callable, store: StateStore,
                 plan: StepPlan) -> None:
        self.name, self.definition = name, definition
        self.store, self.plan = store, plan
        self.partition = definition.partition
        if self.partition is None:
            self.runners = {"": Runner(name, "", definition, rule, formats, store, plan)}
        else:
            self.runners = {
                part.label: Runner(name, part.label, part.algorithm or definition,
                                   rule if part.algorithm is None else part.algorithm.rule, formats, store, plan,
                                   settings=part.settings)
                for part in self.partition.rules
            }
        self.main = next(iter(self.runners.values()))

    def label_of(self, p: torch.Tensor, group: dict) -> str:
        return self.partition.label_of(p, group) if self.partition is not None else ""

    def split(self, entries: list, label_of: Callable) -> dict[str, list]:
        """``entries`` by their label (``label_of(entry)``), labels in rule order."""
        if self.partition is None:
            return {"": entries}
        by_label: dict[str, list] = {label: [] for label in self.runners}
        for entry in entries:
            by_label[label_of(entry)].append(entry)
        return by_label

    # A step
    def check_plan(self, plan: Plan, states: dict) -> None:
        """Refuse, before anything changes, state whose slots are another rule's (see
        :meth:`check_rule_unchanged`)."""
        if self.partition is None:
            return
        for _, group, entries in plan:
            for p, _, _, overrides in entries:
                self.check_rule_unchanged(p, {**group, **(overrides or {})}, states.get(p))

    def run(self, plan: Plan, states: dict, param_groups: list[dict]) -> None:
        """Step the parameters of a plan: a group's new state is created first, all at once (flat buffers hold it
        together), then each rule's runner updates its parameters; parameters with their own hyperparameters
        (bitsandbytes' manager) update as a group of their own."""
        for group_index, group, entries in plan:
            fresh = [(p, param, overrides) for p, param, _, overrides in entries if not states[p]]
            by_label = self.split(fresh, lambda entry, group=group: self.label_of(
                entry[0], with_overrides(group, entry[2]) if entry[2] else group))
            for label, members in by_label.items():
                self.runners[label].create_states(group, members, states)
            if group_index == 0 or fresh:
                self.plan.number_states(param_groups, states)
            plain: list = []
            calls: dict = {(): (group, plain)}
            for p, param, grad, overrides in entries:
                state = states[p]
                state["step"] += 1
                if p.numel() == 0:  # an empty local shard still joins its shard group's reductions
                    continue
                if self.store.is_paged:
                    self.store.allocate.prefetch(state, param.device)  # only right after a memory shortage
                hyper = update_overrides(overrides) if overrides else None
                if hyper:  # per-parameter hyperparameters (bitsandbytes' manager): updated with its own group
                    calls.setdefault(_override_key(hyper), ({**group, **hyper}, []))[1].append((param, grad, state, p))
                else:
                    plain.append((param, grad, state, p))
            for effective, items in calls.values():
                by_label = self.split(items, lambda item, group=effective: self.label_of(item[3], group))
                for label, members in by_label.items():
                    if members:
                        self.runners[label].update_group(effective, group_index, members)
        self.store.pending.flush()  # sharded parameters' split runs: one all-reduce per shard group

    # Slots
    def all_slots(self) -> tuple[StateSpec, ...]:
        """Every slot a parameter's state may hold (their buffers are paged; their layouts are sharded)."""
        seen: dict[str, StateSpec] = {}
        for runner in self.runners.values():
            for spec in runner.slots:
                seen.setdefault(spec.key, spec)
        return tuple(seen.values())

    def slots_of_state(self, state: Mapping) -> tuple[StateSpec, ...]:
        """The slots one parameter's loaded ``state`` must hold: those of the rule whose slot set it holds (a
        hybrid's), else the algorithm's."""
        present = {k for k in state if k.startswith("state")}
        for runner in self.runners.values():
            if present == {spec.key for spec in runner.slots}:
                return runner.slots
        return self.definition.slots

    def check_rule_unchanged(self, p: torch.Tensor, group: dict, state: dict) -> None:
        """Refuse, before anything changes, state whose slots are another rule's (a group's settings or a
        parameter's route changed after its first step)."""
        if self.partition is None or not state:
            return
        label = self.label_of(p, group)
        present = {k for k in state if k.startswith("state")}
        if present != {spec.key for spec in self.runners[label].slots}:
            title = self.partition.rule(label).title or label
            setting = self.partition.setting or "rule setting"
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} now takes the {title} rule but its state holds "
                f"{sorted(present)} (its group's {setting} or its route changed after its state was created); keep "
                f"{setting} as it was, or start this parameter's state afresh"
            )

    # Checkpoints
    def state_dims(self, key: str, ndim: int, state: Mapping | None = None):
        """How state ``key`` of an ``ndim``-dim parameter is laid out, for sharded checkpoints (see
        :func:`hf_optim.optim.sharding.export_state`; a slot of a parameter with a contiguous part is laid out by its
        format instead, :mod:`hf_optim.optim.sharded_state`): the parameter dimension of each state dimension, a
        ``sharding.PerShard`` for state counted on the local shard (absmax vectors, packed 4-bit codes), or None
        for state that is the same on every rank. ``state`` (the parameter's state, nested or not) tells the
        slot's format."""
        own = self.definition.update.state_dims if self.definition.update is not None else None
        if own is not None:
            return own(key, ndim, state)
        for spec in self.all_slots():
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


def _override_key(hyper: dict):
    """A key that puts parameters with equal hyperparameter overrides in one update call."""
    key = tuple(sorted(hyper.items()))
    try:
        hash(key)
    except TypeError:  # an unhashable value: this parameter gets a call of its own
        return object()
    return key
