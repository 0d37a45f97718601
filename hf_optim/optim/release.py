"""Gradient release: each parameter steps as soon as its gradient is ready, and the gradient is freed at once.

With ``release_gradients=True`` an :class:`~hf_optim.optim.base.HfOptimizer` registers a post-accumulate-grad hook
on every trainable parameter. During ``loss.backward()`` the hook runs the optimizer's ordinary update for that one
parameter (the same per-tensor or multi-tensor code, hence the same bits) and sets ``p.grad = None``, so at most a
few gradients are alive at any time instead of all of them.

Contract:

- ``optimizer.step()`` still has to be called once per backward pass: it steps the parameters whose hook did not
  fire but that hold a gradient (one set by hand, a parameter made trainable after the optimizer was built), and it
  closes the step. A parameter whose gradient arrives a second time before ``step()`` (gradient accumulation over
  several backward passes) is refused with an error: its first gradient was already applied and freed.
- The hooks read ``group["lr"]`` when they fire, so a scheduler stepped after ``optimizer.step()`` (the Trainer's
  order) sets the learning rate of the next backward pass, as it does for the ordinary step.
- Anything that needs all gradients before the step cannot see them: global-norm clipping, a GradScaler's
  unscale and inf check, DDP's all-reduce (the hook fires before it). :func:`release_unsupported_reason` names these
  for a process group; the Trainer integration refuses the corresponding arguments.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from hf_optim.optim import sharding


def check_release_gradients(value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"release_gradients must be True or False, got {value!r} ({type(value).__name__})")
    return value


def release_unsupported_reason() -> str | None:
    """Why gradient release cannot run in this process, or None: several ranks (DDP averages gradients in an
    all-reduce that completes after the hooks fire; FSDP2 reduce-scatters the sharded gradient outside autograd's
    accumulation, so the hooks would step unreduced or missing gradients)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            return (
                f"release_gradients steps each parameter in a hook during backward, before DDP's all-reduce or "
                f"FSDP2's reduce-scatter has produced the averaged gradient; this process group has {world} ranks. "
                "Train on one process with release_gradients=True, or turn it off for distributed training"
            )
    return None


class GradientRelease:
    """The hooks of one optimizer and the bookkeeping between two ``step()`` calls."""

    def __init__(self, optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)  # the hooks must not keep a discarded optimizer alive
        self._handles: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._released: set[int] = set()  # ids of the parameters stepped since the last step()
        self._norms: list[torch.Tensor] = []  # their gradients' 2-norms, for the Trainer's logged grad_norm
        self._locations: dict[int, tuple[int, int]] | None = None  # id(param) -> (group index, index in group)

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Hook every trainable parameter of ``params`` (frozen ones get no hook and, never stepped, no state)."""
        for p in params:
            if p.requires_grad and id(p) not in self._handles:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._hook)
        self._locations = None

    def groups_changed(self) -> None:
        """Param groups were added or replaced: find parameters' places again."""
        self._locations = None

    def remove(self) -> None:
        """Remove every hook: gradients are kept again and ``step()`` steps them all."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    @property
    def hooked(self) -> int:
        return len(self._handles)

    def grad_norm(self) -> torch.Tensor | None:
        """The global 2-norm of the gradients released since the last ``step()`` (None if none was), computed as
        ``torch.nn.utils.clip_grad_norm_`` does: the norm of the per-tensor norms."""
        if not self._norms:
            return None
        return torch.linalg.vector_norm(torch.stack([n.float() for n in self._norms]))

    def check_not_stepped(self, plan: list) -> None:
        """Refuse a ``step()`` that would step a parameter its hook already stepped since the last ``step()`` (a
        gradient set again by hand): that would be a second update in one step."""
        for group_index, _, entries in plan:
            for p, *_ in entries:
                if id(p) in self._released:
                    raise RuntimeError(
                        f"a parameter of param group {group_index} (shape {tuple(p.shape)}) has a gradient, but its "
                        "release hook already stepped it since the last optimizer.step(); stepping it again would "
                        "apply two updates in one step. Set its .grad to None (zero_grad()) before step()"
                    )

    def step_done(self) -> None:
        self._released.clear()
        self._norms.clear()

    def _location(self, optimizer, p: torch.Tensor) -> tuple[int, int] | None:
        if self._locations is None:
            self._locations = {
                id(q): (group_index, index)
                for group_index, group in enumerate(optimizer.param_groups)
                for index, q in enumerate(group["params"])
            }
        return self._locations.get(id(p))

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or p.grad is None:
            return
        location = self._location(optimizer, p)
        if location is None:  # no longer in any param group: leave its gradient alone
            return
        if id(p) in self._released:
            group_index, index = location
            raise RuntimeError(
                f"parameter {index} of param group {group_index} (shape {tuple(p.shape)}) received a second gradient "
                f"before optimizer.step(): with release_gradients=True ({type(optimizer).__name__}) each gradient is "
                "applied and freed as soon as backward produces it, so gradients cannot accumulate over several "
                "backward passes. Call optimizer.step() after every backward (Trainer: gradient_accumulation_steps=1), "
                "or set release_gradients=False to accumulate"
            )
        self._norms.append(torch._foreach_norm([p.grad])[0])
        optimizer._step_released(*location)
        p.grad = None
        self._released.add(id(p))


def start_release(optimizer) -> GradientRelease:
    """Hook every trainable parameter of ``optimizer``, after refusing what gradient release cannot run
    correctly."""
    name = type(optimizer).__name__
    reason = release_unsupported_reason()
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            if sharding.is_dtensor(p):
                raise ValueError(
                    f"{name}: release_gradients does not support sharded (DTensor) parameters: FSDP2 "
                    "reduce-scatters their gradients outside the hooks. Turn release_gradients off"
                )
    release = GradientRelease(optimizer)
    for group in optimizer.param_groups:
        release.watch(group["params"])
    return release
