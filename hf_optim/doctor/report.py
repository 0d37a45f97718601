"""The doctor's run: collect the machine's facts, self-test, time, then print tables (rich, or plain columns without
it) or one JSON object."""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import sys
import warnings
from collections.abc import Iterator, Sequence

import torch

from hf_optim.doctor import machine, selftest
from hf_optim.kernels.torch_path import compile_guard
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.optim import registry


class UsageError(ValueError):
    """A bad ``--device`` or ``--algorithms`` value (one line, exit status 2)."""


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; valid: cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: the doctor checks cpu and cuda devices")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {name!r}: no CUDA device is visible (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {name!r}: only cuda:0 to cuda:{count - 1} exist")
    return device


def pick_families(names: str | None) -> list[registry.Family]:
    known = {family.algorithm.name: family for family in registry.families()}
    if names is None:
        return list(known.values())
    chosen = []
    for name in (part.strip() for part in names.split(",") if part.strip()):
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"--algorithms: no algorithm {name!r}{hint}; registered: {', '.join(sorted(known))}")
        chosen.append(known[name])
    if not chosen:
        raise UsageError(f"--algorithms is empty; registered: {', '.join(sorted(known))}")
    return chosen


@contextlib.contextmanager
def _quiet_compile_notices() -> Iterator[None]:
    """The doctor lists compiles in its own table: hf_optim's per-compile INFO lines would only interleave."""
    logger = logging.getLogger("hf_optim")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


NO_EAGER_TIMINGS = ("on the CPU the timed steps time the compiled kernels a training run uses: hf-optim doctor "
                    "--compiled (it compiles each algorithm's kernel first: minutes on a cold cache)")


def collect(args, progress=None, machine_known=None) -> dict:
    """Everything the doctor reports, as plain data (what ``--json`` prints); ``machine_known`` (default None) is
    called with the versions, devices and caches as soon as they are known, before the self-test."""
    device = pick_device(args.device)
    families = pick_families(args.algorithms)
    interpret = bool(args.interpret)
    if interpret and device.type != "cpu":
        raise UsageError("--interpret runs the Triton kernels on the CPU; leave out --device or use --device cpu")
    cand = selftest.candidate(device, interpret, bool(getattr(args, "compiled", False)))
    report = {
        "versions": machine.versions(),
        "devices": [machine.describe_device(d, interpret) for d in machine.devices()],
        "caches": machine.caches(),
    }
    if machine_known is not None:
        machine_known(report)
    # An eager CPU step is the reference, not what training runs (it takes seconds where the compiled kernel takes
    # milliseconds): timing it would mislead, so on the CPU the timed steps need the compiled kernels.
    eager_cpu = device.type == "cpu" and cand.name == "torch"
    timed = not args.quick and not eager_cpu
    with _quiet_compile_notices(), warnings.catch_warnings():
        # the interpreter computes fp16 in numpy, which warns when a value overflows to inf (as the GPU does, silently)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
        cases = selftest.self_test(device, cand, families, progress=progress)
        timings = selftest.timings(device, cand, families, selftest.TIMING_NUMEL, progress=progress) if timed else None
    report["self_test"] = {
        "device": str(device),
        "backend": cand.name,
        "reference": selftest.REFERENCE,
        "steps": selftest.STEPS,
        "shapes": [list(shape) for shape in selftest.SHAPES],
        "tolerances": {t.name: t.why for t in (selftest.EXACT, selftest.CPU_MATH, selftest.REDUCTIONS)},
        "cases": selftest.as_dicts(cases),
    }
    report["timings"] = None if timings is None else {
        "device": str(device), "numel": selftest.TIMING_NUMEL, "backend": cand.name,
        "steps": selftest.as_dicts(timings)}
    report["timings_skipped"] = ("--quick" if args.quick else NO_EAGER_TIMINGS if eager_cpu else None)
    report["triton_compiles"] = selftest.as_dicts(triton_guard.compile_records())
    report["fallbacks"] = {"triton": selftest.as_dicts(triton_guard.failures()),
                           "torch_compile": compile_guard.failures()}
    report["ok"] = all(case.ok for case in cases)
    return report


def run(args) -> int:
    console = _console(stderr=bool(args.json))
    try:
        if args.json:
            report = collect(args)
            print(json.dumps(report, indent=2, default=str))
        else:
            with _progress(console) as progress:
                report = collect(args, progress, lambda known: render_machine(known, console))
            render(report, console, machine_shown=True)
    except UsageError as error:
        print(f"hf-optim doctor: error: {error}", file=sys.stderr)
        return 2
    return 0 if report["ok"] else 1


# ----------------------------------------------------------------------------------------------------------------
# Output
def _console(stderr: bool = False):
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console(stderr=stderr, soft_wrap=True)
    return console if console.is_terminal else Console(stderr=stderr, soft_wrap=True, width=200)


