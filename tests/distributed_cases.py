"""What the 2-process DDP / FSDP2 tests train: a small model, its data, and every algorithm in 32-bit and 8-bit.

Shared by the torchrun worker (``distributed_worker.py``) and the single-process reference in
``test_distributed.py``, so both sides run the same model, batches and optimizer settings.
"""

from __future__ import annotations

import torch

import hf_optim

WORLD_SIZE = 2
STEPS = 5
RESUME_AT = 2  # the checkpoint test saves after this many steps
BATCH = 8  # global batch; each rank takes its half

# name -> (class, keyword arguments). Adafactor runs with the relative step and parameter scaling, so RMS(p) and
# RMS(update) both matter; LAMB with weight decay, so its trust ratio is on.
OPTIMIZERS = {
    "adamw_32bit": (hf_optim.AdamW32bit, dict(lr=1e-2)),
    "adamw_8bit": (hf_optim.AdamW8bit, dict(lr=1e-2)),
    # blockwise4: the default 4-bit (stochastic4) declares no scales yet and is refused on FSDP2-sharded tensors
    "adamw_4bit": (hf_optim.AdamW4bitBlockwise, dict(lr=1e-2)),
    "ademamix_32bit": (hf_optim.AdEMAMix32bit, dict(lr=1e-2, t_alpha=3, t_beta3=3)),
    "ademamix_8bit": (hf_optim.AdEMAMix8bit, dict(lr=1e-2, t_alpha=3, t_beta3=3)),
    "lamb_32bit": (hf_optim.LAMB32bit, dict(lr=1e-2, weight_decay=0.1)),
    "lamb_8bit": (hf_optim.LAMB8bit, dict(lr=1e-2, weight_decay=0.1)),
    "lion_32bit": (hf_optim.Lion32bit, dict(lr=1e-3)),
    "lion_8bit": (hf_optim.Lion8bit, dict(lr=1e-3)),
    "rmsprop_32bit": (hf_optim.RMSprop32bit, dict(lr=1e-3)),
    "rmsprop_8bit": (hf_optim.RMSprop8bit, dict(lr=1e-3)),
    "adafactor_32bit": (hf_optim.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
    "adafactor_8bit": (hf_optim.Adafactor, dict(beta1=0.9, weight_decay=0.01, optim_bits=8)),
    # Muon: the 2-D tensors (aligned, head, unaligned) take Muon, gathered whole for Newton-Schulz under FSDP2; the
    # bias and the 3-D cube take its AdamW rule
    "muon_32bit": (hf_optim.Muon32bit, dict(lr=2e-2, adamw_lr=1e-2)),
    "muon_8bit": (hf_optim.Muon8bit, dict(lr=2e-2, adamw_lr=1e-2)),
}
ROW_WISE = ("lamb", "adafactor")  # algorithms with cross-shard reductions (float sums in another order)


class Net(torch.nn.Module):
    """Parameters chosen for FSDP2's dim-0 sharding over 2 ranks.

    ``aligned`` (33, 256): uneven shards (17 and 16 rows) whose 256-element blocks are the unsharded tensor's.
    ``cube`` (5, 8, 128): 3-D (Adafactor factors its last two dims), shards of 3 and 2 slices, blocks aligned.
    ``bias`` (33,), ``head`` (1, 73): small (fp32 state); the head's second shard is empty.
    ``unaligned`` (37, 130): uneven shards whose 8-bit blocks are not the unsharded tensor's. It feeds a loss
    term of its own, so its (quantization-level) difference from the unsharded run cannot reach the others.
    """

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)

        def init(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.1)

        self.aligned = init(33, 256)
        self.bias = init(33)
        self.cube = init(5, 8, 128)
        self.head = init(1, 73)
        self.unaligned = init(37, 130)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.tanh(x[:, :256] @ self.aligned.T + self.bias)
        c = torch.tanh(torch.einsum("bk,ijk->bij", x[:, 256:384], self.cube)).flatten(1)
        b = torch.tanh(x[:, 384:514] @ self.unaligned.T)
        return torch.cat([a, c], dim=1) @ self.head.T, b.mean(dim=1, keepdim=True)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 514, generator=gen), torch.randn(BATCH, 1, generator=gen)) for _ in range(steps)]


def half(batch, rank: int):
    """The part of a global batch rank ``rank`` trains on."""
    size = BATCH // WORLD_SIZE
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def loss_fn(model, x, y) -> torch.Tensor:
    main, side = model(x)
    return torch.nn.functional.mse_loss(main, y) + torch.nn.functional.mse_loss(side, y)


def build_optimizer(name: str, params):
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


def single_process_run(name: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The reference: one process, the same global batch. The gradient is the mean of the two halves' gradients,
    each computed on the same half batch a rank sees, as data parallelism averages them."""
    model = Net()
    optimizer = build_optimizer(name, model.parameters())
    for batch in batches(steps):
        grads = []
        for rank in range(WORLD_SIZE):
            model.zero_grad(set_to_none=True)
            loss_fn(model, *half(batch, rank)).backward()
            grads.append([p.grad for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(g / WORLD_SIZE for g in per_rank)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
