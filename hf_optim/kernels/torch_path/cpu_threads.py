"""How many OpenMP threads run the compiled CPU kernels: torch's thread count, or one when that is faster.

A compiled chunk (:mod:`hf_optim.kernels.torch_path.cpu_compile`) is one OpenMP parallel region with about seven
barriers, and a step is tens of chunks. When other processes keep the cores busy (dataloader workers, a second job), a
barrier waits for a thread the scheduler is not running, and libgomp's waiting threads spin meanwhile. Measured on a
2-core machine under load (docs/lab/2026-measurements.md, the busy-machine tables of issue 23): AdamW8bit on one
16.8M-element tensor took 10x longer per step with 2 threads than with 1, and its CPU time per element grew 10x
(spinning); on an idle machine 2 threads are about 1.3x faster than 1. Neither is right everywhere, so each kernel
measures both:

- it starts with torch's thread count (:func:`torch.get_num_threads`), timing every step's chunks per element from
  the second run on (the first pays one-time costs);
- once it has seen a few steps, it asks for the one-thread variant of its kernel (a second compiled graph: the
  thread count is part of a graph's guards) when the machine is busy: other processes kept at least :data:`BUSY`
  cores busy over each of the last two quarter seconds (:class:`OtherLoad`: the cores' busy time from ``/proc/stat``
  less this process's own CPU time and its children's, not counting niced processes such as the background compiler;
  the 1-minute load average used before lagged a minute behind the load), or, where that meter does not read quiet,
  its own time per element has been :data:`SLOWDOWN` times its best or more in :data:`SLOW_RUNS` runs in a row (on an
  idle machine a step's time varies by 2x from run to run: a warm run of the Llama-3.2-1B LoRA set took 31 or 55 ms
  per step, both often);
- with both variants compiled it runs the one that measured faster and tries the other again now and then, after
  :data:`FIRST_PROBE` runs, twice as long after each try that confirms the choice (at most :data:`LAST_PROBE`),
  and soon again when the chosen variant's own time per element says the load changed (all threads 1.5x slower:
  busier; one thread 2x faster: quieter) or the other processes' CPU time went from busy to quiet or back, so a
  change of load is noticed within a few steps while tries of all threads under load, which cost up to 10
  one-thread runs each, stay rare.

One thread is a remedy for libgomp's spinning waits, not the best possible: with N other busy processes on 2 cores it
gets 2/(N+1) of a core where 2 threads would get 4/(N+2). With ``OMP_WAIT_POLICY=PASSIVE`` in the environment the
process starts with, waiting threads sleep at once and the 2-thread kernel keeps its share under load (measured 3x
faster than without it under heavy load, docs/lab/2026-measurements.md, "Busy machine after the lag-free trigger and
with OMP_WAIT_POLICY=PASSIVE"); the choice measures either way, and the one-thread variant's log line names the setting
when it is not there (:func:`spinning_waits`).

The thread count changes only the speed: the compiled kernels parallelize over blocks and every reduction is within
one 256-element block, so one thread and many compute the same bits (``tests/kernels/test_multi_tensor.py``). It is set
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
import time
from collections.abc import Callable, Iterator

import torch

SLOWDOWN = 1.5
"""Time per element over the best measured with torch's thread count that makes the one-thread variant worth
compiling, and over its figure at the last try of one thread that makes another try worth it."""
QUIETER = 2.0
"""Speed-up of the one-thread variant since the last try of all threads that makes another try worth it."""
TIMED_ELEMENTS = 1 << 20
"""Smallest run (elements) whose time per element can judge a slowdown. A run of the quickstart's 77,824 elements
takes 2-3 ms, and the training's own work around it (the model's operations, data loading) moves that by more than
:data:`SLOWDOWN` from run to run: on an idle machine a warm quickstart asked for the one-thread variant from that
noise and compiled it beside the training (18 s of a core). Smaller runs are judged by the other processes' load
(:meth:`ThreadChoice.busy`) only."""
WARMUP = 3
"""Measured runs with torch's thread count before the machine is judged."""
SLOW_RUNS = 3
"""Consecutive runs, each :data:`SLOWDOWN` times the best or slower, that judge a slowdown by the kernel's own time
(where the other processes' load is not measured quiet). A slow run alone is noise on an idle machine (warm steps of
the Llama-3.2-1B LoRA set took 31 ms or 52-61 ms with nothing else running); judged from such runs, warm runs
compiled the one-thread variant beside their steps, which took 0.3-3 s each meanwhile. Load from other processes
lasts: it slows every run."""
FIRST_PROBE, LAST_PROBE = 8, 256
"""Runs between two tries of the variant not chosen: the first interval, and the most it doubles to."""
SMOOTHING = 0.5
"""Weight of a new measurement in the chosen variant's running time per element (a try of the other replaces its
figure)."""
BUSY, QUIET = 0.5, 0.25
"""Cores other processes keep busy (:class:`OtherLoad`) from which the machine counts as busy, and below which as
quiet (in between: unchanged, so that a load near one bound does not flip the judgment window after window)."""
WINDOW = 0.25
"""Shortest wall time in seconds :class:`OtherLoad` measures over: ``/proc/stat`` counts in ticks of 10 ms, so over
0.25 s on 2 cores the figure is within about 0.1 core."""


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


WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
"""How OpenMP threads wait at a barrier: libgomp reads it once, when torch loads it, so only the environment the
process started with counts. Unset, libgomp's waiting threads spin for a while before they sleep."""


def spinning_waits() -> bool:
    """Whether waiting OpenMP threads spin in this process: ``OMP_WAIT_POLICY`` was not ``passive`` when it
    started."""
    return os.environ.get(WAIT_POLICY_ENV, "").strip().lower() != "passive"


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its CPU affinity; every core where that is not known)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(cores: tuple[int, ...], niced: bool | None = None) -> float | None:
    """CPU seconds the cores ``cores`` have spent busy since boot, all processes together (one read of
    ``/proc/stat``: user, system, irq, softirq and steal time of each core, and nice time when ``niced``), or None
    where it is not there.

    ``niced`` (default: whether this process itself runs niced) counts the time of processes with a positive nice
    value. A process that is not niced leaves it out: niced processes (the background compiler runs at nice +10)
    yield the cores to it, so they do not make its threads wait at barriers, and counting them made the thread choice
    ask for a one-thread kernel while only the background compiler was busy. A niced process counts it, since its own
    time is there."""
    if niced is None:
        niced = _own_niceness() > 0
    lines = _proc_stat_lines()
    if lines is None:  # not Linux
        return None
    wanted = {f"cpu{core}" for core in cores}
    ticks = 0
    for line in lines[1:]:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            break  # the per-core lines come first
        if fields[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[1:9])
            ticks += user + system + irq + softirq + steal + (nice if niced else 0)
    return ticks / _TICKS_PER_SECOND


def _proc_stat_lines() -> list[str] | None:
    try:
        with open("/proc/stat") as stat:
            return stat.read().splitlines()
    except OSError:
        return None


def _own_niceness() -> int:
    try:
        return os.nice(0)
    except (AttributeError, OSError):  # not POSIX
        return 0


