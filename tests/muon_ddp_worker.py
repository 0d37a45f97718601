"""torchrun worker of tests/algorithms/test_muon.py's DDP and FSDP2 tests: 2 gloo processes train a small model with
hybrid Muon
(8-bit and 32-bit) under DistributedDataParallel (``ddp``) or FSDP2's ``fully_shard`` (``fsdp2``: every parameter
sharded by rows, so Muon all-gathers its updates), each rank on its half of the global batch; each rank saves the
whole parameters. The model, data and optimizer here are what both sides share; :func:`train_as_ranks` is the
tests' one-process reference, which computes each rank's gradient itself and combines them as the collective does.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import hf_optim

STEPS = 4
BATCH = 8
NAMES = {"muon_32bit": hf_optim.Muon32bit, "muon_8bit": hf_optim.Muon8bit}


def model() -> torch.nn.Module:
    """Under FSDP2 each rank holds half the rows of every matrix: 48 x 32 and 32 x 96, whole 256-element blocks of
    8-bit state, so a rank's blocks are one process's (a shard that splits a block quantizes differently)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.LayerNorm(96), torch.nn.Linear(96, 64),
                               torch.nn.Linear(64, 1))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 32, generator=gen), torch.randn(BATCH, 1, generator=gen)) for _ in range(STEPS)]


def optimizer(net: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    return NAMES[name](net.parameters(), lr=0.02, adamw_lr=3e-3, min_8bit_size=1024)


def loss_of_share(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The loss of rank ``rank``'s share of the batch (``BATCH // world`` consecutive rows)."""
    share = BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    return torch.nn.functional.mse_loss(net(x[rows]), y[rows])


def train(net: torch.nn.Module, name: str, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """Train ``net`` (possibly DDP-wrapped) on this rank's share of every batch; returns the parameters."""
    inner = getattr(net, "module", net)
    opt = optimizer(inner, name)
    for x, y in batches():
        opt.zero_grad()
        loss_of_share(net, x, y, rank, world).backward()
        opt.step()
    return [_whole(p.detach()).clone() for p in inner.parameters()]


def train_as_ranks(name: str, mode: str) -> list[torch.Tensor]:
    """One process that does what the 2 ranks do together: each rank's gradient (its half of the batch, the same
    shapes, so the same kernels as on that rank) combined with the collective's own arithmetic, then one step.

    - ``ddp``: DDP's reducer multiplies each rank's gradient by ``1 / world_size`` while copying it into its bucket
      (``mul_out(bucket_view, grad, 1/world)``), then all-reduces with SUM: ``g0 * 0.5 + g1 * 0.5``.
    - ``fsdp2``: ``fully_shard`` with an fp32 reduce dtype reduce-scatters with ``ReduceOp.AVG`` (torch's
      ``_get_gradient_divide_factors``: no pre- or post-divide for fp32), which gloo computes as the sum divided
      by the world size: ``(g0 + g1) / 2``.

    A sum of two floats is one correctly rounded addition, the same in either order, so both ranks hold these bits.
    The two formulas differ only for a subnormal gradient element, whose halving rounds (checked with 2**-149 on
    both ranks: DDP gives 0, gloo's AVG 2**-149).
    """
    net = model()
    params = list(net.parameters())
    opt = optimizer(net, name)
    for x, y in batches():
        per_rank = []
        for rank in range(2):
            net.zero_grad(set_to_none=True)
            loss_of_share(net, x, y, rank, 2).backward()
            per_rank.append([p.grad for p in params])
        for p, g0, g1 in zip(params, *per_rank):
            p.grad = g0 * 0.5 + g1 * 0.5 if mode == "ddp" else (g0 + g1) / 2
        opt.step()
    return [p.detach().clone() for p in params]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main(out: str, mode: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in NAMES:
        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model())
        else:
            net = model()
            fully_shard(net)
        results[name] = train(net, name, rank, world)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
