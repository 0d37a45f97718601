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
    if suite == "bitsandbytes":
        cwd, files = target, [str(target / "tests" / "test_optim.py"), "-m", "not benchmark"]
        env.update(BNB_TEST_DEVICE="cpu", HF_OPTIM_SWAP="0" if plain else "1")
    elif suite == "transformers":
        # the file's package root: the folder above its top-level ``tests`` package
        cwd, files = next(p.parent for p in target.resolve().parents if p.name == "tests"), [str(target)]
        env.update(HF_OPTIM_FIRST="0" if plain else "1", HF_OPTIM_EXPECT="0" if plain else "1")
    else:
        raise SystemExit(f"unknown suite {suite!r}: valid suites are bitsandbytes, transformers")
    env["PYTHONPATH"] = os.pathsep.join([str(TREE), str(HERE), str(cwd), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-p", "hf_optim_peer_plugin", "-p", "no:cacheprovider", "-q", "-rfE"]
    return subprocess.call([*command, *files, *extra], cwd=cwd, env=env)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    target = Path(argv[1])
    if not target.exists():
        raise SystemExit(f"{target} does not exist: give a checkout of the peer project (see --help)")
    return run(argv[0], target, argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
