"""One state format's GPU kernels beside another's, from a saved ahead-of-time compile table (issue 45's check of
``stochastic4`` against ``blockwise8``): per configuration and arch, the ratios of SASS instructions per element,
global loads per element and registers, occupancy (the reference's over this format's: above 1 is lower), and the
spills of both, with the worst of each.

    python -m hf_optim.gpu_static --arch sm_90,sm_80 --kernels "8bit full,8bit partial,4bit full,4bit partial" \\
        --json gs.json
    python benchmarks/gpu/format_ratios.py gs.json --format 4bit --against 8bit

``--format`` and ``--against`` are the format's word in the configuration names (``4bit``: ``stochastic4``;
``4bitBlockwise``: ``blockwise4``; ``8bit``: ``blockwise8``); a configuration is paired with the one whose name
differs only by that word.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MEASURES = (
    ("inst/el", "instructions_per_element", False),
    ("ld/el", "loads_per_element", False),
    ("regs", "regs", False),
    ("occ", "occupancy", True),
)
"""(column, row key, inverted): the ratio is format / reference, or reference / format where inverted (occupancy:
higher is better), so above 1 is worse for every column."""


def pairs(rows: list[dict], word: str, against: str) -> list[tuple[dict, dict]]:
    """(format row, reference row) for every configuration of ``word`` with a twin of ``against`` on its arch."""
    by_name = {(row["config"], row["arch"]): row for row in rows}
    found = []
    for (config, arch), row in sorted(by_name.items()):
        words = config.split(" ")
        if word not in words:
            continue
        twin = " ".join(against if w == word else w for w in words)
        if (twin, arch) in by_name:
            found.append((row, by_name[twin, arch]))
    return found


def spills(row: dict) -> int:
    return row.get("spill_stores", 0) + row.get("spill_loads", 0) + row.get("local_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, nargs="+", help="tables saved with gpu_static --json (merged)")
    parser.add_argument("--format", default="4bit", help="the format's word in configuration names")
    parser.add_argument("--against", default="8bit", help="the reference format's word")
    args = parser.parse_args(argv)
    rows = [row for path in args.json for row in json.loads(path.read_text())["rows"]]
    found = pairs(rows, args.format, args.against)
    if not found:
        print(f"error: no configuration named with {args.format!r} has a twin named with {args.against!r}")
        return 1
    print(f"| config ({args.format} / {args.against}) | arch | " + " | ".join(m[0] for m in MEASURES) + " | spills |")
    print("|---|---|" + "---:|" * (len(MEASURES) + 1))
    worst = {column: (0.0, "") for column, _, _ in MEASURES}
    for row, ref in found:
        cells = []
        for column, key, inverted in MEASURES:
            ratio = ref[key] / row[key] if inverted else row[key] / ref[key]
            cells.append(f"{row[key]:.4g} / {ref[key]:.4g} = {ratio:.2f}")
            if ratio > worst[column][0]:
                worst[column] = (ratio, f"{row['config']} {row['arch']}")
        cells.append(f"{spills(row)} / {spills(ref)}")
        print(f"| {row['config']} | {row['arch']} | " + " | ".join(cells) + " |")
    print()
    print(f"{len(found)} pairs; worst ratio: " + "; ".join(f"{column} {ratio:.2f} ({where})"
                                                      for column, (ratio, where) in worst.items()))
    print(f"spilling: {sum(spills(row) > 0 for row, _ in found)} of the {args.format} rows, "
          f"{sum(spills(ref) > 0 for _, ref in found)} of the {args.against} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
