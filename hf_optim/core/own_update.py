"""How an algorithm that is not elementwise updates its parameters on the PyTorch path, as data on its description.

An elementwise algorithm needs nothing here: its rule runs through the state formats on every path. LAMB (a trust
ratio over the whole tensor), Adafactor (factored statistics) and Muon (Newton-Schulz over whole matrices) give
these functions instead of overriding the optimizer's methods. Each receives the optimizer's runner for that rule
(``ctx``: :class:`hf_optim.optim.runner.Runner`), which offers what an update needs:

- ``ctx.run_rule(param, grad, state, hyper, out=None, stream=None)``: the algorithm's elementwise rule on one tensor,
  through its state format (``out``: write the rule's output there instead of into the parameter);
- ``ctx.hyper(group, step)``: the rule's scalars; ``ctx.stream(group, state, param)``: bf16 stochastic rounding;
- ``ctx.rule``, ``ctx.scratch`` (reused fp32 buffers), ``ctx.store`` (``format_of``, ``allocate``), ``ctx.name``
  (the optimizer class's name, for messages) and ``ctx.notes`` (a set, for warnings given once per optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class OwnUpdate:
    """A non-elementwise algorithm's PyTorch path.

    Args:
        tensor: ``tensor(ctx, param, grad, state, group, full)``: update one local tensor ``param`` (``full``: the
            parameter itself, a DTensor when sharded, for reductions over the whole tensor).
        flat: ``flat(ctx, group, flat, members, hyper, stream)``: the multi-tensor path over flat state buffers
            (``members`` = ``[(index in flat, local param, local grad)]``), equal to ``tensor`` bit for bit; None:
            the algorithm's tensors step one by one.
        group: ``group(ctx, group, items)``: update a whole param group's ``(param, grad, state, full)`` items at
            once (Muon batches same-shaped matrices); it replaces ``tensor`` and the fast paths.
        init_state: ``init_state(ctx, full, group, state)``: create state that is not the algorithm's slots
            (Adafactor's factored statistics); such state stays per tensor.
        created: ``created(ctx, group, params)``: told the local tensors whose state a step is about to create
            (LAMB warns about tensors that start at zero).
        state_dims: ``state_dims(key, ndim, state)``: the layout of state that is not slots, for sharded
            checkpoints (see :func:`hf_optim.optim.sharding.export_state`).
        check_loaded: ``check_loaded(param, state, where)``: refuse a loaded state this algorithm cannot run,
            instead of the slot checks (raise ``StateDictError``).
    """

    tensor: Callable | None = None
    flat: Callable | None = None
    group: Callable | None = None
    init_state: Callable | None = None
    created: Callable | None = None
    state_dims: Callable | None = None
    check_loaded: Callable | None = None

    @property
    def multi_tensor(self) -> bool:
        """Whether the algorithm's slots can live in flat buffers and step on the multi-tensor path."""
        return self.flat is not None and self.init_state is None and self.group is None
