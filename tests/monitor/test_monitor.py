"""TrainingMonitor on CPU: accounting against known tensors, the files of a run, the plots, the OOM path."""

from __future__ import annotations

import pytest
import torch
import yaml
from monitor_helpers import (
    FAST,
    RaiseOomAt,
    assert_png_drawn,
    figure_texts,
    fixed_length_dataset,
    plain_trainer,
    read_records,
    read_summary,
    sft_run,
)
from trainer_helpers import common_args, text_dataset
from transformers import Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer

from hf_optim.monitor import TrainingMonitor, load_run, plot_run
from hf_optim.monitor.plots import dashboard_figure, loss_figure, memory_figure
from hf_optim.monitor.series import auto_ema_beta, ema
from hf_optim.tiny import tiny_llama, tiny_tokenizer

CUDA_OR_NVML = ("cuda_", "nvml_")


def tiny_llama_parameter_count(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2) -> dict[str, int]:
    """tiny_llama's parameters from its architecture (tied embeddings: the LM head adds nothing)."""
    head_dim = hidden // heads
    intermediate = hidden * 3
    attention = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * intermediate
    return {"embedding": vocab * hidden, "total": vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden}


def test_accounting_matches_known_tensors_and_cpu_fields_are_null(tmp_path):
    model = tiny_llama()
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen: counts as weights, has no gradient
    counts = tiny_llama_parameter_count()
    trainable = counts["total"] - counts["embedding"]
    # SGD with momentum keeps exactly one fp32 buffer per trainable parameter: 4 bytes per trainable element.
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
    monitor = TrainingMonitor(tmp_path / "run", run_name="sgd", plots=False)
    steps, batch_size, seq_len = 3, 4, 32
    trainer = plain_trainer(tmp_path, model, optimizer, monitor, steps=steps, batch_size=batch_size,
                            seq_len=seq_len)
    trainer.train()

    records = read_records(tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["kind"] == "train" for r in records)
    for record, logged in zip(records, history):
        assert record["loss"] == logged["loss"] and record["grad_norm"] == logged["grad_norm"]
        assert record["learning_rate"] == logged["learning_rate"]
        # Fixed-length rows without a mask: every step consumes batch_size * seq_len tokens.
        assert record["tokens"] == batch_size * seq_len and record["steps_in_window"] == 1
        assert record["tokens_per_s"] == pytest.approx(batch_size * seq_len / record["step_time_s"])
        assert record["optimizer_state_bytes"] == 4 * trainable
        assert record["optimizer_state_by_dtype"] == {"float32": 4 * trainable}
        assert record["optimizer_state_by_device"] == {"cpu": 4 * trainable}
        assert record["host_rss_bytes"] > 0
        nulls = {k: v for k, v in record.items() if k.startswith(CUDA_OR_NVML)}
        assert len(nulls) == 15 and all(v is None for v in nulls.values()), nulls
    assert records[-1]["tokens_seen"] == steps * batch_size * seq_len == summary["tokens_seen"]

    assert summary["status"] == "ok" and summary["global_step"] == steps
    assert summary["optimizer"] == {"module": "torch.optim.sgd", "name": "SGD",
                                    "wrapper": "accelerate.optimizer.AcceleratedOptimizer"}
    breakdown = summary["memory_breakdown"]
    assert breakdown["basis"] == "host_rss_peak_sampled" and breakdown["gradient_source"] == "measured"
    assert breakdown["weights_bytes"] == 4 * counts["total"]
    assert breakdown["gradient_bytes"] == 4 * trainable
    assert breakdown["optimizer_state_bytes"] == 4 * trainable
    assert breakdown["peak_bytes"] == summary["peaks"]["host_rss_peak_sampled_bytes"]
    assert breakdown["rest_bytes"] == breakdown["peak_bytes"] - 4 * counts["total"] - 8 * trainable
    assert summary["train_loss_run_mean"] == pytest.approx(trainer.state.log_history[-1]["train_loss"])
    assert all(v is None for k, v in summary["peaks"].items() if k.startswith(CUDA_OR_NVML))

    phases = summary["phases"]
    assert list(phases) == ["model_loaded", "train_begin", "after_first_step", "end"]
    assert phases["model_loaded"]["optimizer_state_bytes"] is None  # no optimizer exists yet
    assert phases["train_begin"]["optimizer_state_bytes"] == 0  # built, state not allocated until step 1
    assert phases["after_first_step"]["step"] == 1 and phases["after_first_step"]["optimizer_state_bytes"] == (
        4 * trainable)
    assert all(phase["cuda_allocated_bytes"] is None and phase["nvml_used_bytes"] is None
               for phase in phases.values())


