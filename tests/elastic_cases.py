"""What the world-size tests train: optimizer state that does not depend on the number of FSDP2 ranks, and DCP
checkpoints that move between world sizes (test_distributed.py, one torchrun per world size: distributed_worker.py).

The model's tensors are sharded by FSDP2 (dimension 0, torch.chunk) so that shard boundaries fall inside the blocks
of every quantized format at 2, 3 and 4 ranks: uneven shards, a 1-D tensor whose boundaries are odd (inside a packed
4-bit byte), a (600, 1) tensor whose parts at 4 ranks (150 elements) are smaller than a block (one block spans three
ranks); and a 3-D tensor whose boundaries fall on block boundaries (its 5 slices of 1024 elements: 3 + 2, 2 + 2 + 1,
and at 4 ranks an empty part), and a small vector with fp32 state. The gradients are given, not computed: each step's
whole gradient is the same tensor at every world size (each rank takes its part of it), so what differs between world
sizes is the optimizer alone. The single-process run is the reference.
"""

from __future__ import annotations

import torch

import hf_optim

SHAPES = {"unaligned": (37, 130), "odd": (4099,), "thin": (600, 1), "cube": (5, 8, 128), "bias": (33,)}
MIN_8BIT = 512
"""min_8bit_size: every tensor but the bias gets quantized state (the whole tensor's size decides, not a part's)."""
STEPS, SAVE_AT = 5, 2
WORLD_SIZES = (2, 3, 4)

ELEMENTWISE = ("adamw", "ademamix", "lion", "rmsprop")
QUANTIZED = ("8bit", "fp8", "4bit")
_CLASSES = {"adamw": hf_optim.AdamW, "ademamix": hf_optim.AdEMAMix, "lion": hf_optim.Lion, "rmsprop": hf_optim.RMSprop,
            "lamb": hf_optim.LAMB, "muon": hf_optim.Muon}
_KWARGS = {"adamw": dict(lr=1e-2, weight_decay=0.1), "ademamix": dict(lr=1e-2, t_alpha=3, t_beta3=3),
           "lion": dict(lr=1e-3), "rmsprop": dict(lr=1e-3), "lamb": dict(lr=1e-2, weight_decay=0.1),
           "muon": dict(lr=2e-2, adamw_lr=1e-2)}
_FORMATS = {"32bit": "fp32", "8bit": "blockwise8", "fp8": "fp8", "4bit": "blockwise4", "rank1": "rank1_4bit"}


def _config(algorithm: str, precision: str):
    return _CLASSES[algorithm], dict(_KWARGS[algorithm], state_format=_FORMATS[precision])


CONFIGS = {f"{algorithm}_{precision}": _config(algorithm, precision)
           for algorithm in ELEMENTWISE for precision in QUANTIZED}
CONFIGS.update({
    "adamw_rank1": _config("adamw", "rank1"),
    "ademamix_rank1": _config("ademamix", "rank1"),
    "lamb_8bit": _config("lamb", "8bit"),
    "adafactor_8bit": (hf_optim.Adafactor, dict(beta1=0.9, weight_decay=0.01, optim_bits=8)),
    "muon_4bit": _config("muon", "4bit"),
})
"""Every case runs at 2, 3 and 4 ranks, and resumes from 2 ranks in one process: every algorithm, every format (fp32
state too: the small vector keeps it in every case). Rank-1 4-bit with each elementwise algorithm that takes it (it
quantizes second moments: AdamW and AdEMAMix; Lion and RMSprop have none)."""
FEW = ("adamw_8bit", "adamw_fp8", "adamw_4bit", "adamw_rank1", "ademamix_4bit", "lamb_8bit", "adafactor_8bit",
       "muon_4bit")
"""The cases of the other resumes (1 -> 4, 4 -> 2, 2 -> 3, 2 -> HSDP): one per format, and the algorithms whose state
is not just elementwise slots, or has stacked rows (a checkpoint's layout follows the format, not the algorithm's
update; each case costs every rank CPU time in the suite)."""
REFERENCE_ONLY = {
    "lamb_32bit": _config("lamb", "32bit"),
    "adafactor_32bit": (hf_optim.Adafactor, dict(beta1=0.9, weight_decay=0.01)),
}
"""Single-process runs only: how far the quantized LAMB and Adafactor runs are from 32-bit (their tolerance)."""
SUMMED = ("lamb", "adafactor")
"""Algorithms with sums over the whole tensor (all-reduced across shards in another order: equal up to it)."""


def model() -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for name, shape in SHAPES.items():
        setattr(module, name, torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.1))
    return module


def gradients(step: int) -> dict[str, torch.Tensor]:
    """The whole gradient of each tensor at ``step``, with magnitudes spread over two decades, so that blocks differ in
    scale and a block's absmax is set by few of its elements."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape, generator=gen)) * 0.01
            for name, shape in SHAPES.items()}


def build(name: str, module: torch.nn.Module):
    cls, kwargs = CONFIGS[name] if name in CONFIGS else REFERENCE_ONLY[name]
    return cls(module.parameters(), min_8bit_size=MIN_8BIT, **kwargs)


def train(module: torch.nn.Module, optimizer, steps) -> None:
    """Optimizer steps ``steps`` with the given gradients (each rank's part of the whole gradient for a DTensor)."""
    for step in steps:
        whole = gradients(step)
        for name, p in module.named_parameters():
            grad = whole[name]
            if hasattr(p, "device_mesh"):  # every rank holds the whole gradient: its part, without communication
                from torch.distributed.tensor import distribute_tensor

                grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
            p.grad = grad
        optimizer.step()


def whole_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in module.named_parameters()}


def single_process(name: str, steps=range(STEPS)) -> tuple[torch.nn.Module, object]:
    module = model()
    optimizer = build(name, module)
    train(module, optimizer, steps)
    return module, optimizer
