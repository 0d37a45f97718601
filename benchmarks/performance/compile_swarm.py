"""How many background compile processes short runs leave behind (issue 33): three short processes in a row.

Each process builds AdamW8bit, LAMB8bit, Lion8bit and RMSprop8bit on two 300K-element CPU tensors with
``HF_OPTIM_COMPILE=auto``, takes 3 steps with each and exits; all three share a fresh inductor cache directory of
their own (cold). A sampler polls the process table (psutil) every 0.1 s for compile workers (``cpu_compile_worker``
in the command line, that cache directory in the environment; zombies not counted) and prints:

- the most compile workers alive at once;
- the workers alive when the last process has exited (orphans), and how long until none is left (it waits up to
  ``--wait`` seconds, then kills those left);
- the peak resident memory (RSS) of one worker and of all at once.

    python benchmarks/performance/compile_swarm.py                       # this checkout (or the installed hf_optim)
    PYTHONPATH=/tmp/old python benchmarks/performance/compile_swarm.py  # another checkout

Counts, not timings: they do not depend on how loaded the machine is, except that on a fast machine a worker may
finish all kernels before the last process exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import psutil

RUN = """
import torch, hf_optim
for cls in (hf_optim.AdamW8bit, hf_optim.LAMB8bit, hf_optim.Lion8bit, hf_optim.RMSprop8bit):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300_000)) for _ in range(2)]
    opt = cls(params, lr=1e-3)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
"""
"""One short process: four optimizers' kernels, 3 steps each."""


def workers(cache: str) -> list[psutil.Process]:
    """The live (not zombie) compile worker processes of inductor cache directory ``cache``."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if not any("cpu_compile_worker" in part for part in process.info["cmdline"] or ()):
                continue
            if process.environ().get("TORCHINDUCTOR_CACHE_DIR") == cache:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@dataclass
class Sampler:
    """Polls :func:`workers` in a thread: the most alive at once, peak RSS of one and of all, every PID seen."""

    cache: str
    period: float = 0.1
    most: int = 0
    peak_rss: int = 0
    peak_total_rss: int = 0
    seen: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> int:
        alive = workers(self.cache)
        rss = []
        for process in alive:
            try:
                rss.append(process.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        self.most = max(self.most, len(alive))
        self.peak_rss = max([self.peak_rss, *rss])
        self.peak_total_rss = max(self.peak_total_rss, sum(rss))
        self.seen.update(process.pid for process in alive)
        return len(alive)

    def __enter__(self) -> Sampler:
        def loop():
            while not self._stop.wait(self.period):
                self.sample()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_processes(cache: str, count: int = 3, timeout: float = 600.0) -> None:
    """``count`` short processes (:data:`RUN`) in a row on inductor cache ``cache``; raises if one fails."""
    env = {**os.environ, "HF_OPTIM_COMPILE": "auto", "TORCHINDUCTOR_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1"}
    for _ in range(count):
        done = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"a short process failed ({done.returncode}):\n{done.stderr[-2000:]}")


def wait_until_gone(sampler: Sampler, limit: float) -> float | None:
    """Seconds until no worker of the sampler's cache is alive, or None when some still are after ``limit``."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if sampler.sample() == 0:
            return time.monotonic() - start
        time.sleep(sampler.period)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for the workers to exit (the issue's bound: 120); then they are killed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf_optim_swarm_") as cache:
        with Sampler(cache) as sampler:
            started = time.monotonic()
            run_processes(cache, args.processes)
            ran = time.monotonic() - started
            orphans = sampler.sample()
            gone = wait_until_gone(sampler, args.wait)
        leftover = workers(cache)
        for process in leftover:  # this benchmark's own workers, by PID: none should be left to the machine
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        where = subprocess.run([sys.executable, "-c", "import hf_optim; print(hf_optim.__file__)"],
                               capture_output=True, text=True).stdout.strip()
        print(f"hf_optim from: {where}")
        print(f"{args.processes} short processes in a row: {ran:.0f} s")
        print(f"compile workers started: {len(sampler.seen)}")
        print(f"most compile workers alive at once: {sampler.most}")
        print(f"compile workers alive when the last process exited: {orphans}")
        print("all compile workers gone " + (f"{gone:.0f} s after the last process exited" if gone is not None
                                             else f"NOT after {args.wait:.0f} s: {len(leftover)} killed now"))
        print(f"peak RSS of one worker: {sampler.peak_rss / 2**20:.0f} MiB; of all at once: "
              f"{sampler.peak_total_rss / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