def test_run_writes_every_file_with_readable_plots(tmp_path):
    recipe = {"model": {"name": "tiny"}, "training": {"optim": "adamw_torch", "max_steps": 6}}
    run_dir = tmp_path / "run"
    trainer, _ = sft_run(tmp_path, "adamw_torch", run_dir, steps=6, eval_steps=3, recipe=recipe, ema_beta=0.5)
    result = trainer.train()

    names = {p.name for p in run_dir.iterdir()}
    assert {"metrics.jsonl", "summary.json", "recipe.yaml", "loss.png", "memory.png", "dashboard.png"} <= names
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text()) == recipe
    records = read_records(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 7)) and [r["step"] for r in evals] == [3, 6]
    assert all(isinstance(r["eval_loss"], float) for r in evals)
    # TRL counts the tokens of each batch itself (num_tokens); the forward hook must agree.
    assert train[-1]["tokens_seen"] == train[-1]["trainer_logs"]["num_tokens"]

    summary = read_summary(run_dir)
    losses = [r["loss"] for r in train]
    assert summary["final_loss"] == losses[-1]
    beta = summary["ema_beta"]
    assert beta == 0.5
    smoothed, weight = 0.0, 0.0
    for loss in losses:  # bias-corrected EMA, written out
        smoothed, weight = beta * smoothed + (1 - beta) * loss, beta * weight + (1 - beta)
    assert summary["ema_loss"] == pytest.approx(smoothed / weight)
    assert summary["train_loss_run_mean"] == pytest.approx(result.training_loss)
    assert summary["optimizer"]["name"] == "AdamW"
    assert set(summary["versions"]) >= {"torch", "transformers", "trl", "peft", "bitsandbytes", "hf_optim"}
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["hardware"]["device"] == "cpu" and summary["hardware"]["gpu"] is None

    for name in ("loss.png", "memory.png", "dashboard.png"):
        assert_png_drawn(run_dir / name)
    run = load_run(run_dir)
    loss_text = figure_texts(loss_figure(run))
    assert "RUN MEAN" in loss_text and "eval_loss" in loss_text and "loss (EMA, beta=0.5)" in loss_text
    memory_text = figure_texts(memory_figure(run))
    assert "host RSS" in memory_text and "after step 1" in memory_text and "GPU capacity" not in memory_text
    assert "too few" not in memory_text + loss_text
    # the dashboard's small memory panel names its phase lines too (issue 43: they were unlabelled)
    dashboard_text = figure_texts(dashboard_figure(run))
    assert "1: model loaded / train begin (step 0)" in dashboard_text and "after step 1" in dashboard_text


def test_too_few_points_are_said_on_the_figures(tmp_path):
    run_dir = tmp_path / "one_step"
    trainer, _ = sft_run(tmp_path, "adamw_torch", run_dir, steps=1)
    trainer.train()
    run = load_run(run_dir)
    assert "only 1 training loss point: too few for a curve" in figure_texts(loss_figure(run))
    assert "only 1 grad-norm point" in figure_texts(dashboard_figure(run))
    for name in ("loss.png", "memory.png", "dashboard.png"):
        assert_png_drawn(run_dir / name)

    (run_dir / "metrics.jsonl").write_text("")  # a run that logged nothing at all
    run = load_run(run_dir)
    assert "no training loss logged" in figure_texts(loss_figure(run))
    for path in plot_run(run_dir):
        assert_png_drawn(path)


def test_record_oom_keeps_what_was_logged(tmp_path):
    run_dir = tmp_path / "oom"
    trainer, monitor = sft_run(tmp_path, "lion_8bit", run_dir, steps=6, callbacks=[RaiseOomAt(3)],
                               recipe={"training": {"optim": "lion_8bit"}})
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.train()
    assert monitor.record_oom(caught.value) == run_dir / "summary.json"

    summary = read_summary(run_dir)
    assert summary["status"] == "oom" and summary["error"]["type"] == "OutOfMemoryError"
    assert "Tried to allocate 2.00 GiB" in summary["error"]["message"]
    assert summary["optimizer"]["name"] == "Lion8bit" and summary["optimizer_state"]["by_dtype"]["uint8"] > 0
    assert summary["oom_step"] == 3 and summary["global_step"] == 2  # failed during step 3, after 2 complete
    assert summary["phases"]["oom"]["step"] == 3 and "end" not in summary["phases"]
    assert [r["step"] for r in read_records(run_dir)] == [1, 2]
    assert (run_dir / "recipe.yaml").exists()
    assert "OOM at step 3" in figure_texts(loss_figure(load_run(run_dir)))
    for name in ("loss.png", "memory.png", "dashboard.png"):
        assert_png_drawn(run_dir / name)


def test_record_oom_before_training_started(tmp_path):
    monitor = TrainingMonitor(tmp_path / "early")
    monitor.record_oom(torch.OutOfMemoryError("CUDA out of memory while moving the model"))
    summary = read_summary(tmp_path / "early")
    assert summary["status"] == "oom" and summary["optimizer"] is None and summary["final_loss"] is None
    assert "no training loss logged" in figure_texts(loss_figure(load_run(tmp_path / "early")))


def test_ema_and_its_automatic_beta():
    assert ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])  # debiased by 1 - 0.5^t
    assert ema([4.0, 1.0], 0.0) == [4.0, 1.0]
    assert [auto_ema_beta(n) for n in (1, 10, 20, 50, 100, 5000)] == [0.0, 0.0, 0.5, 0.8, 0.9, 0.9]


