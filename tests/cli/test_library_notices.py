"""Other libraries' notices stay out of the user's console (issue 43), and hf_optim hides them narrowly: a filter on
one logger that drops one known message, never a change of a logger's level, handlers or propagation, nor of
logging as a whole; ``-v`` (and that logger at DEBUG) shows them (:mod:`hf_optim.notices`).

The console check is a fresh process that imports hf_optim, then what a training script imports (transformers'
Trainer, TRL, peft, bitsandbytes, accelerate, datasets, DeepSpeed where installed) and asks the `kernels` package for
the Hub kernel bitsandbytes asks it for. bitsandbytes asks on CPUs with AVX512-BF16 only, so the process asks itself:
the `kernels` notice is then logged on every machine, bitsandbytes' own on AVX512-BF16 machines, and DeepSpeed's
where torch finds no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_optim import notices

ROOT = Path(__file__).resolve().parents[2]

A_TRAINING_SCRIPTS_IMPORTS = textwrap.dedent("""
    import json, logging, sys

    import torch  # hf_optim imports it: its loggers exist before hf_optim's import, and must stay as they were

    def settings():
        manager = logging.root.manager
        found = {"<logging.disable>": manager.disable}
        for name, logger in [("<root>", logging.root), *manager.loggerDict.items()]:
            if isinstance(logger, logging.Logger) and not name.startswith("hf_optim"):
                found[name] = [logger.level, logger.disabled, logger.propagate,
                               [id(h) for h in logger.handlers], [type(f).__name__ for f in logger.filters]]
        return found

    before = settings()
    import hf_optim
    after_import = settings()
    import accelerate, bitsandbytes, datasets, peft, transformers, trl
    from transformers import Trainer
    from trl import SFTTrainer
    try:
        import deepspeed  # accelerate imports it in a Trainer run once it is installed (the test extra installs it)
    except ImportError:
        pass
    try:
        from kernels import get_kernel
    except ImportError:  # transformers < 5.25 does not install it
        pass
    else:
        try:  # offline: logs that it skips the publisher check, then finds no cached copy (as bitsandbytes does)
            get_kernel(hf_optim.notices._BNB_CPU_KERNEL, version=1)
        except Exception:
            pass
    with open(sys.argv[1], "w") as out:
        json.dump({"before": before, "after_import": after_import, "after": settings()}, out)
""")


def test_no_library_notice_reaches_the_console_and_no_logging_setting_changes(tmp_path):
    report = tmp_path / "settings.json"
    result = subprocess.run([sys.executable, "-c", A_TRAINING_SCRIPTS_IMPORTS, str(report)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "" and result.stdout == "", result.stderr + result.stdout
    found = json.loads(report.read_text())
    before, after_import, after = found["before"], found["after_import"], found["after"]
    # importing hf_optim changed no setting of a logger that existed (torch's, the root), nor logging.disable
    assert {name: after_import[name] for name in before} == before
    # the loggers it filters (created by the filter, before their library is imported): one filter, nothing else set
    for name in notices.OPTIONAL_KERNEL_NOTICES:
        assert after_import[name] == [logging.NOTSET, False, True, [], ["_Notice"]], name
    # once everything is imported, hf_optim's filter is on those loggers only, and the root is as it was
    filtered = {name for name, value in after.items() if name[0] != "<" and "_Notice" in value[4]}
    assert filtered == set(notices.OPTIONAL_KERNEL_NOTICES)
    assert after["<root>"] == before["<root>"] and after["<logging.disable>"] == 0


class Records(logging.Handler):
    """The messages that reach one logger's handlers (DeepSpeed's logger does not propagate to pytest's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("logger_name", sorted(notices.OPTIONAL_KERNEL_NOTICES))
def test_each_notice_is_hidden_and_nothing_else_unless_asked(logger_name):
    logger, records = logging.getLogger(logger_name), Records()
    level = logger.level
    logger.addHandler(records)
    try:
        for prefix in notices.OPTIONAL_KERNEL_NOTICES[logger_name]:
            text = prefix + "(the rest of the message)."
            # the same logger's other messages pass: another text, or the known text not at the start
            others = [f"another {logger_name} warning", "note: " + text]
            records.messages.clear()
            for message in (text, *others):
                logger.warning(message)
            assert records.messages == others
            records.messages.clear()
            logger.setLevel(logging.DEBUG)  # asking the library for its debug output shows it
            logger.warning(text)
            logger.setLevel(level)
            notices.show_optional_kernel_notices(True)  # hf-optim train -v
            try:
                logger.warning(text)
            finally:
                notices.show_optional_kernel_notices(False)
            assert records.messages == [text, text]
    finally:
        logger.setLevel(level)
        logger.removeHandler(records)


