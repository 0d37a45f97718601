"""Run another project's own optimizer tests against hf_optim, from that project's checkout (nothing is copied here).

    python benchmarks/contracts/run_peer_suites.py bitsandbytes BNB_CHECKOUT [pytest args]
        bitsandbytes' tests/test_optim.py on CPU, every bitsandbytes.optim class hf_optim has a namesake for
        swapped for hf_optim's (needs lion-pytorch, the test's Lion reference, on the path)
    python benchmarks/contracts/run_peer_suites.py bitsandbytes BNB_CHECKOUT --plain [pytest args]
        the same tests against bitsandbytes itself (the baseline)
    python benchmarks/contracts/run_peer_suites.py transformers TEST_FILE [pytest args]
        transformers' Trainer optimizer tests (tests/trainer/test_trainer_optimizers.py of a transformers checkout,
        or the optimizer cases of tests/trainer/test_trainer.py) with ``import hf_optim`` first and the Trainer's
        class checks expecting hf_optim's class for the names hf_optim takes over (needs parameterized)
    python benchmarks/contracts/run_peer_suites.py torch PYTORCH_CHECKOUT [--plain] [--classes SET] [pytest args]
        PyTorch's generic optimizer tests (test/test_optim.py's TestOptimRenewed, on CPU) over hf_optim's classes:
        each class stands in for the torch.optim algorithm it implements (benchmarks/contracts/torch_standins.py:
        which, how torch's sample inputs map to its arguments, and the rules, each with its reason, that leave
        out what hf_optim does not take); ``--plain``: torch's own entries of those algorithms (the baseline).
        ``--classes``: ``representative`` (default: each algorithm at 32 and 8 bits, each other state format and
        paging once, 18 classes, ~740 tests), ``all`` (53 classes, ~2,200 tests) or names separated by commas.
        PYTORCH_CHECKOUT is a checkout's root, its test/ folder or test/test_optim.py itself; the file must match
        the installed torch's torch/testing/_internal/common_optimizers.py (needs expecttest)
    python benchmarks/contracts/run_peer_suites.py all --bitsandbytes BNB_CHECKOUT --transformers TEST_FILE
            --torch PYTORCH_CHECKOUT [--out DIR] [--plain] [--suites a,b] [--modes default,0]
        every suite given, against hf_optim in both compile modes (default: HF_OPTIM_COMPILE unset with a fresh
        TORCHINDUCTOR_CACHE_DIR per run; 0: HF_OPTIM_COMPILE=0), then a side-by-side table, the failures only the
        default mode shows, and those both show (benchmarks/contracts/peer_summary.py); ``--plain`` adds each
        suite's baseline

What the swap and the class checks do: benchmarks/contracts/hf_optim_peer_plugin.py. The peer's files run as they
are; pytest's summary line (passed / failed / skipped) is the measurement, ``-rfE`` lists each failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREE = HERE.parents[1]


def run(suite: str, target: Path, extra: list[str]) -> int:
    plain = "--plain" in extra
    extra = [arg for arg in extra if arg != "--plain"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if "--classes" in extra:  # torch only: which hf_optim classes stand in (torch_standins.hf_optim_classes)
        at = extra.index("--classes")
        env["HF_OPTIM_TORCH_CLASSES"] = extra[at + 1]
        extra = extra[:at] + extra[at + 2:]
    if suite == "bitsandbytes":
        cwd, files = target, [str(target / "tests" / "test_optim.py"), "-m", "not benchmark"]
        env.update(BNB_TEST_DEVICE="cpu", HF_OPTIM_SWAP="0" if plain else "1")
    elif suite == "torch":
        test_file = torch_test_file(target)
        cwd, files = test_file.parent, [f"{test_file.name}::TestOptimRenewedCPU", "--noconftest", "-o", "addopts="]
        env.update(HF_OPTIM_TORCH="plain" if plain else "1")
    elif suite == "transformers":
        # the file's package root: the folder above its top-level ``tests`` package
        cwd, files = next(p.parent for p in target.resolve().parents if p.name == "tests"), [str(target)]
        env.update(HF_OPTIM_FIRST="0" if plain else "1", HF_OPTIM_EXPECT="0" if plain else "1")
    else:
        raise SystemExit(f"error: unknown suite {suite!r}; valid suites: bitsandbytes, transformers, torch, all")
    env["PYTHONPATH"] = os.pathsep.join([str(TREE), str(HERE), str(cwd), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-p", "hf_optim_peer_plugin", "-p", "no:cacheprovider", "-q", "-rfE"]
    return subprocess.call([*command, *files, *extra], cwd=cwd, env=env)


def torch_test_file(target: Path) -> Path:
    """test/test_optim.py from a PyTorch checkout's root, its test/ folder or the file itself."""
    for candidate in (target, target / "test_optim.py", target / "test" / "test_optim.py"):
        if candidate.is_file():
            return candidate.resolve()
    raise SystemExit(f"error: no test/test_optim.py under {target}: give a PyTorch checkout (its root or test/)")


def main(argv: list[str]) -> int:
    if argv[:1] == ["all"]:
        from peer_summary import main as run_all

        return run_all(argv[1:])
    if len(argv) < 2:
        raise SystemExit(__doc__)
    target = Path(argv[1])
    if not target.exists():
        raise SystemExit(f"error: {target} does not exist: give a checkout of the peer project (see --help)")
    return run(argv[0], target, argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