@contextlib.contextmanager
def _progress(console) -> Iterator:
    """A one-line status while the cases run on a terminal (with rich); else one line per case on stderr, so that
    a redirected doctor shows where it is."""
    if console is None or not console.is_terminal:
        def line(text: str) -> None:
            print(f"doctor: {text}", file=sys.stderr, flush=True)

        yield line
        return
    with console.status("self-test") as status:
        yield lambda text: status.update(f"self-test: {text}")


def _table(console, title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    if console is None:  # rich is not installed: plain columns
        print(f"\n{title}")
        widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
        return
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console.print(table)


def _line(console, text: str) -> None:
    if console is None:
        print(text)
    else:
        console.print(text, highlight=False)


def _ulps(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def render_machine(report: dict, console) -> None:
    """The versions, devices and caches tables (printed before the self-test runs)."""
    versions = report["versions"]
    _table(console, "Versions", ("package", "version"),
           [(name, version or ("none" if name.startswith("cuda") else "not installed"))
            for name, version in versions.items()])
    _table(console, "Devices", ("device", "name", "arch", "backend", "PyTorch path", "paged optimizers"),
           [(d["device"], d["name"], d["arch"], d["backend"], d["pytorch_path"], d["paging"])
            for d in report["devices"]])
    _table(console, "Caches of compiled kernels", ("compiler", "directory"), list(report["caches"].items()))
    if console is None:
        sys.stdout.flush()  # a redirected stdout is block-buffered: the file shows them now, not at the end
    else:
        console.file.flush()


def render(report: dict, console, machine_shown: bool = False) -> None:
    if not machine_shown:
        render_machine(report, console)
    test = report["self_test"]
    title = (f"Self-test on {test['device']}: {test['backend']} against {test['reference']}, {test['steps']} steps "
             f"on shapes {', '.join('x'.join(map(str, s)) for s in test['shapes'])}")
    _table(console, title, ("algorithm", "state", "params", "result", "tolerance", "param ulps", "state ulps",
                            "codes differing", "detail"),
           [(c["algorithm"], c["state"], c["dtype"], c["status"], c["tolerance"], _ulps(c["param_ulps"]),
             _ulps(c["state_ulps"]), f"{c['codes_differing']}/{c['codes']}" if c["codes"] else "-", c["detail"])
            for c in test["cases"]])
    if test["backend"] == "torch" and test["device"] == "cpu":
        _line(console, "the CPU ran the eager PyTorch path, which is the reference itself: this checks that every case "
                       "runs. --compiled checks the compiled kernels a run uses (minutes on a cold cache); "
                       "--interpret checks the Triton kernels")
    used = {c["tolerance"] for c in test["cases"]}
    for name, why in test["tolerances"].items():
        if name in used:
            _line(console, f"tolerance {name!r}: {why}")
    if report["timings_skipped"] == NO_EAGER_TIMINGS:
        _line(console, f"no timed steps: {NO_EAGER_TIMINGS}")
    if report["timings"] is not None:
        timing = report["timings"]
        _table(console, f"One step on a {timing['numel']:,}-element fp32 parameter on {timing['device']} "
                        f"({timing['backend']}; median of 5 after 2 warm-up steps)",
               ("optimizer", "ms", "vs fused AdamW", "note"),
               [(t["name"], "-" if t["milliseconds"] is None else f"{t['milliseconds']:.2f}",
                 "-" if t["ratio"] is None else f"{t['ratio']:.2f}x", t["note"]) for t in timing["steps"]])
    if report["triton_compiles"]:
        _table(console, f"Triton kernels prepared (cache: {report['caches']['triton']})",
               ("kernel", "arch", "seconds", "compiled or loaded", "from the disk cache"),
               [(r["label"], r["arch"], f"{r['seconds']:.1f}", r["kernels"], r["cache_hits"])
                for r in report["triton_compiles"]])
    fallbacks = report["fallbacks"]
    for failure in fallbacks["triton"]:
        _line(console, f"FELL BACK: Triton kernel {failure['label']} on {failure['device']} ({failure['arch']}, "
                       f"Triton {failure['triton_version']}): {failure['error']}")
    for device, error in fallbacks["torch_compile"].items():
        _line(console, f"FELL BACK: torch.compile on {device}: {error}")
    bad = [c for c in test["cases"] if c["status"] not in ("exact", "within tolerance")]
    if bad:
        _line(console, f"{len(bad)} of {len(test['cases'])} cases failed: "
                       f"{', '.join(sorted({c['status'] for c in bad}))} (exit status 1)")
    else:
        _line(console, f"all {len(test['cases'])} cases match on {test['backend']}")