def test_bad_arguments_and_missing_run_dir(tmp_path):
    with pytest.raises(ValueError, match="ema_beta=1.5 is not valid"):
        TrainingMonitor(tmp_path, ema_beta=1.5)
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        plot_run(tmp_path)


def test_resume_from_checkpoint_continues_the_same_files(tmp_path):
    run_dir = tmp_path / "run"

    def trainer_for(max_steps):
        config = SFTConfig(**common_args(tmp_path, "adamw_torch", output_dir=str(run_dir), max_steps=max_steps,
                                         save_strategy="steps", save_steps=2, **FAST), max_length=64)
        return SFTTrainer(model=tiny_llama(), args=config, train_dataset=text_dataset(64),
                          processing_class=tiny_tokenizer(), callbacks=[TrainingMonitor(run_dir, plots=False)])

    trainer_for(3).train()  # logs steps 1-3, checkpoint at step 2
    trainer = trainer_for(4)
    trainer.train(resume_from_checkpoint=str(run_dir / "checkpoint-2"))

    records = read_records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # step 3 of the first run was redone: logged once
    summary = read_summary(run_dir)
    assert summary["final_loss"] == records[-1]["loss"] and summary["global_step"] == 4
    # the phases of the first run up to its checkpoint stay; the resumed process marks where it took over
    phases = {name: snapshot["step"] for name, snapshot in summary["phases"].items()}
    assert phases == {"model_loaded": 0, "train_begin": 0, "after_first_step": 1, "resumed": 2, "end": 4}
    assert summary["resumed_at_step"] == 2
    # time and tokens go on from the last record kept (step 2), not from zero
    assert all(a["time_s"] <= b["time_s"] and a["tokens_seen"] < b["tokens_seen"] for a, b in zip(records, records[1:]))
    assert summary["tokens_seen"] == records[-1]["tokens_seen"]
    # loss.png's mean is the one `hf-optim train` prints after a resume: every logged step, not the Trainer's
    # train_loss of the resumed part alone (issue 43: the plot said 3.451 beside the terminal's 3.7624)
    logged_mean = sum(r["loss"] for r in records) / len(records)
    resumed_part = summary["train_loss_run_mean"]
    assert f"{resumed_part:.4f}" != f"{logged_mean:.4f}"
    loss_text = figure_texts(loss_figure(load_run(run_dir)))
    assert f"mean of all logged steps, those before the resume included = {logged_mean:.4f}" in loss_text
    assert f"{resumed_part:.4f}" not in loss_text


def test_tokens_come_from_the_trainer_when_it_counts_them(tmp_path):
    monitor = TrainingMonitor(tmp_path / "run", plots=False)
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=2, per_device_train_batch_size=2,
                                           include_num_input_tokens_seen="all"))
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=fixed_length_dataset(4, 16), callbacks=[monitor])
    trainer.train()
    summary = read_summary(tmp_path / "run")
    assert summary["tokens_source"] == "trainer"
    assert summary["tokens_seen"] == trainer.state.num_input_tokens_seen == 2 * 2 * 16
    assert [r["tokens"] for r in read_records(tmp_path / "run")] == [32, 32]


def test_gradient_accumulation_counts_every_micro_batch(tmp_path):
    monitor = TrainingMonitor(tmp_path / "run", plots=False)
    args = TrainingArguments(**common_args(tmp_path, "adamw_torch", max_steps=2, per_device_train_batch_size=2,
                                           gradient_accumulation_steps=3))
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=fixed_length_dataset(12, 16), callbacks=[monitor])
    trainer.train()
    records = read_records(tmp_path / "run")
    # One optimizer step = 3 micro-batches of 2 rows x 16 tokens; the hook sees each forward.
    assert [(r["step"], r["tokens"], r["steps_in_window"]) for r in records] == [(1, 96, 1), (2, 96, 1)]
    assert read_summary(tmp_path / "run")["tokens_source"] == "forward_hook"


def test_mean_step_time_is_steady_state_and_the_first_step_is_reported_apart(tmp_path, monkeypatch):
    """The first step includes compilation and optimizer state creation: summary.json's means leave it out."""
    import types

    from hf_optim.monitor import callback

    monitor = TrainingMonitor(tmp_path / "timing", plots=False)
    clock = iter([0.0, 5.0, 10.0, 10.1, 20.0, 20.3])  # step 1 takes 5 s, steps 2 and 3 take 0.1 s and 0.3 s
    monkeypatch.setattr(callback.time, "perf_counter", lambda: next(clock))
    state = types.SimpleNamespace(global_step=0)
    monitor._first_step = -1  # no phase snapshot (that needs a started run)
    for step in (1, 2, 3):
        state.global_step = step - 1
        monitor.on_step_begin(None, state, None)
        state.global_step = step
        monitor.on_step_end(None, state, None)
    speed = monitor._speed()
    assert speed["first_step_time_s"] == pytest.approx(5.0)
    assert speed["mean_step_time_s"] == pytest.approx(0.2)
