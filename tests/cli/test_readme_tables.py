"""The README's generated tables match the code, and every relative link in README.md and docs/ resolves.

The tables (the ``optim=`` names with their classes and state formats, and the state formats) are written by
``tools/readme_tables.py`` from ``hf_optim.available_optimizers()`` / ``available_state_formats()``. They are checked
in a fresh interpreter: other tests register algorithms and formats in this process, which would change both lists.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)


def test_readme_tables_are_what_the_generator_writes_now():
    result = run_python("tools/readme_tables.py", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_name_table_lists_every_available_optimizer_with_its_class_and_format():
    """Independent of the generator's formatting: each built-in name of ``available_optimizers()`` appears exactly
    once in the README's table, in the row of its class and its state format's label."""
    listing = run_python("-c", (
        "import json, hf_optim\n"
        "print(json.dumps([(e.name, e.cls.__name__, e.state_format.label) for e in hf_optim.available_optimizers()"
        " if e.cls.__module__.startswith('hf_optim.')]))"))
    assert listing.returncode == 0, listing.stderr
    expected = json.loads(listing.stdout)
    assert len(expected) >= 40  # every algorithm x format x paging: a short list means names went missing
    block = README.read_text().split("<!-- BEGIN generated: optimizer-names -->", 1)[1].split("<!-- END", 1)[0]
    rows = [line.split("|")[1:-1] for line in block.splitlines() if line.startswith("| ") and "`" in line]
    seen: dict[str, tuple[set[str], str]] = {}
    for _, label, classes, names in rows:
        for name in re.findall(r"`([a-z0-9_]+)`", names):
            assert name not in seen, f"{name} is listed twice"
            seen[name] = (set(re.findall(r"`(\w+)`", classes)), label.strip())
    assert set(seen) == {name for name, _, _ in expected}
    for name, cls, label in expected:
        classes, row_label = seen[name]
        assert cls in classes and row_label == label, (name, cls, label, classes, row_label)


def test_readme_state_format_table_is_what_the_package_prints():
    printed = run_python("-c", "import hf_optim; print(hf_optim.available_state_formats())")
    assert printed.returncode == 0, printed.stderr
    assert f"```\n{printed.stdout}```" in README.read_text()


def test_readme_stays_a_one_screen_start():
    assert len(README.read_text().splitlines()) <= 300


# --- links ---------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (except - and _), spaces as hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    found: set[str] = set(re.findall(r"<a id=\"([^\"]+)\"", text))
    counts: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        number = counts.get(base, 0)
        counts[base] = number + 1
        found.add(base if number == 0 else f"{base}-{number}")
    return found


def relative_links(path: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_links_and_anchors():
    """The checker above must find something to check, and must read headings as GitHub does."""
    assert len(relative_links(README)) >= 10
    assert slug("Command lines you did not write: `trl sft`, `accelerate launch`, `torchrun`") == (
        "command-lines-you-did-not-write-trl-sft-accelerate-launch-torchrun")
    assert slug("torch's optimizer contract, and bitsandbytes' per-parameter settings") == (
        "torchs-optimizer-contract-and-bitsandbytes-per-parameter-settings")
