"""compare_runs on two real small runs (32-bit and 8-bit AdamW) plus one that ran out of memory."""

from __future__ import annotations

import math

import pytest
import torch
from monitor_helpers import RaiseOomAt, assert_png_drawn, read_summary, sft_run

from hf_optim.monitor import compare_runs
from hf_optim.tiny import tiny_llama


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name in ("adamw_torch", "adamw_8bit"):
        trainer, _ = sft_run(root, name, root / name, steps=5)
        trainer.train()
        dirs[name] = root / name
    trainer, monitor = sft_run(root, "paged_adamw_32bit", root / "paged_oom", steps=5, callbacks=[RaiseOomAt(2)])
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    monitor.record_oom(caught.value)
    dirs["oom"] = root / "paged_oom"
    return dirs


def expected_adamw_state_bytes() -> tuple[int, int]:
    """torch AdamW and hf_optim AdamW8bit state of tiny_llama, from the state formats (spec: blocks of 256, two
    256-entry fp32 maps per 8-bit tensor, fp32 state for embeddings and tensors under 4096 elements)."""
    model = tiny_llama()
    embedding = model.get_input_embeddings().weight
    torch_bytes = eight_bit = 0
    for param in model.parameters():
        n = param.numel()
        torch_bytes += 2 * 4 * n + 4  # exp_avg, exp_avg_sq, a 0-d fp32 step
        if n >= 4096 and param is not embedding:
            eight_bit += 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4  # uint8 m, v; absmax1/2; qmap1/2
        else:
            eight_bit += 2 * 4 * n
    return torch_bytes, eight_bit


def table_rows(markdown: str) -> dict[str, list[str]]:
    """The table's rows by run label, as cell lists."""
    rows = {}
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("| run "):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].removesuffix(" (baseline)")] = cells
    return rows


def test_compare_table_deltas_and_oom_row(run_dirs, tmp_path):
    path = compare_runs([run_dirs["adamw_torch"], run_dirs["adamw_8bit"], run_dirs["oom"]], tmp_path / "cmp",
                        baseline="adamw_torch")
    assert path == tmp_path / "cmp" / "compare.md"
    markdown = path.read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run "))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    rows = table_rows(markdown)
    assert set(rows) == {"adamw_torch", "adamw_8bit", "paged_oom"}
    assert "| adamw_torch (baseline) |" in markdown

    base, eight = read_summary(run_dirs["adamw_torch"]), read_summary(run_dirs["adamw_8bit"])
    cell = dict(zip(columns, rows["adamw_8bit"]))
    assert cell["optimizer"] == "AdamW8bit" and cell["status"] == "ok"
    state_column = next(c for c in columns if c.startswith("optimizer state ("))
    unit = state_column[len("optimizer state ("):-1]
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    base_state, eight_state = (s["optimizer_state"]["total_bytes"] for s in (base, eight))
    assert (base_state, eight_state) == expected_adamw_state_bytes()
    assert float(cell[state_column]) == pytest.approx(eight_state / size, rel=5e-3)
    change = 100.0 * (eight_state - base_state) / base_state
    delta, percent = cell["Δ state"].split(" ")
    assert float(delta) == pytest.approx((eight_state - base_state) / size, rel=5e-3)
    assert percent == f"({change:+.1f}%)"
    assert cell["final loss"] == f"{eight['final_loss']:.4f}"
    assert cell["Δ final loss"] == f"{eight['final_loss'] - base['final_loss']:+.4f}"
    speed_change = 100.0 * (eight["mean_tokens_per_s"] - base["mean_tokens_per_s"]) / base["mean_tokens_per_s"]
    assert cell["Δ tokens/s"].endswith(f"({speed_change:+.1f}%)")

    oom = dict(zip(columns, rows["paged_oom"]))
    assert oom["status"] == "**OOM** at step 2" and oom["optimizer"] == "PagedAdamW32bit"
    assert oom["tokens/s"] == "-" and oom["final loss"] == "-"
    base_cells = dict(zip(columns, rows["adamw_torch"]))
    assert base_cells["Δ state"] == "" and base_cells["Δ peak"] == ""

    for name in ("compare_loss.png", "compare_memory.png", "compare_speed.png"):
        assert_png_drawn(tmp_path / "cmp" / name)
        assert f"]({name})" in markdown


