"""CI is reproducible (issue 43): the README's test command, which .ci/run runs, installs the versions the suite passed
with (.ci/constraints.txt); the package's own ranges stay open; tools/test_newest.sh runs the suite on the newest
releases and writes the lock only from a run that passed (docs/guide/versions.md, "Drift: the newest releases")."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / ".ci" / "constraints.txt"
SCRIPT = ROOT / "tools" / "test_newest.sh"
CI_COMMAND = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]  # the README's (test_readme_commands)


def locked() -> dict[str, str]:
    """The lock's pins, name (canonical) -> version; every line but comments must be ``name==version``."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.!+_-]*)", line)
        assert match, f"{LOCK.name}: not a name==version pin: {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in pins, f"{LOCK.name} pins {name} twice"
        pins[name] = match.group(2)
    return pins


def the_packages_requirements() -> list[Requirement]:
    """hf_optim's own dependencies and its `test` extra's, as installed (the distribution's metadata)."""
    requirements = [Requirement(text) for text in importlib.metadata.requires("hf_optim") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": "test"})]


def test_the_test_command_installs_the_locked_versions_with_the_readmes_torch():
    installs = [shlex.split(part) for part in CI_COMMAND.split(" && ") if part.startswith("pip install")]
    torch_pin, test_extra = installs
    assert test_extra == ["pip", "install", "-c", ".ci/constraints.txt", "-e", ".[test]"]
    pins = locked()
    assert f"torch=={pins['torch']}" == torch_pin[-1]  # the README's first command; no local label (+cpu)
    assert "hf-optim" not in pins  # the package under test comes from the checkout
    # every package the test extra and the package itself require directly is pinned (the rest: pip freeze)
    missing = {canonicalize_name(r.name) for r in the_packages_requirements()} - set(pins)
    assert not missing, f"{LOCK.name} lacks {sorted(missing)}: refresh it (tools/test_newest.sh --refresh-lock)"


def test_the_packages_own_ranges_stay_open():
    """Only the test environment is pinned: a user's install takes any version in the declared ranges."""
    pinned = [str(r) for r in the_packages_requirements()
              if any(spec.operator in ("==", "===", "~=") for spec in r.specifier)]
    assert not pinned


def test_the_newest_run_is_documented_and_reads_the_torch_pin_from_ci():
    guide = (ROOT / "docs" / "guide" / "versions.md").read_text()
    assert "tools/test_newest.sh" in guide and "--refresh-lock" in guide
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert "2.13" not in SCRIPT.read_text()  # one place names torch's version: .ci/run (and the README)


def run_script(*args: str, lock: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "HF_OPTIM_LOCK": str(lock)})


def test_the_lock_is_written_from_a_passing_run_only(tmp_path):
    run, lock = tmp_path / "run", tmp_path / "constraints.txt"
    run.mkdir()
    freeze = "accelerate==1.16.0\nhf-optim==0.1.0\npip==23.2.1\nsetuptools==84.2.1\ntorch==2.13.0+cpu\ntriton==3.9.0\n"
    (run / "freeze.txt").write_text(freeze)
    result = "date: 2026-12-07 15:00 UTC\ncommit: abc1234\nmachine: a CPU\npytest: 10 passed in 1.00s\nstatus: {}\n"
    (run / "result.txt").write_text(result.format("failed (exit status 1)"))
    refused = run_script("--lock-from", str(run), lock=lock)
    assert refused.returncode == 1 and refused.stderr.startswith("error: ") and not lock.exists()
    assert len(refused.stderr.splitlines()) == 1
    (run / "result.txt").write_text(result.format("passed"))
    written = run_script("--lock-from", str(run), lock=lock)
    assert written.returncode == 0, written.stderr
    lines = lock.read_text().splitlines()
    # the package under test and pip itself are not pinned; torch without its build label
    assert [line for line in lines if not line.startswith("#")] == ["accelerate==1.16.0", "setuptools==84.2.1",
                                                                    "torch==2.13.0", "triton==3.9.0"]
    assert any("10 passed in 1.00s" in line for line in lines) and any("abc1234" in line for line in lines)
    unknown = run_script("--refresh", lock=lock)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown option '--refresh'")
