"""The rows as output: the checks (the CI test asserts them), the summary lines under the table, and the table itself
(rich, or Markdown for docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hf_optim.gpu_static.targets import ARCHES, GPUS

# --------------------------------------------------------------------------------------------------------------
# Checks (the CI test asserts these)


def problems(rows: Iterable[dict]) -> list[str]:
    """One line per row that failed to compile, spills, or uses local memory."""
    found = []
    for row in rows:
        where = f"{row['config']} on {row['arch']}"
        if "error" in row:
            found.append(f"{where}: does not compile: {row['error']}")
            continue
        if row["spill_stores"] or row["spill_loads"]:
            found.append(f"{where}: spills {row['spill_stores']} B stored, {row['spill_loads']} B loaded")
        if row["local_bytes"] or row["local_instructions"]:
            found.append(f"{where}: local memory {row['local_bytes']} B, {row['local_instructions']} LDL/STL")
    return found


def cold_start(rows: Sequence[dict], config_names: Iterable[str], arch: str) -> float | None:
    """Seconds to compile every distinct binary behind ``config_names`` on ``arch`` (one step's first launch)."""
    seconds = {row["binary"]: row["compile_seconds"] for row in rows
               if row["config"] in config_names and row["arch"] == arch and "error" not in row}
    return sum(seconds.values()) if seconds else None


# --------------------------------------------------------------------------------------------------------------
# Tables

COLUMNS = ("config", "arch", "warps", "regs", "spill st/ld", "local", "smem", "occ", "inst/el", "ld/el", "compile s",
           "bw-bound ms", "predicted ms")


def _cells(row: dict) -> list[str]:
    if "error" in row:
        return [row["config"], row["arch"], "compile error: " + row["error"][:60]] + [""] * (len(COLUMNS) - 3)
    ipe = row["instructions_per_element"]
    ipe_text = "-" if ipe is None else f"{ipe:.0f}" + ("?" if row["ambiguous_branches"] else "")
    if "analysis_error" in row:
        ipe_text = "err"
    gpu = next((g for g in GPUS if g.arch == row["arch"]), None)
    bw = row.get(f"{gpu.name}_bandwidth_ms") if gpu else None
    predicted = row.get(f"{gpu.name}_predicted_ms") if gpu else None
    bound = ""
    if predicted is not None:
        bound = " issue" if predicted > bw * 1.0001 else ""
    return [row["config"], row["arch"], str(row["num_warps"]), str(row["regs"]),
            f"{row['spill_stores']}/{row['spill_loads']}", str(row["local_instructions"]), str(row["smem"]),
            f"{row['occupancy']:.0%} ({row['occupancy_limiter']})", ipe_text, _loads_text(row),
            f"{row['compile_seconds']:.1f}",
            "" if bw is None else f"{gpu.name} {bw:.2f}", "" if predicted is None else f"{predicted:.2f}{bound}"]


def _loads_text(row: dict) -> str:
    loads = row.get("loads_per_element")  # absent in --json files written before the column
    return "-" if loads is None or "analysis_error" in row else f"{loads:.2f}"


def caption(environment: dict) -> str:
    return (f"Triton {environment['triton']}, {environment['date']}, {environment['machine']}; "
            "occupancy at the launch's warps (limiter); inst/el: main-path SASS instructions per element; "
            "ld/el: main-path global loads (LDG) per element; "
            "step times: Llama-3.2-1B full set, sm_90 rows on an H100 SXM, sm_75 rows on a T4 "
            "('issue': issue-bound)")


def summary(rows: Sequence[dict], cold_start_configs: Iterable[str] = ()) -> list[str]:
    """Lines under the table: the cold start of ``cold_start_configs`` (the binaries one AdamW8bit step with bf16
    parameters launches), the problems, undecided branches and main paths not found."""
    lines = []
    for arch in sorted({row["arch"] for row in rows}):
        seconds = cold_start(rows, cold_start_configs, arch)
        if seconds is not None:
            lines.append(f"cold start on {arch}: compiling every binary one AdamW8bit step (bf16 params, "
                         f"Llama-3.2-1B set) launches takes {seconds:.1f} s here")
    found = problems(rows)
    lines.append(f"{len(rows)} rows, {len({(r['binary'], r['arch']) for r in rows})} binaries compiled; "
                 + ("no spills, no local memory, every configuration compiles" if not found
                    else f"{len(found)} problems:"))
    lines.extend("  " + line for line in found)
    ambiguous = [r for r in rows if r.get("ambiguous_branches")]
    if ambiguous:
        lines.append(f"{len(ambiguous)} rows have branches the main-path analysis could not decide (marked '?')")
    lines.extend(f"main path of {r['config']} on {r['arch']} not found: {r['analysis_error']}" for r in rows
                 if "analysis_error" in r)
    return lines


def print_table(rows: Sequence[dict], environment: dict) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title="Triton kernels compiled ahead of time", caption=caption(environment))
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("config", "arch") else "right",
                         no_wrap=column == "config")
    for row in rows:
        table.add_row(*_cells(row))
    console = Console(width=max(160, Console().width))
    console.print(table)
    for line in summary(rows, environment.get("cold_start", ())):
        console.print(line)


