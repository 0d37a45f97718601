"""hf_optim's AdamW4bitBlockwise (the ``blockwise4`` format, what the Trainer's ``adamw_torch_4bit`` runs) against
torchao's AdamW4bit (the 4-bit optimizer users know), when torchao is available.

torchao is not a dependency: installed in the test environment, transformers would import it at every Trainer
import (its load warnings break the console test). Point ``HF_OPTIM_TORCHAO_SITE`` at a side install
(``pip install --no-deps --target /tmp/torchao_site torchao``) or install it; the comparison runs in a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SITE = os.environ.get("HF_OPTIM_TORCHAO_SITE", "")
AVAILABLE = importlib.util.find_spec("torchao") is not None or (SITE and (Path(SITE) / "torchao").is_dir())

SCRIPT = r"""
import torch, hf_optim
from torchao.optim import AdamW4bit
torch.manual_seed(0)
shapes = [(64, 128), (256, 512), (4096,)]  # torchao quantizes tensors of >= 4096 elements, multiples of 128
base = [torch.randn(s) for s in shapes]
grads = [[torch.randn(s) for s in shapes] for _ in range(10)]

def run(factory):
    params = [torch.nn.Parameter(b.clone()) for b in base]
    optimizer = factory(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        optimizer.step()
    return params

kw = dict(lr=1e-3, weight_decay=1e-2)
diff = lambda a, b: max((x - y).abs().max().item() for x, y in zip(a, b))
torchao4, ours4 = run(lambda p: AdamW4bit(p, **kw)), run(lambda p: hf_optim.AdamW4bitBlockwise(p, **kw))
ours8, ours32 = run(lambda p: hf_optim.AdamW8bit(p, **kw)), run(lambda p: hf_optim.AdamW32bit(p, **kw))
print(diff(ours4, torchao4), diff(ours8, ours32))
"""


@pytest.mark.slow
@pytest.mark.skipif(not AVAILABLE, reason="torchao not installed and HF_OPTIM_TORCHAO_SITE not set (see docstring)")
def test_adamw4bit_follows_torchao_within_the_8bit_vs_32bit_difference():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), SITE]))}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ours_vs_torchao, eight_vs_thirty_two = map(float, run.stdout.split()[-2:])
    assert ours_vs_torchao <= eight_vs_thirty_two, (ours_vs_torchao, eight_vs_thirty_two)
