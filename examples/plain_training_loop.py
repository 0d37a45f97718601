"""A plain PyTorch loop (no Trainer): a tiny Llama-3-shaped model on CPU with an hf_optim optimizer next to
torch's AdamW, offline. The main job is ``hf-optim train quickstart``; this shows the optimizers without it.

    python examples/plain_training_loop.py                        # AdamW8bit vs torch AdamW, 120 steps
    python examples/plain_training_loop.py --optim PagedAdEMAMix8bit --steps 200 --lr 2e-3

Prints the loss curve of each run, the final losses, and the optimizer-state bytes each one kept.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import hf_optim
from hf_optim.tiny import train_tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    classes = [cls.__name__ for cls in vars(hf_optim).values()
               if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not hf_optim.HfOptimizer]
    parser.add_argument("--optim", default="AdamW8bit", choices=classes)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    cls = getattr(hf_optim, args.optim)
    kwargs = {"lr": args.lr}
    if cls is hf_optim.Adafactor:
        kwargs.update(relative_step=False, scale_parameter=False)
    runs = {"torch.optim.AdamW": lambda p: torch.optim.AdamW(p, lr=args.lr), f"hf_optim.{args.optim}": None}
    results = {}
    for name in runs:
        built = {}

        def factory(params, name=name, built=built):
            params = list(params)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # paged optimizers on CPU say they run unpaged
                built["opt"] = runs[name](params) if runs[name] else cls(params, **kwargs)
            return built["opt"]

        print(f"== {name}")
        start = time.perf_counter()
        losses = train_tiny(factory, steps=args.steps, seq_len=32, log_every=20)
        state_bytes = hf_optim.state_memory(built["opt"]).total_bytes
        results[name] = (sum(losses[-10:]) / 10, state_bytes, time.perf_counter() - start)

    print(f"\n{'optimizer':<28}{'final loss (mean of last 10)':>30}{'state MiB':>11}{'seconds':>9}")
    for name, (loss, nbytes, seconds) in results.items():
        print(f"{name:<28}{loss:>30.4f}{nbytes / 2**20:>11.3f}{seconds:>9.1f}")


if __name__ == "__main__":
    main()