def markdown(rows: Sequence[dict], environment: dict) -> str:
    """The rows as one Markdown table with a line per configuration and the arches side by side (``a/b/...`` in
    the order of the header), for docs/benchmarks.md; then the caption and the summary."""
    arches = [arch for arch in ARCHES if any(row["arch"] == arch for row in rows)]
    by_config: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_config.setdefault(row["config"], {})[row["arch"]] = row
    each = "/".join(arch.removeprefix("sm_") for arch in arches)
    gpus = [gpu for gpu in GPUS if gpu.arch in arches]
    header = (["config", "warps", f"regs ({each})", f"occupancy % ({each})", f"spill B ({each})", f"smem B ({each})",
               f"inst/el ({each})", f"ld/el ({each})", f"compile s ({each})"]
              + [f"{gpu.name} ms: bw / predicted" for gpu in gpus])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def joined(cells: dict[str, dict], value: Callable[[dict], str]) -> str:
        return "/".join(value(cells[a]) if a in cells and "error" not in cells[a] else "err" for a in arches)

    for name, cells in by_config.items():
        first = next((row for row in cells.values() if "error" not in row), None)
        if first is None:
            lines.append(f"| {name} | compile error on every arch: {next(iter(cells.values()))['error'][:80]} |")
            continue
        ipe = joined(cells, lambda r: "err" if "analysis_error" in r else "-" if r["instructions_per_element"] is None
                     else f"{r['instructions_per_element']:.0f}" + ("?" if r["ambiguous_branches"] else ""))
        line = [name, str(first["num_warps"]), joined(cells, lambda r: str(r["regs"])),
                joined(cells, lambda r: f"{100 * r['occupancy']:.0f}"),
                joined(cells, lambda r: str(r["spill_stores"] + r["spill_loads"])),
                joined(cells, lambda r: str(r["smem"])), ipe, joined(cells, _loads_text),
                joined(cells, lambda r: f"{r['compile_seconds']:.1f}")]
        for gpu in gpus:
            row = cells.get(gpu.arch, {})
            bw, predicted = row.get(f"{gpu.name}_bandwidth_ms"), row.get(f"{gpu.name}_predicted_ms")
            issue = " (issue)" if bw is not None and predicted > bw * 1.0001 else ""
            line.append("" if bw is None else f"{bw:.2f} / {predicted:.2f}{issue}")
        lines.append("| " + " | ".join(line) + " |")
    notes = [("  - " + line.strip()) if line.startswith("  ") else "- " + line
             for line in summary(rows, environment.get("cold_start", ()))]
    return "\n".join([*lines, "", caption(environment) + ".", "", *notes])
