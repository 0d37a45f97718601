"""What the model and optimizer hold: weight and gradient bytes, the optimizer's real class, the peak breakdown."""

from __future__ import annotations

from collections import Counter

import torch

from hf_optim.memory import StateMemory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor holds only its shard here
    return to_local() if callable(to_local) else tensor


def _bytes_by_device(tensors) -> dict[str, int]:
    by_device: Counter[str] = Counter()
    seen: set[tuple[str, int]] = set()
    for tensor in tensors:
        tensor = _local(tensor)
        key = (str(tensor.device), tensor.data_ptr())
        if tensor.numel() == 0 or key in seen:  # tied weights share storage: count it once
            continue
        seen.add(key)
        by_device[str(tensor.device)] += tensor.numel() * tensor.element_size()
    return dict(by_device)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters (as stored: 4-bit packed weights count their packed bytes), by device."""
    return _bytes_by_device(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the gradients the parameters hold now, by device (empty between steps once they are zeroed)."""
    return _bytes_by_device(p.grad for p in model.parameters() if p.grad is not None)


def trainable_gradient_estimate(model: torch.nn.Module) -> dict[str, int]:
    """Bytes the gradients of the trainable parameters will take (same dtype as the parameter), by device."""
    return _bytes_by_device(p for p in model.parameters() if p.requires_grad)


def unwrap_optimizer(optimizer):
    """The optimizer that holds the state and steps, under wrappers such as accelerate's ``AcceleratedOptimizer``
    and DeepSpeed's ZeRO optimizers (``DeepSpeedOptimizerWrapper`` -> ``DeepSpeedZeroOptimizer`` -> the client
    optimizer; DeepSpeed's are no torch optimizers): the innermost ``torch.optim.Optimizer`` along
    the ``.optimizer`` chain, else ``optimizer`` itself."""
    found, seen = optimizer, set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            found = optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def optimizer_info(optimizer) -> dict | None:
    """``{"module", "name", "wrapper"}`` of the resolved optimizer class (``None`` when there is no optimizer)."""
    if optimizer is None:
        return None
    inner = unwrap_optimizer(optimizer)
    wrapper = None if inner is optimizer else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    return {"module": type(inner).__module__, "name": type(inner).__qualname__, "wrapper": wrapper}


def on_basis(by_device: dict[str, int], basis: str) -> int:
    """The bytes of ``by_device`` that the peak of ``basis`` counts (CUDA devices, or host memory)."""
    want_cuda = basis.startswith("cuda")
    return sum(n for device, n in by_device.items() if device.startswith("cuda") == want_cuda)


def memory_breakdown(*, basis: str, peak_bytes: int | None, weights: dict[str, int], gradients: dict[str, int],
                     state: StateMemory | None) -> dict:
    """Split the run's peak into weights, gradients, optimizer state and the rest (activations, temporaries,
    allocator and library overhead), counting only the bytes that live where ``basis`` measures.

    Paged state lives in CUDA managed memory, which torch's allocator counters do not include: it is left out of
    the subtraction on a CUDA basis (and reported on its own as ``optimizer_state_paged_bytes``).
    """
    weights_bytes = on_basis(weights, basis)
    gradient_bytes_ = on_basis(gradients, basis)
    state_bytes = on_basis(state.by_device, basis) if state is not None else 0
    paged = state.paged_bytes if state is not None else 0
    if basis.startswith("cuda"):
        state_bytes -= paged
    rest = None if peak_bytes is None else max(0, peak_bytes - weights_bytes - gradient_bytes_ - state_bytes)
    return {
        "basis": basis,
        "peak_bytes": peak_bytes,
        "weights_bytes": weights_bytes,
        "gradient_bytes": gradient_bytes_,
        "optimizer_state_bytes": state_bytes,
        "optimizer_state_paged_bytes": paged,
        "rest_bytes": rest,
    }
