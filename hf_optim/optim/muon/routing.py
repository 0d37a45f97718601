"""Which rule each parameter of a model takes under hybrid Muon: the hidden 2-D matrices Muon, embeddings, the LM
head, norms, biases and other non-2-D tensors AdamW (:func:`route_model`, called by the Trainer integration), and
LoRA adapters marked apart (AdamW by default: ``docs/muon_defaults.md``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

MUON_ROUTE_ATTR = "hf_optim_muon_route"
"""A parameter attribute set by :func:`hf_optim.optim.muon.routing.route_model`: ``"muon"``, ``"adamw"`` or
``"lora"``; read by groups with ``use_muon=None``."""
ROUTES = ("muon", "adamw", "lora")

class MuonRoutes(NamedTuple):
    """How :func:`route_model` split a model's trainable parameters: (tensors, elements) per rule."""

    muon_tensors: int
    muon_elements: int
    adamw_tensors: int
    adamw_elements: int

    def describe(self) -> str:
        return (f"Muon: {self.muon_tensors} tensors ({self.muon_elements:,} elements); AdamW: {self.adamw_tensors} "
                f"tensors ({self.adamw_elements:,} elements)")

    def warning(self) -> str | None:
        """Why a user should look at this split, or None."""
        if self.muon_tensors == 0 and self.adamw_tensors:
            return ("no trainable tensor takes Muon, every one steps with its AdamW rule (LoRA adapters take AdamW by "
                    "default, docs/muon_defaults.md); optim_args='muon_lora=true' sends adapters to Muon")
        return None


def route_model(model: torch.nn.Module, muon_lora: bool = False) -> MuonRoutes:
    """Mark every trainable parameter of ``model`` with the rule it takes in a ``use_muon=None`` group
    (:data:`MUON_ROUTE_ATTR`): the hidden 2-D matrices Muon, the rest AdamW.

    AdamW: the weights of ``model.get_input_embeddings()`` and ``model.get_output_embeddings()`` (when the model
    has them; tied or not), of every other ``nn.Embedding``, and every parameter that is not 2-D (norms, biases,
    conv kernels). Muon: every other 2-D weight. LoRA adapters (peft's ``lora_A`` / ``lora_B``) are marked
    ``"lora"``: Muon when the group's ``muon_lora`` is True (``muon_lora`` here only counts them for the summary),
    AdamW otherwise; peft's embedding adapters (``lora_embedding_A/B``) take AdamW.

    Args:
        model: the model (a transformers ``PreTrainedModel`` or any ``nn.Module``).
        muon_lora (bool, default False): count LoRA adapters as Muon's in the returned summary.

    Returns:
        the split, as :class:`MuonRoutes`.
    """
    embeddings = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            embeddings.add(id(weight))
    embeddings |= {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    counts = {"muon": [0, 0], "adamw": [0, 0]}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embeddings or p.ndim != 2 or "lora_embedding_" in name:
            route = "adamw"
        elif "lora_A" in name or "lora_B" in name:
            route = "lora"
        else:
            route = "muon"
        setattr(p, MUON_ROUTE_ATTR, route)
        side = "muon" if takes_muon(route, p.ndim, muon_lora) else "adamw"
        counts[side][0] += 1
        counts[side][1] += p.numel()
    return MuonRoutes(*counts["muon"], *counts["adamw"])


def takes_muon(route: str | None, ndim: int, muon_lora: bool) -> bool:
    """Whether a parameter marked ``route`` (None: unmarked) with ``ndim`` dimensions takes Muon in a group with
    ``use_muon=None``: matrices do, unless marked ``"adamw"``, or ``"lora"`` without ``muon_lora``."""
    if route == "adamw" or ndim != 2:
        return False
    return route != "lora" or muon_lora
