"""The command line: ``python -m hf_optim.gpu_static`` (also ``python benchmarks/gpu/gpu_static.py``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import triton
from triton import knobs

from hf_optim.gpu_static.kernel_layer import kernel_layer_configs
from hf_optim.gpu_static.launch_config import LaunchConfig
from hf_optim.gpu_static.report import markdown, print_table, problems
from hf_optim.gpu_static.runner import run
from hf_optim.gpu_static.targets import ARCHES

DESCRIPTION = ("The GPU kernels without a GPU: every Triton kernel configuration the optimizers launch, compiled ahead "
               "of time.")
"""``--help``'s description: the first line of :mod:`hf_optim.gpu_static`'s docstring."""


def environment(argv: Sequence[str]) -> dict:
    """What a run saves beside its rows: Triton's version, the date, the machine and its load, the command line (under
    the script's name, as every saved table names it; the script still runs it)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {"triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, load {load[0]:.1f} at start",
            "command": "python benchmarks/gpu/gpu_static.py " + " ".join(argv)}


def merge(runs: Sequence[dict]) -> dict:
    """One saved run from several (``--json`` files of arch subsets): rows in configuration order, a later run's row
    replacing an earlier one for the same configuration and arch."""
    configs = list(dict.fromkeys(name for run in runs for name in run["configs"]))
    arches = [arch for arch in ARCHES if any(arch in run["arches"] for run in runs)]
    rows = {(row["config"], row["arch"]): row for run in runs for row in run["rows"]}
    order = {key: i for i, key in enumerate((c, a) for c in configs for a in arches)}
    environment = dict(runs[0]["environment"])
    if len(runs) > 1:
        environment["command"] = " ; ".join(run["environment"]["command"] for run in runs)
        environment["machine"] = " ; ".join(dict.fromkeys(run["environment"]["machine"] for run in runs))
    return {"environment": environment, "arches": arches, "configs": configs,
            "rows": sorted(rows.values(), key=lambda row: order.get((row["config"], row["arch"]), len(order)))}


def select(configs: Sequence[LaunchConfig], kernels: str | None) -> list[LaunchConfig]:
    """The configurations whose name contains one of the comma-separated ``kernels`` substrings."""
    if not kernels:
        return list(configs)
    wanted = [word.strip() for word in kernels.split(",") if word.strip()]
    chosen = [c for c in configs if any(word in c.name for word in wanted)]
    if not chosen:
        groups = sorted({c.name.split(" ")[0] for c in configs})
        raise SystemExit(f"--kernels {kernels!r} matches no configuration; names look like: {', '.join(groups)}")
    return chosen


def parse_arches(text: str) -> list[str]:
    arches = [a.strip() if a.strip().startswith("sm_") else f"sm_{a.strip()}" for a in text.split(",") if a.strip()]
    unknown = [a for a in arches if a not in ARCHES]
    if unknown or not arches:
        raise SystemExit(f"--arch {text!r}: unknown {', '.join(unknown) or 'empty'}; use some of {', '.join(ARCHES)}")
    return arches


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``prog`` (default: the script's file name, as argparse gives it) names the command."""
    result = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--arch", default=",".join(ARCHES), help="comma-separated arches (default: all five)")
    result.add_argument("--kernels", help="comma-separated substrings of configuration names (e.g. adamw,lamb/)")
    result.add_argument("--json", type=Path, help="also write every row as JSON to this file")
    result.add_argument("--jobs", type=int, default=1, help="parallel compile processes (default 1)")
    result.add_argument("--from-json", type=Path, nargs="+", help="render saved --json runs (merged) instead of "
                        "compiling")
    result.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    result.add_argument("--list", action="store_true", help="list the configurations and exit")
    result.add_argument("--check", action="store_true", help="exit 1 if a configuration spills, uses local memory "
                        "or fails to compile")
    return result


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = parser(prog)
    args = cli.parse_args(argv)
    if args.jobs < 1:
        cli.error(f"--jobs {args.jobs}: must be at least 1")
    if args.from_json:
        rows, env = _saved(args, cli)
    else:
        compiled = _compiled(args, argv)
        if compiled is None:  # --list printed the names
            return 0
        rows, env = compiled
    if args.markdown:
        print(markdown(rows, env))
    else:
        print_table(rows, env)
    return 1 if args.check and problems(rows) else 0


def _saved(args: argparse.Namespace, cli: argparse.ArgumentParser) -> tuple[list[dict], dict]:
    """(rows, environment) of the ``--from-json`` runs, merged (and written to ``--json`` if given)."""
    unreadable = [str(path) for path in args.from_json if not path.is_file()]
    if unreadable:
        cli.error(f"--from-json: no such file: {', '.join(unreadable)} (write one with --json)")
    saved = merge([json.loads(path.read_text()) for path in args.from_json])
    if args.json:
        args.json.write_text(json.dumps(saved, indent=1))
    return saved["rows"], saved["environment"]


def _compiled(args: argparse.Namespace, argv: Sequence[str]) -> tuple[list[dict], dict] | None:
    """(rows, environment) of the selected configurations compiled now (and written to ``--json`` if given); None
    after ``--list`` printed their names."""
    every, cold = kernel_layer_configs()
    configs = select(every, args.kernels)
    if args.list:
        for name in dict.fromkeys(config.name for config in configs):
            print(name)
        return None
    arches = parse_arches(args.arch)
    env = {**environment(argv), "cold_start": cold}
    with tempfile.TemporaryDirectory(prefix="gpu_static_cache_") as cache:
        os.environ.setdefault("TRITON_CACHE_DIR", cache)  # cold compiles, and no other run's cache touched
        knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
        rows = run(configs, arches, args.jobs, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        names = list(dict.fromkeys(c.name for c in configs))  # one per name: the layer enumerates per arch
        saved = {"environment": env, "arches": arches, "configs": names, "rows": rows}
        args.json.write_text(json.dumps(saved, indent=1))
    return rows, env
