"""What ``hf-optim train quickstart`` prints (issue 16): hf_optim's lines, one progress bar and the summary; with
``-v`` everything the libraries print.

The quiet run is a fresh process, as a user starts it: notices printed when packages are first imported count.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_optim import cli

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

# Every line the quiet run may print. hf_optim's own lines are about this run: what `auto` became, the optimizer
# built for training.optim (once: hf-optim train adds no second line for the same mapping), and that a paged
# optimizer runs unpaged here (a CPU has no CUDA managed memory).
ALLOWED = [
    r"\[hf_optim\] training\.bf16: auto -> False",
    r"\[hf_optim\] optim='paged_adamw_8bit' -> hf_optim\.PagedAdamW8bit \(8-bit blockwise, paged, backend=.*\)",
    r"\[hf_optim\] warning: paged optimizers page CUDA state to host memory, but PagedAdamW8bit has state on cpu "
    r"\(.*\); its state is kept in ordinary cpu memory and it runs exactly as AdamW8bit\.",
    rf"\s*\d+%\|[^|]*\| \d+/{STEPS} \[[^\]]*\]",  # the training progress bar, redrawn in place
    r"done: optimizer hf_optim\.PagedAdamW8bit, train loss \(run mean\) \d+\.\d+",
    r"optimizer state: [\d.]+ MiB \(float32 [\d.]+, uint8 [\d.]+\)",
    r"run directory: .*\(recipe\.yaml, metrics\.jsonl, summary\.json, loss\.png, memory\.png, dashboard\.png\)",
    # the optimizer's CPU kernel: compiling it (in a background process, once per cache), and how long it took
    # (a busy machine adds the one-thread variant)
    r"\[hf_optim\] compiling the optimizer's CPU kernel for adamw_rule, blockwise8 \+ blockwise8 state, .*"
    r" \(once, cached in .*\)",
    r"\[hf_optim\] compiled the optimizer's CPU kernel for adamw_rule, .* in [\d.]+ s"
    r"( \(in a background process; loaded( from the cache)? in [\d.]+ s\))?",
    # or loading it, compiled by an earlier run (a warm cache)
    r"\[hf_optim\] loaded the optimizer's CPU kernel for adamw_rule, .*, compiled before, in [\d.]+ s",
]
COMPILE_LINES = 3


def printed_lines(text: str) -> list[str]:
    """The lines a terminal would show at some point (progress bars redraw a line with carriage returns)."""
    return [part.strip() for line in text.splitlines() for part in line.split("\r") if part.strip()]


def test_quickstart_prints_only_its_own_lines_one_bar_and_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "hf_optim.cli", "train", "quickstart", f"training.max_steps={STEPS}",
                             f"training.output_dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120",
                                              "HF_OPTIM_COMPILE": "auto",  # a user's default (tests run with 0)
                                              # an empty cache, as on a fresh machine: the tiny model is written
                                              "HF_OPTIM_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = printed_lines(result.stdout + result.stderr)
    unexpected = [line for line in lines if not any(re.fullmatch(pattern, line) for pattern in ALLOWED)]
    assert not unexpected, "\n".join(unexpected)
    bars = [line for line in lines if re.fullmatch(ALLOWED[3], line)]
    assert bars and bars[-1].startswith("100%") and f"{STEPS}/{STEPS}" in bars[-1]
    assert "loss=" in bars[-1]  # the bar shows the loss instead of a printed dict per step
    for pattern in ALLOWED[:3] + ALLOWED[4:-COMPILE_LINES]:  # each of hf_optim's lines and the summary once
        assert sum(bool(re.fullmatch(pattern, line)) for line in lines) == 1, pattern
    # the first step says what it compiles and where it is cached, or that it loads what an earlier run compiled
    starts = (ALLOWED[-COMPILE_LINES], ALLOWED[-1])
    assert any(re.fullmatch(pattern, line) for pattern in starts for line in lines)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    adapter = json.loads((run_dir / "adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]).parent == tmp_path / "cache"  # where peft found its config


def test_verbose_shows_what_the_libraries_print(tmp_path, capsys):
    assert cli.main(["train", "quickstart", "-v", "training.max_steps=2", f"training.output_dir={tmp_path}"]) == 0
    captured = capsys.readouterr()
    lines = printed_lines(captured.out + captured.err)
    assert any(line.startswith("{'loss': ") for line in lines)  # the Trainer's own log dict, one per step
    assert any(line.startswith("{'train_runtime': ") for line in lines)


@pytest.mark.parametrize("verbose", [False, True])
def test_quiet_console_hides_only_third_party_deprecations_and_known_notices(verbose, capsys, caplog):
    import logging
    import warnings

    from hf_optim.notices import show_optional_kernel_notices
    from hf_optim.recipes.console import quiet_console

    notices = logging.getLogger("bitsandbytes.backends.cpu.ops")
    show_optional_kernel_notices(verbose)  # what `-v` does (import hf_optim hides them in every process)
    with warnings.catch_warnings(record=True) as recorded, quiet_console(not verbose):
        if verbose:
            warnings.simplefilter("always")  # (quiet_console's own filters come first when it is on)
        third_party = {"__name__": "somepackage.module"}
        exec("import warnings\nwarnings.warn('old api', FutureWarning)", third_party)
        exec("import warnings\nwarnings.warn('check your data', UserWarning)", third_party)
        exec("import warnings\nwarnings.warn('hf_optim: about your run', FutureWarning)", {"__name__": "hf_optim.x"})
        notices.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "No module named 'kernels'")
        notices.warning("something else")
    show_optional_kernel_notices(False)
    err = capsys.readouterr().err + "".join(f"{w.message}\n" for w in recorded)  # recorded: what -v would show
    logged = [record.getMessage() for record in caplog.records]
    assert "check your data" in err and "about your run" in err and "something else" in logged
    assert ("old api" in err) is verbose
    assert any("gemm_4bit_forward" in message for message in logged) is verbose
    if not verbose:  # one line each, hf_optim's marked as its own
        assert "warning (somepackage, UserWarning): check your data" in err.splitlines()
        assert "[hf_optim] warning: about your run" in err.splitlines()