def test_baseline_defaults_to_first_run_that_finished_and_bad_baseline_is_named(run_dirs, tmp_path):
    markdown = compare_runs([run_dirs["oom"], run_dirs["adamw_8bit"]], tmp_path / "cmp").read_text()
    assert "baseline: adamw_8bit" in markdown and "| adamw_8bit (baseline) |" in markdown
    with pytest.raises(ValueError, match="baseline 'adamw_8bt' is not one of the compared runs.*'adamw_8bit'"):
        compare_runs([run_dirs["adamw_torch"], run_dirs["adamw_8bit"]], tmp_path / "cmp", baseline="adamw_8bt")
    with pytest.raises(ValueError, match="at least one run directory"):
        compare_runs([], tmp_path / "cmp")


@pytest.mark.parametrize("steps,inset", [(40, True), (10, False)])
def test_loss_overlay_zooms_into_the_last_half_of_long_runs(tmp_path, steps, inset):
    """Two runs whose losses fall from 6 to about 0.4 and end 2% apart: on the main axis the ends overlap; a run
    of 40 logged steps gets an inset whose loss axis spans only the last half's EMA values."""
    from hf_optim.monitor.compare import _loss_overlay, _Row
    from hf_optim.monitor.runfiles import RunData

    def run(name: str, floor: float) -> _Row:
        records = [{"kind": "train", "step": s, "loss": floor + 6.0 * math.exp(-s / 4)} for s in range(1, steps + 1)]
        return _Row(name, RunData(tmp_path / name, records, {"ema_beta": 0.5}))

    fig = _loss_overlay([run("a", 0.40), run("b", 0.408)])
    assert len(fig.axes[0].child_axes) == (1 if inset else 0)
    if inset:
        zoom = fig.axes[0].child_axes[0]
        low, high = zoom.get_ylim()
        assert 0.39 < low and high < 0.5  # the main axis spans 0.4 to 6
        assert zoom.get_xlim() == (steps / 2, steps)


def test_a_resumed_runs_mean_loss_covers_the_whole_run(tmp_path):
    """Two identical runs, one stopped after step 3 and resumed from its checkpoint there: the whole-run mean from
    metrics.jsonl is the same for both (the uninterrupted run's 6 logged losses, as math.fsum averages them), where
    the Trainer's own mean (summary.json's train_loss_run_mean) covers only the resumed process's steps 4-6."""
    import shutil

    from monitor_helpers import FAST
    from trainer_helpers import common_args, text_dataset
    from trl import SFTConfig, SFTTrainer

    from hf_optim.monitor import TrainingMonitor
    from hf_optim.monitor.compare import logged_loss_mean
    from hf_optim.monitor.runfiles import read_records
    from hf_optim.tiny import tiny_llama, tiny_tokenizer

    def trainer(run_dir):
        args = {**common_args(tmp_path, "adamw_8bit", output_dir=str(run_dir), max_steps=6, **FAST),
                "save_strategy": "steps", "save_steps": 3}
        config = SFTConfig(**args, max_length=64)
        return SFTTrainer(model=tiny_llama(), args=config, train_dataset=text_dataset(64),
                          processing_class=tiny_tokenizer(), callbacks=[TrainingMonitor(run_dir)])

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    trainer(straight).train()
    trainer(resumed).train()
    shutil.rmtree(resumed / "checkpoint-6")  # as if it had stopped after step 3
    trainer(resumed).train(resume_from_checkpoint=str(resumed / "checkpoint-3"))

    losses = [r["loss"] for r in read_records(straight) if r.get("kind") == "train"]
    assert len(losses) == 6
    assert [r["loss"] for r in read_records(resumed) if r.get("kind") == "train"] == losses
    assert logged_loss_mean(resumed) == logged_loss_mean(straight) == math.fsum(losses) / 6
    assert read_summary(resumed)["resumed_at_step"] == 3
    # the Trainer's mean covers steps 4-6 only; it sums the same fp32 losses in another order than fsum does, so it
    # agrees with their mean to fp32 rounding (a relative 1e-6 is several fp32 ulps)
    trainers_mean = read_summary(resumed)["train_loss_run_mean"]
    assert trainers_mean is not None and abs(trainers_mean - math.fsum(losses[3:]) / 3) < 1e-6 * abs(trainers_mean)
