"""What LAMB's trust ratio does to LoRA's tensors on the quickstart recipe (the evidence behind "LAMB and LoRA" in
docs/guide/optimizers.md).

Trains ``hf-optim train quickstart`` in this process with the overrides given (default ``training.optim=lamb_8bit``)
and prints, every few optimizer steps, for LoRA's A matrices (random init) and B matrices (zero init): the median
weight norm ``||p||`` and, for LAMB, the median trust ratio ``||p|| / ||u||``, with the training loss. B starts at
norm 0, where the ratio is 1; from then on LAMB moves B by about ``lr * ||B||`` per step, so B grows by a factor
near ``1 + lr`` per step from the first step's ``lr * ||u||``.

    python benchmarks/quality/lamb_lora_trust_ratio.py                                  # lamb_8bit at the recipe's lr
    python benchmarks/quality/lamb_lora_trust_ratio.py training.optim=adamw_torch       # B's norm under AdamW
    python benchmarks/quality/lamb_lora_trust_ratio.py training.learning_rate=0.02

The per-tensor path is forced (the multi-tensor path computes the same ratios in batches) so each ratio can be
attributed to its tensor. Prints one table; writes nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import hf_optim
from hf_optim.optim import lamb as lamb_module
from hf_optim.optim.runner import Runner
from hf_optim.recipes.api import train

EVERY = 5


def main(overrides: list[str]) -> None:
    if not any(item.startswith("training.optim=") for item in overrides):
        overrides = ["training.optim=lamb_8bit", *overrides]
    overrides = [*overrides, "training.output_dir=/tmp/hf_optim_lamb_probe", "logging.run_name=lamb-probe"]

    kinds: dict[int, str] = {}  # id(param) -> "A" (nonzero at its first step) or "B" (zero: LoRA's B)
    steps: dict[int, int] = defaultdict(int)
    norms: dict[tuple[int, str], list[float]] = defaultdict(list)
    ratios: dict[tuple[int, str], list[float]] = defaultdict(list)
    current: dict[str, object] = {}

    def classify(p: torch.Tensor) -> str:
        if id(p) not in kinds:
            kinds[id(p)] = "B" if p.detach().float().norm().item() == 0.0 else "A"
        return kinds[id(p)]

    def pre_hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() == 2:
                    classify(p)

    def post_hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in kinds and p.grad is not None:
                    steps[id(p)] += 1
                    norms[steps[id(p)], kinds[id(p)]].append(p.detach().float().norm().item())

    original_ratio, original_norms = lamb_module.trust_ratio, lamb_module._norms

    def recorded_ratio(weight_norm, update_norm, **kwargs):
        ratio = original_ratio(weight_norm, update_norm, **kwargs)
        param = current["param"]
        if id(param) in kinds:
            ratios[steps[id(param)] + 1, kinds[id(param)]].append(ratio.item())
        return ratio

    def recorded_norms(weight, direction, full=None):
        current["param"] = weight
        return original_norms(weight, direction, full)

    lamb_module.trust_ratio = recorded_ratio
    lamb_module._norms = recorded_norms
    Runner.on_multi_tensor_path = lambda self, full, param: False  # per tensor, to attribute each ratio
    register_optimizer_step_pre_hook(pre_hook)
    register_optimizer_step_post_hook(post_hook)

    result = train("quickstart", overrides, quiet=True)
    losses = {}
    metrics = result.output_dir / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        record = json.loads(line)
        if "loss" in record and "step" in record:
            losses[record["step"]] = record["loss"]

    print(f"hf_optim {hf_optim.__version__}; overrides: {' '.join(overrides[:-2])}")
    print(f"{sum(k == 'A' for k in kinds.values())} LoRA A and {sum(k == 'B' for k in kinds.values())} B tensors")
    print("| step | loss | median ||A|| | median ||B|| | median ratio A | median ratio B |")
    print("|---|---|---|---|---|---|")
    last = max(step for step, _ in norms)
    for step in sorted({1, 2, 3, *range(EVERY, last + 1, EVERY), last}):
        cells = [str(step), f"{losses[step]:.3f}" if step in losses else "-"]
        for kind in "AB":
            cells.append(f"{statistics.median(norms[step, kind]):.3g}" if norms.get((step, kind)) else "-")
        for kind in "AB":
            cells.append(f"{statistics.median(ratios[step, kind]):.3g}" if ratios.get((step, kind)) else "-")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
