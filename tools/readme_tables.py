"""The README's generated tables: the ``optim=`` names and classes, and the state formats.

Both come from the installed package (``hf_optim.available_optimizers()``, ``hf_optim.available_state_formats()``),
so the README cannot drift from the code: ``tests/cli/test_readme_tables.py`` fails when the README's copy differs from
what this script produces now.

    python tools/readme_tables.py           # print both tables
    python tools/readme_tables.py --write   # rewrite them in README.md, between their markers
    python tools/readme_tables.py --check   # exit 1 if README.md is out of date

Each table sits between ``<!-- BEGIN generated: KEY -->`` and ``<!-- END generated: KEY -->`` lines; everything
else in the README is hand-written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MARKER = re.compile(r"(<!-- BEGIN generated: (?P<key>[\w-]+) -->\n)(?P<body>.*?)(<!-- END generated: (?P=key) -->)",
                    re.S)


def _builtin(entry) -> bool:
    """hf_optim's own names: an algorithm registered at run time (``hf_optim.register_algorithm``) is not listed."""
    return entry.cls.__module__.startswith("hf_optim.")


def optimizer_names_table() -> str:
    """One row per algorithm and state format: its classes and the ``optim=`` names that build them.

    Rows follow the registry's order (algorithms as registered, formats by rank); names transformers already has,
    which hf_optim takes over, are in bold."""
    import hf_optim

    rows: dict[tuple[str, str], dict[str, list[str]]] = {}
    for entry in hf_optim.available_optimizers():
        if not _builtin(entry):
            continue
        row = rows.setdefault((entry.family, entry.state_format.name), {"classes": [], "names": []})
        if entry.cls.__name__ not in row["classes"]:
            row["classes"].append(entry.cls.__name__)
        row["names"].append(f"**`{entry.name}`**" if entry.takes_over else f"`{entry.name}`")
    families = {entry.family: entry.algorithm.class_name for entry in hf_optim.available_optimizers()
                if _builtin(entry)}
    formats = {fmt.name: fmt for fmt in hf_optim.available_state_formats()}
    order = list(formats)
    lines = ["| algorithm | state | classes | `optim=` names |", "|---|---|---|---|"]
    for family in families:
        keys = sorted((key for key in rows if key[0] == family), key=lambda key: order.index(key[1]))
        for _, fmt in keys:
            row = rows[(family, fmt)]
            unpaged_first = sorted(row["classes"], key=lambda name: (name.startswith("Paged"), name))
            classes = ", ".join(f"`{name}`" for name in unpaged_first)
            lines.append(f"| {families[family]} | {formats[fmt].label} | {classes} | {', '.join(row['names'])} |")
    return "\n".join(lines) + "\n"


def state_formats_table() -> str:
    """``print(hf_optim.available_state_formats())``, as it prints, in a text block."""
    import hf_optim

    return f"```\n{hf_optim.available_state_formats()}\n```\n"


GENERATORS = {"optimizer-names": optimizer_names_table, "state-formats": state_formats_table}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what its generator produces now."""
    def replace(match: re.Match) -> str:
        key = match.group("key")
        if key not in GENERATORS:
            raise SystemExit(f"error: README.md: unknown generated block {key!r}; known: {', '.join(GENERATORS)}")
        return match.group(1) + GENERATORS[key]() + match.group(4)

    return MARKER.sub(replace, text)


def generated_blocks(text: str) -> dict[str, str]:
    """``{key: body}`` of every generated block in ``text``."""
    return {match.group("key"): match.group("body") for match in MARKER.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the tables in README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if README.md's tables are out of date")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        for key, generate in GENERATORS.items():
            print(f"<!-- {key} -->\n{generate()}")
        return 0
    text = README.read_text()
    if set(generated_blocks(text)) != set(GENERATORS):
        print(f"error: README.md must hold one generated block for each of: {', '.join(GENERATORS)}", file=sys.stderr)
        return 1
    fresh = render(text)
    if args.check:
        if fresh != text:
            print("error: README.md's generated tables are out of date: run python tools/readme_tables.py --write",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
