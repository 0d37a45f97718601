"""How many OpenMP threads run the compiled CPU kernels: torch's thread count, or one when that is faster.

A compiled chunk (:mod:`hf_optim.kernels.cpu_compile`) is one OpenMP parallel region with about seven barriers, and
a step is tens of chunks. When other processes keep the cores busy (dataloader workers, a second job), a barrier
waits for a thread the scheduler is not running, and libgomp's waiting threads spin meanwhile. Measured on a 2-core
machine under load (docs/benchmarks.md, the busy-machine table): AdamW8bit on one 16.8M-element tensor took 10x
longer per step with 2 threads than with 1, and its CPU time per element grew 10x (spinning); on an idle machine 2
threads are about 1.3x faster than 1. Neither is right everywhere, so each kernel measures both:

- it starts with torch's thread count (:func:`torch.get_num_threads`), timing every step's chunks per element;
- once it has seen a few steps, it asks for the one-thread variant of its kernel (a second compiled graph: the
  thread count is part of a graph's guards) when the machine looks busy: the 1-minute load average is at least the
  number of cores this process may use, or its own time per element has grown to :data:`SLOWDOWN` times its best;
- with both variants compiled it runs the one that measured faster and tries the other again now and then, after
  :data:`FIRST_PROBE` runs, twice as long after each try that confirms the choice (at most :data:`LAST_PROBE`),
  and soon again when the chosen variant's own time per element says the load changed (all threads 1.5x slower:
  busier; one thread 2x faster: quieter), so a change of load is noticed within a few steps while tries of all
  threads under load, which cost up to 10 one-thread runs each, stay rare.

The thread count changes only the speed: the compiled kernels parallelize over blocks and every reduction is within
one 256-element block, so one thread and many compute the same bits (``tests/test_multi_tensor.py``). It is set
with libgomp's ``omp_set_num_threads`` for the calling thread only, around the step's chunks, and restored after;
``torch.set_num_threads`` would also change MKL's global setting, which other threads share. Without an OpenMP
runtime in the process (a torch build without OpenMP) the kernels keep torch's thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import re
from collections.abc import Callable, Iterator

import torch

SLOWDOWN = 1.5
"""Time per element over the best measured with torch's thread count that makes the one-thread variant worth
compiling, and over its figure at the last try of one thread that makes another try worth it."""
QUIETER = 2.0
"""Speed-up of the one-thread variant since the last try of all threads that makes another try worth it."""
WARMUP = 3
"""Measured runs with torch's thread count before the machine is judged."""
FIRST_PROBE, LAST_PROBE = 8, 256
"""Runs between two tries of the variant not chosen: the first interval, and the most it doubles to."""
SMOOTHING = 0.5
"""Weight of a new measurement in the chosen variant's running time per element (a try of the other replaces its
figure)."""


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, or Intel's/LLVM's), found in this process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if re.search(r"/lib(gomp|iomp5|omp)[-.\w]*\.so", line)}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            library.omp_set_num_threads.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError):
            continue
    return None


def adjustable() -> bool:
    """Whether the calling thread's OpenMP thread count can be set (an OpenMP runtime is loaded)."""
    return _openmp() is not None


def set_threads(count: int) -> None:
    """Set the calling thread's OpenMP thread count (what inductor's kernels and ATen's parallel loops use)."""
    library = _openmp()
    if library is None:
        raise RuntimeError("no OpenMP runtime is loaded in this process: its thread count cannot be set")
    library.omp_set_num_threads(count)


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` OpenMP threads in the calling thread (None, the current count, or no OpenMP
    runtime: unchanged)."""
    before = torch.get_num_threads()
    if count is None or count == before or not adjustable():
        yield
        return
    set_threads(count)
    try:
        yield
    finally:
        set_threads(before)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def machine_busy() -> bool:
    """Whether the 1-minute load average is at least the number of usable cores."""
    try:
        return os.getloadavg()[0] >= usable_cores()
    except OSError:
        return False


class ThreadChoice:
    """The thread count one kernel runs with: ``many`` (torch's count) or 1, from measured seconds per element.

    Args:
        many (int): torch's thread count when the kernel first ran.
        busy (Callable[[], bool], default :func:`machine_busy`): whether the machine looks busy (read once, after
            :data:`WARMUP` measured runs).
    """

    def __init__(self, many: int, busy: Callable[[], bool] = machine_busy) -> None:
        self.many = many
        self._busy = busy
        self.cost: dict[int, float] = {}  # running seconds per element, per thread count
        self.best_many = math.inf  # the lowest single measurement with `many` threads
        self.runs_many = 0
        self.wants_one = False  # whether the one-thread variant should be compiled
        self.chosen = many
        self.runs_since_probe = 0
        self.interval = FIRST_PROBE
        self.reference = math.inf  # the chosen variant's time per element when the other was last measured

    def pick(self, ready: Callable[[int], bool]) -> int:
        """The thread count for the next run; ``ready(count)`` says whether that variant is compiled."""
        if self.many == 1 or not self.wants_one or not ready(1):
            return self.many
        if 1 not in self.cost:
            return 1  # first measurement of the one-thread variant
        other = 1 if self.chosen == self.many else self.many
        if self.runs_since_probe >= self.interval:
            return other
        return self.chosen

    def record(self, count: int, seconds: float, elements: int) -> None:
        """Account a run of ``elements`` elements with ``count`` threads that took ``seconds``."""
        if elements <= 0 or count not in (1, self.many):
            return
        sample = seconds / elements
        previous = self.cost.get(count)
        # A try of the variant not chosen replaces its figure, which is from the last try and stale by now.
        fresh = previous is None or count != self.chosen
        self.cost[count] = sample if fresh else SMOOTHING * sample + (1 - SMOOTHING) * previous
        if count == self.many:
            self.runs_many += 1
            self.best_many = min(self.best_many, sample)
            if not self.wants_one and self.many > 1 and self.runs_many >= WARMUP:
                self.wants_one = self.cost[self.many] >= SLOWDOWN * self.best_many or self._busy()
        if 1 not in self.cost or self.many not in self.cost:
            return
        best = min((self.many, 1), key=lambda c: self.cost[c])
        if count != self.chosen:  # a try of the other variant (or the first measurement of one thread)
            self.runs_since_probe = 0
            if best == count:
                self.chosen, self.interval = count, FIRST_PROBE
            else:
                self.interval = min(2 * self.interval, LAST_PROBE)
            self.reference = self.cost[self.chosen]
            return
        self.runs_since_probe += 1
        # Since the other variant was measured the machine got busier (all threads slowed down: one thread may be
        # faster now) or quieter (one thread sped up: all threads may be faster again), or the choice got slower
        # than the other's figure: try the other one next, at short intervals again. Trying all threads under
        # load is expensive (10x a one-thread run), so a small change of the one-thread time does not trigger it.
        if count == self.many:
            changed = self.cost[count] > SLOWDOWN * self.reference
        else:
            changed = self.cost[count] < self.reference / QUIETER
        if changed or best != count:
            self.runs_since_probe, self.interval = FIRST_PROBE, FIRST_PROBE