def own_seconds() -> float:
    """CPU seconds this process (all its threads) and its children it has waited for have used: a child is this
    process's own work (the test programs torch runs when it first loads a compiled kernel took half a second of a
    core, and read as other processes' load they made an idle machine look busy)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class OtherLoad:
    """How many of this process's cores other processes kept busy over each of the last two windows of
    :data:`WINDOW` seconds or more (the lesser of the two figures): the cores' busy time (``/proc/stat``) minus this
    process's own CPU time (:func:`own_seconds`), over the same wall time.

    Unlike the load average (a 1-minute average, which stays high for a minute after the load stops) it follows
    the machine within two windows, and unlike a run-queue sample it averages over them. A burst shorter than a
    window (a program starting, a compiler's test run) does not make the machine busy; load that stops shows at the
    next window. It is read only when a thread choice asks, at most once per window (one ``/proc/stat`` read); in
    between, and before two windows are complete, it answers its last figure (None at first).

    Args:
        busy (Callable[[], float | None], default: :func:`busy_seconds` of :func:`usable_cores`): busy CPU seconds
            of the cores this process runs on, since any fixed origin (None: not known, e.g. not Linux).
        own (Callable[[], float], default :func:`own_seconds`): this process's CPU seconds.
        clock (Callable[[], float], default :func:`time.monotonic`): wall seconds.
    """

    def __init__(self, busy: Callable[[], float | None] | None = None, own: Callable[[], float] = own_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cores = usable_cores()
        self._busy = busy or (lambda: busy_seconds(cores))
        self._own = own
        self._clock = clock
        self._last: tuple[float, float, float] | None = None  # (wall, busy, own) at the window's start
        self._previous: float | None = None  # the figure of the window before the last
        self.cores: float | None = None
        self.pending = True  # no figure yet, on a machine that has one (False where none can be measured)

    def __call__(self) -> float | None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < WINDOW:
            return self.cores
        busy = self._busy()
        if busy is None:
            self.pending = False
            return None
        own = self._own()
        if self._last is not None:
            wall, busy_before, own_before = self._last
            window = max(0.0, (busy - busy_before) - (own - own_before)) / (now - wall)
            if self._previous is not None:
                self.cores = min(window, self._previous)
                self.pending = False
            self._previous = window
        self._last = (now, busy, own)
        return self.cores


other_load = OtherLoad()
"""The process's meter (every kernel's thread choice reads it: one ``/proc/stat`` read per window in all)."""


class ThreadChoice:
    """The thread count one kernel runs with: ``many`` (torch's count) or 1, from measured seconds per element.

    Args:
        many (int): torch's thread count when the kernel first ran.
        load (Callable[[], float | None], default :data:`other_load`): cores other processes keep busy now (None:
            not known); read after each run while the one-thread variant is not asked for, and after each run of
            the chosen variant once both are compiled (the meter itself reads ``/proc/stat`` at most once per
            :data:`WINDOW`).
    """

    def __init__(self, many: int, load: Callable[[], float | None] = other_load) -> None:
        self.many = many
        self._load = load
        self.cost: dict[int, float] = {}  # running seconds per element, per thread count
        self.warmed: set[int] = set()  # thread counts whose first run (not timed) is done
        self.best_many = math.inf  # the lowest single measurement with `many` threads
        self.runs_many = 0
        self.slow_runs = 0  # consecutive measured runs with `many` threads at SLOWDOWN times the best or slower
        self.wants_one = False  # whether the one-thread variant should be compiled
        self.chosen = many
        self.runs_since_probe = 0
        self.interval = FIRST_PROBE
        self.reference = math.inf  # the chosen variant's time per element when the other was last measured
        self.busy_at_comparison: bool | None = None  # the machine's state (busy()) when the two were compared

    def busy(self) -> bool | None:
        """Whether other processes keep at least :data:`BUSY` cores busy (True), less than :data:`QUIET` (False),
        in between or not known (None)."""
        cores = self._load()
        if cores is None:
            return None
        return True if cores >= BUSY else False if cores < QUIET else None

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
        if count not in self.warmed:
            # A kernel's first run pays once for what later runs find ready (a loaded kernel's first call, the first
            # touches of its temporaries): timed, it made an idle machine's kernel look 1.5x slower than its best
            # and compile a one-thread variant beside the steps.
            self.warmed.add(count)
            return
        sample = seconds / elements
        previous = self.cost.get(count)
        # A try of the variant not chosen replaces its figure, which is from the last try and stale by now.
        fresh = previous is None or count != self.chosen
        self.cost[count] = sample if fresh else SMOOTHING * sample + (1 - SMOOTHING) * previous
        if count == self.many:
            self.runs_many += 1
            self.best_many = min(self.best_many, sample)
            timed = elements >= TIMED_ELEMENTS
            self.slow_runs = self.slow_runs + 1 if timed and sample >= SLOWDOWN * self.best_many else 0
            if not self.wants_one and self.many > 1:
                busy = self.busy()  # read from the first run on: the meter's first window ends meanwhile
                if self.runs_many >= WARMUP:
                    # The kernel's own time judges only where the meter cannot: with other processes measured
                    # quiet, a slower run is this process's own noise, which one thread would not cure.
                    # Nor before the meter's first figure (its first two windows, half a second): the first runs of a
                    # kernel just loaded are the slowest.
                    measuring = getattr(self._load, "pending", False)
                    self.wants_one = busy is True or (busy is None and not measuring and self.slow_runs >= SLOW_RUNS)
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
            self.busy_at_comparison = self.busy()
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
        # Other processes started or stopped since the comparison: the other processes' CPU time says so within a
        # window, before the chosen variant's own times do (one thread speeds up only 1.5x when 2 spinning
        # processes on 2 cores stop, less than QUIETER).
        busy = self.busy()
        changed |= busy is not None and self.busy_at_comparison is not None and busy != self.busy_at_comparison
        if changed or best != count:
            self.runs_since_probe, self.interval = FIRST_PROBE, FIRST_PROBE
