"""hf_optim.notebook's read-outs against tensors whose sizes are known (the notebooks themselves run in
test_notebooks.py)."""

import torch

import hf_optim
from hf_optim import notebook as nb


def _stepped(optimizer_cls, **kwargs):
    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(10))]
    optimizer = optimizer_cls(params, lr=1e-3, **kwargs)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


def test_state_report_counts_bytes_and_compares_with_fp32_adamw():
    optimizer = _stepped(hf_optim.AdamW8bit)
    report = nb.optimizer_state_report(optimizer)
    trainable = 64 * 128 + 10
    # 8-bit: two uint8 moments for the 8192-element tensor (>= 4096), fp32 moments for the 10-element one.
    uint8 = 2 * 64 * 128
    assert f"trainable params: {trainable:,}" in report
    assert f"uint8 {uint8 / 2**20:,.2f} MiB" in report
    assert f"fp32 AdamW state: {8 * trainable / 2**20:,.2f} MiB" in report
    total = hf_optim.state_memory(optimizer).total_bytes
    assert f"keeps {total / (8 * trainable):.0%} of that" in report


def test_state_table_lists_dtypes_per_parameter():
    model = torch.nn.Linear(128, 64, bias=True)
    optimizer = hf_optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(2, 128)).sum().backward()
    optimizer.step()
    table = nb.state_table(optimizer, model).splitlines()
    weight = next(line for line in table if line.startswith("weight"))
    bias = next(line for line in table if line.startswith("bias"))
    assert "state1: uint8 8,192 B" in weight and "state2: uint8 8,192 B" in weight
    assert "state1: float32 256 B" in bias  # 64 elements < 4096: 32-bit state


def test_smoke_mode_follows_the_cli_convention(monkeypatch):
    monkeypatch.setenv("HF_OPTIM_SMOKE", "1")
    assert nb.smoke_mode() and not nb.smoke_mode(False)
    monkeypatch.setenv("HF_OPTIM_SMOKE", "0")
    assert not nb.smoke_mode() and nb.smoke_mode(True)


def test_live_plot_outside_a_notebook_prints_and_draws(capsys):
    from transformers import TrainerControl, TrainerState

    plot = nb.LivePlot(title="t", min_interval_s=0.0)
    state = TrainerState()
    for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
        state.global_step = step
        plot.on_log(None, state, TrainerControl(), logs={"loss": loss})
    assert plot.steps == [1, 2, 3] and plot.losses == [3.0, 2.5, 2.0]
    assert "[t] step 3 loss 2.0000" in capsys.readouterr().out
    assert plot.figure_png().startswith(b"\x89PNG")