def test_the_kernels_notice_is_hidden_for_bitsandbytes_kernel_only(caplog):
    """`kernels` says the same of every kernel fetched offline: a user's own kernel is the user's concern."""
    logger = logging.getLogger("kernels._internals.hf_hub")
    message = "Skipping publisher trust check for '{}' because Hugging Face Hub is in offline mode."
    with caplog.at_level(logging.WARNING):
        for repo in (notices._BNB_CPU_KERNEL, "someone/their-kernel", notices._BNB_CPU_KERNEL + "-v2"):
            logger.warning(message.format(repo))
    assert [r.getMessage() for r in caplog.records] == [message.format("someone/their-kernel"),
                                                        message.format(notices._BNB_CPU_KERNEL + "-v2")]


WHERE = {"DeepSpeed": ("deepspeed.accelerator.real_accelerator", "deepspeed.utils.logging")}
"""Logger -> (the module that logs its notice, the module that names the logger), where that is not the module
whose name the logger has (``logging.getLogger(__name__)``): DeepSpeed logs through one logger it names itself."""


def test_the_filters_name_the_loggers_and_messages_the_libraries_use():
    """The filters match the installed libraries' source: a renamed logger or reworded notice fails here too, on
    machines where the library never logs it (bitsandbytes asks for its kernel on AVX512-BF16 CPUs only; DeepSpeed
    logs its notice where torch finds no GPU)."""
    checked = []
    for logger_name, prefixes in notices.OPTIONAL_KERNEL_NOTICES.items():
        logs, names = WHERE.get(logger_name, (logger_name, logger_name))
        if importlib.util.find_spec(logs.split(".")[0]) is None:
            continue  # not installed here (kernels before transformers 5.25): nothing logs that notice
        source = Path(importlib.util.find_spec(logs).origin).read_text()
        naming = Path(importlib.util.find_spec(names).origin).read_text()
        assert ("getLogger(__name__)" if names == logs else f'"{logger_name}"') in naming, logger_name
        for prefix in prefixes:
            # the source holds the text up to its first formatted value (an f-string's {repo_id})
            literal = prefix.split(notices._BNB_CPU_KERNEL)[0]
            assert literal in source, (logger_name, literal)
        checked.append(logger_name)
    assert "bitsandbytes.backends.cpu.ops" in checked  # (a test dependency)
    bitsandbytes_cpu_ops = Path(importlib.util.find_spec("bitsandbytes.backends.cpu.ops").origin).read_text()
    assert f'"{notices._BNB_CPU_KERNEL}"' in bitsandbytes_cpu_ops  # the kernel whose `kernels` notice is hidden


def test_native_lines_are_dropped_by_pattern_and_the_rest_printed(capfd):
    """The profiler's C++ lines (real_shape's memory measurement starts and stops it every step) are dropped; what
    else reaches file descriptor 2 meanwhile comes out after the block, in order."""
    from torch.profiler import ProfilerActivity, profile

    from hf_optim.recipes.real_shape import _PROFILER_LINE

    with notices.native_lines_hidden(_PROFILER_LINE):
        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        profiler.start()
        os.write(2, b"USDT:2026-12-07 14:13:11 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"USDT: a line of someone else's\n")
        os.write(2, b"a line of this process\n")  # (pytest replaces sys.stderr: it would not reach descriptor 2)
        profiler.stop()
        os.write(2, b"a last line without newline")
    kept = "USDT: a line of someone else's\na line of this process\na last line without newline"
    assert capfd.readouterr().err == kept
    notices.show_optional_kernel_notices(True)  # -v: everything shows, as it is printed
    try:
        with notices.native_lines_hidden(_PROFILER_LINE):
            os.write(2, b"USDT:2026-12-07 14:13:11 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    finally:
        notices.show_optional_kernel_notices(False)
    assert capfd.readouterr().err == "USDT:2026-12-07 14:13:11 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
