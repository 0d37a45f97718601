"""Every peer suite against hf_optim in both compile modes, side by side (``run_peer_suites.py all``).

    python benchmarks/contracts/run_peer_suites.py all --bitsandbytes BNB_CHECKOUT \\
        --transformers TRANSFORMERS_CHECKOUT/tests/trainer/test_trainer_optimizers.py --torch PYTORCH_CHECKOUT \\
        [--out DIR] [--plain] [--suites bitsandbytes,transformers,torch] [--modes default,0] [--classes SET]
        [--select SUITE=EXPR]

Each suite runs once per mode, one after another, in its own pytest process (``run_peer_suites.py SUITE``):

- ``default``: ``HF_OPTIM_COMPILE`` unset, as a user runs, with a fresh ``TORCHINDUCTOR_CACHE_DIR`` under DIR, so
  the kernels compile in the background and load while the tests step (the path of issue 43's crash);
- ``0``: ``HF_OPTIM_COMPILE=0``, every step eager.

``--report DIR [DIR ...]`` prints the summary again from the logs and JUnit XML that earlier runs left (runs split
over several DIRs are put side by side; a run's exit code is then read from its XML: 1 with failures, else 0).
``--plain`` adds each suite's baseline (the peer's tests against the peer's own classes, no hf_optim). Each run
leaves its pytest log and JUnit XML in DIR; the summary (DIR/summary.md, also printed) has the counts, every failure
only the default mode shows, every failure both modes show and every failure only ``HF_OPTIM_COMPILE=0`` shows,
each with the first line of its message, and marks a failure the baseline shows too. A run whose pytest exited
with an internal error or a crash (exit code other than 0 or 1) is flagged. Timings are wall seconds on whatever
machine ran it: say how loaded it was (the summary records ``uptime``) before comparing them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITES = ("bitsandbytes", "transformers", "torch")
MODES = ("default", "0")
MODE_TITLE = {"default": "default (HF_OPTIM_COMPILE unset, cold cache)", "0": "HF_OPTIM_COMPILE=0",
              "plain": "baseline (no hf_optim)"}


@dataclass
class Run:
    suite: str
    mode: str
    rc: int
    wall_s: float
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> passed / failed / error / skipped
    messages: dict[str, str] = field(default_factory=dict)  # test id -> first line of its failure
    internal_error: bool = False

    def count(self, outcome: str) -> int:
        return sum(1 for value in self.outcomes.values() if value == outcome)

    def failures(self) -> set[str]:
        return {test for test, outcome in self.outcomes.items() if outcome in ("failed", "error")}


def read_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """pytest's JUnit XML: each test case's outcome and the first line of its failure message."""
    outcomes, messages = {}, {}
    if not path.exists():
        return outcomes, messages
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome = name
                if name != "skipped":
                    text = element.get("message") or element.text or ""
                    messages[test] = next((line.strip() for line in text.splitlines() if line.strip()), "")[:220]
                break
        outcomes[test] = outcome
    return outcomes, messages


def run_suite(suite: str, target: str, mode: str, out: Path, classes: str | None, select: str | None = None) -> Run:
    label = f"{suite}-{mode}"
    xml, log = out / f"{label}.xml", out / f"{label}.log"
    env = dict(os.environ)
    env.pop("HF_OPTIM_COMPILE", None)
    if mode == "0":
        env["HF_OPTIM_COMPILE"] = "0"
    cache = out / f"inductor-{label}"  # a fresh cache per run: the default mode compiles from cold
    cache.mkdir(parents=True, exist_ok=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    command = [sys.executable, str(HERE / "run_peer_suites.py"), suite, target]
    if mode == "plain":
        command.append("--plain")
    if suite == "torch" and classes:
        command += ["--classes", classes]
    if select:
        command += ["-k", select]
    command += [f"--junitxml={xml}", "-rfEs"]
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    with open(log, "w") as handle:
        rc = subprocess.call(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    outcomes, messages = read_junit(xml)
    text = log.read_text(errors="replace")
    run = Run(suite, mode, rc, wall, outcomes, messages, "INTERNALERROR" in text)
    print(f"    rc {rc}, {run.count('passed')} passed, {run.count('failed') + run.count('error')} failed, "
          f"{run.count('skipped')} skipped, {wall:.0f} s; log {log}", flush=True)
    return run


def load_run(xml: Path) -> Run:
    """A run from the files an earlier run left: its JUnit XML (outcomes, pytest's own time) and its log."""
    suite, mode = xml.stem.rsplit("-", 1)
    outcomes, messages = read_junit(xml)
    suites = list(ET.parse(xml).getroot().iter("testsuite"))
    wall = sum(float(node.get("time", 0)) for node in suites)
    log = xml.with_suffix(".log")
    internal = log.exists() and "INTERNALERROR" in log.read_text(errors="replace")
    failed = any(outcome in ("failed", "error") for outcome in outcomes.values())
    return Run(suite, mode, 1 if failed else 0, wall, outcomes, messages, internal)


def report(dirs: list[str]) -> int:
    runs = [load_run(xml) for folder in dirs for xml in sorted(Path(folder).glob("*-*.xml"))
            if xml.stem.rsplit("-", 1)[-1] in (*MODES, "plain")]
    if not runs:
        raise SystemExit(f"error: no SUITE-MODE.xml in {', '.join(dirs)}: give the --out folders of earlier runs")
    print(summary(runs, [f"report of {', '.join(dirs)} (pytest's own times)"]))
    return 0


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "uptime: not available"


def summary(runs: list[Run], load: list[str]) -> str:
    lines = ["# Peer suites against hf_optim", "", *(f"- load: {line}" for line in load), ""]
    modes = [mode for mode in ("default", "0", "plain") if any(run.mode == mode for run in runs)]
    lines.append("| suite | " + " | ".join(f"{MODE_TITLE[m]}: passed / failed / skipped (rc, s)" for m in modes)
                 + " |")
    lines.append("|---|" + "---|" * len(modes))
    by_key = {(run.suite, run.mode): run for run in runs}
    for suite in dict.fromkeys(run.suite for run in runs):
        cells = []
        for mode in modes:
            run = by_key.get((suite, mode))
            if run is None:
                cells.append("not run")
                continue
            flag = " **INTERNALERROR**" if run.internal_error else ""
            flag += " **crashed**" if run.rc not in (0, 1) else ""
            cells.append(f"{run.count('passed')} / {run.count('failed') + run.count('error')} / "
                         f"{run.count('skipped')} ({run.rc}, {run.wall_s:.0f}){flag}")
        lines.append(f"| {suite} | " + " | ".join(cells) + " |")
    for suite in dict.fromkeys(run.suite for run in runs):
        default, eager, plain = (by_key.get((suite, mode)) for mode in ("default", "0", "plain"))
        if default is None or eager is None:
            continue
        baseline = plain.failures() if plain else set()
        sections = (
            ("Failures with the default compile mode only", default.failures() - eager.failures(), default),
            ("Failures in both modes", default.failures() & eager.failures(), default),
            ("Failures with HF_OPTIM_COMPILE=0 only", eager.failures() - default.failures(), eager),
        )
        for title, tests, source in sections:
            lines += ["", f"## {suite}: {title} ({len(tests)})", ""]
            tally = Counter(source.messages.get(test, "")[:80] for test in tests)
            if len(tests) > 3:
                lines += [f"by message: {'; '.join(f'{n} x `{text}`' for text, n in tally.most_common())}", ""]
            for test in sorted(tests):
                mark = " (baseline fails too)" if test in baseline else ""
                lines.append(f"- `{test}`{mark}: {source.messages.get(test, '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="run_peer_suites.py all", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bitsandbytes", help="a bitsandbytes checkout (its root)")
    parser.add_argument("--transformers", help="transformers' tests/trainer/test_trainer_optimizers.py")
    parser.add_argument("--torch", help="a PyTorch checkout (its root, test/ or test/test_optim.py)")
    parser.add_argument("--out", help="where the logs, JUnit XML and summary.md go (default: a new temp dir)")
    parser.add_argument("--plain", action="store_true", help="also each suite's baseline, without hf_optim")
    parser.add_argument("--suites", default=",".join(SUITES), help="which of the given suites to run")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="default, 0, plain (the baseline), separated by commas (default: default,0)")
    parser.add_argument("--classes", help="torch suite: representative (default), all, or class names")
    parser.add_argument("--select", action="append", default=[], metavar="SUITE=EXPR",
                        help="run only the tests of SUITE that pytest's -k EXPR selects (a partial run: say so)")
    parser.add_argument("--report", nargs="+", metavar="DIR", help="only print the summary of earlier runs' DIRs")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report)
    targets = {suite: getattr(args, suite) for suite in SUITES}
    wanted = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SUITES] + [m for m in args.modes.split(",") if m not in (*MODES, "plain")]
    if bad:
        parser.error(f"unknown suite or mode {', '.join(bad)}; suites: {', '.join(SUITES)}; modes: "
                     f"{', '.join(MODES)}")
    chosen = [s for s in wanted if targets[s]]
    if not chosen:
        parser.error("give at least one of --bitsandbytes, --transformers, --torch")
    for suite in chosen:
        if not Path(targets[suite]).exists():
            parser.error(f"--{suite} {targets[suite]} does not exist")
    select = dict(item.split("=", 1) for item in args.select if "=" in item)
    if any("=" not in item for item in args.select) or set(select) - set(SUITES):
        parser.error(f"--select takes SUITE=EXPR with SUITE among {', '.join(SUITES)}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="peer-suites-"))
    out.mkdir(parents=True, exist_ok=True)
    modes = list(dict.fromkeys(args.modes.split(",") + (["plain"] if args.plain else [])))
    load = [f"start {uptime()}"]
    runs = [run_suite(suite, targets[suite], mode, out, args.classes, select.get(suite))
            for suite in chosen for mode in modes]
    load.append(f"end {uptime()}")
    text = summary(runs, load)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"written: {out / 'summary.md'}")
    return 0 if all(run.rc in (0, 1) and not run.internal_error for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
