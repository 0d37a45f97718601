"""Counting the tokens a training run consumes, for tokens/s, with any Trainer.

A callback never sees the batches, so the count comes from a forward pre-hook on the model: each training-mode
forward adds its non-padding tokens (the attention mask's sum) or, without a mask (packed / padding-free batches),
every input position. The mask's sum stays on the device until it is read at a log step, so counting never
forces a GPU sync. When the Trainer counts tokens itself (``include_num_input_tokens_seen``), its count (summed
over processes) is used instead.
"""

from __future__ import annotations

import torch


def _batch_tokens(args: tuple, kwargs: dict):
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum()
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return embeds.shape[:-1].numel()
    return 0


class TokenCounter:
    """Counts the tokens of training-mode forwards of ``model`` while attached."""

    def __init__(self):
        self._count = 0  # int, or a device tensor once a mask sum was added
        self._handle = None

    def attach(self, model: torch.nn.Module) -> None:
        self.detach()
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self._count = self._count + _batch_tokens(args, kwargs)

    @property
    def total(self) -> int:
        """Tokens counted so far (reading it syncs the device once)."""
        return int(self._count)
