"""Running the table: one compile per distinct binary and arch, in parallel processes if asked."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence

from hf_optim.gpu_static.compiling import compile_config
from hf_optim.gpu_static.launch_config import LaunchConfig
from hf_optim.gpu_static.measure import measure
from hf_optim.gpu_static.predict import llama_numels, predict

_PLAN: list[tuple[list[LaunchConfig], str]] = []
"""(configurations sharing one binary, arch) per task; module state so forked workers inherit it."""


def _binary_id(config: LaunchConfig) -> str:
    import hashlib  # noqa: PLC0415

    return hashlib.sha1(repr(config.binary_key()).encode()).hexdigest()[:10]


def _run_task(index: int) -> list[dict]:
    configs, arch = _PLAN[index]
    try:
        compiled = compile_config(configs[0], arch)
    except Exception as error:  # one failure is a row, not the end of the run
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return [{"config": c.name, "group": c.group, "arch": arch, "binary": _binary_id(c), "error": first}
                for c in configs]
    rows = []
    for config in configs:
        row = measure(config, arch, compiled)
        row["binary"] = _binary_id(config)
        rows.append(row)
    return rows


def run(configs: Sequence[LaunchConfig], arches: Sequence[str], jobs: int = 1,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows for every configuration and arch, compiling each distinct binary once per arch.

    Args:
        configs: the configurations.
        arches: keys of :data:`ARCHES`.
        jobs (default 1): parallel compile processes.
        progress (default None): called with a line per compiled binary.
    """
    groups: dict[tuple, list[LaunchConfig]] = {}
    for config in configs:
        groups.setdefault((config.binary_key(), config.arch), []).append(config)
    _PLAN[:] = [(members, arch) for arch in arches for members in groups.values() if members[0].arch in (None, arch)]
    results: list[list[dict]] = []
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for rows in pool.imap(_run_task, range(len(_PLAN))):
                results.append(rows)
                if progress:
                    progress(_progress_line(rows, len(results), len(_PLAN)))
    else:
        for index in range(len(_PLAN)):
            results.append(_run_task(index))
            if progress:
                progress(_progress_line(results[-1], len(results), len(_PLAN)))
    order = {(c.name, a): i for i, (c, a) in enumerate((c, a) for c in configs for a in arches
                                                      if c.arch in (None, a))}
    rows = sorted((row for chunk in results for row in chunk), key=lambda r: order[(r["config"], r["arch"])])
    predict(rows, {c.name: c for c in configs}, llama_numels())
    return rows


def _progress_line(rows: list[dict], done: int, total: int) -> str:
    first = rows[0]
    what = first.get("error") or f"{first['regs']} regs, {first['compile_seconds']:.1f} s"
    return f"[{done}/{total}] {first['arch']} {first['config']} (+{len(rows) - 1} rows on this binary): {what}"
