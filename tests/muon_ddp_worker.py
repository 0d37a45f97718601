"""torchrun worker of tests/test_muon.py's DDP and FSDP2 tests: 2 gloo processes train a small model with hybrid Muon
(8-bit and 32-bit) under DistributedDataParallel (``ddp``) or FSDP2's ``fully_shard`` (``fsdp2``: every parameter
sharded by rows, so Muon all-gathers its updates), each rank on its half of the global batch; each rank saves the
whole parameters. The model, data and optimizer here are what both sides share (the tests' single-process run
imports this module)."""

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


def train(net: torch.nn.Module, name: str, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """Train ``net`` (possibly DDP-wrapped) on this rank's share of every batch; returns the parameters."""
    inner = getattr(net, "module", net)
    opt = NAMES[name](inner.parameters(), lr=0.02, adamw_lr=3e-3, min_8bit_size=1024)
    share = BATCH // world
    for x, y in batches():
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [_whole(p.detach()).clone() for p in inner.parameters()]


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
