"""When the CPU kernels compile (hf_optim.kernels.torch_path.cpu_compile) and with how many threads they run
(cpu_threads).

The fast tests replace inductor by a stand-in that runs the eager update and the background compiler by a handle the
test finishes, or play the background worker's part in its queue themselves (the policy is what is tested, not the
compiler); the real compiler and the real background worker are exercised by the slow tests here, in
test_compile_queue.py and in test_multi_tensor.py.
"""

import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import make_params, set_grads

import hf_optim
from hf_optim import formats
from hf_optim.kernels.torch_path import (
    compile_queue,
    compile_requests,
    compiled_artifact,
    cpu_compile,
    cpu_kernel,
    cpu_threads,
    elementwise,
    multi_tensor,
)
from hf_optim.optim.adamw import adamw_rule
from hf_optim.optim.runner import Runner

SHAPES = [(64, 80), (5000,), (300,), (9000,), (16, 200)]


class StandIn:
    """Replaces ``torch.compile`` of the kernels: the 'compiled' kernel is the eager update, counted; its first
    call (the compilation, on probe inputs) waits for ``release`` when one is given."""

    def __init__(self, release: threading.Event | None = None, fail: bool = False):
        self.release, self.fail = release, fail
        self.compilations, self.calls = [], 0

    def twin(self, rule):
        def compiled(*args):
            if compiled.compiling:
                compiled.compiling = False
                self.compilations.append(rule)
                if self.release is not None:
                    self.release.wait()
                if self.fail:
                    raise RuntimeError("C++ compile error\nsecond line")
            else:
                self.calls += 1
            elementwise.update(*args)

        compiled.compiling = True
        return compiled


class FakeWarmup:
    """Stands for a background compiler process: running until the test sets ``status``."""

    def __init__(self, status=None):
        self.status, self.started, self.killed, self.closed = status, time.perf_counter(), False, False

    def poll(self):
        return self.status

    def wait(self):
        if self.status is None:
            self.status = 0  # as if it finished now
        return self.status

    def error(self):
        return "CppCompileError: C++ compile error"

    def close(self, kill=False):
        self.killed |= kill and self.status is None
        self.closed = True


class Warmups:
    """Replaces ``cpu_compile.start_warmup``: records each start (the job round-tripped through pickle, as the real
    one writes it) and returns a :class:`FakeWarmup` that exits with ``status``."""

    def __init__(self, status=None):
        self.status, self.jobs, self.handles = status, [], []

    def __call__(self, kernel, hyper, key, threads):
        job = pickle.loads(pickle.dumps((kernel, hyper, key, threads)))
        assert job[0] == kernel and job[3] == threads
        assert all(torch.equal(a, b) for a, b in zip(job[1], hyper)) and type(job[1]) is type(hyper)
        assert (key is None and job[2] is None) or torch.equal(job[2], key)
        self.jobs.append(job)
        self.handles.append(FakeWarmup(self.status))
        return self.handles[-1]

    def finish(self, status=0):
        for handle in self.handles:
            handle.status = status


@pytest.fixture
def stand_in(small_cpu_kernels):
    """(no one-thread variant: the thread-count choice is tested below, on made-up timings)"""
    yield


class _LogLines:
    """(level, message) of the ``hf_optim`` logger's records at INFO and above (any thread), read when iterated."""

    def __init__(self, records: list[logging.LogRecord]):
        self.records = records

    def __iter__(self):
        return iter([(r.levelno, r.getMessage()) for r in self.records if r.levelno >= logging.INFO])


@pytest.fixture
def log_lines(hf_optim_records):
    return _LogLines(hf_optim_records)


def steps(cls, count, after_step=lambda step: None, **kwargs):
    params = make_params(SHAPES, seed=0)
    opt = cls(params, lr=1e-2, **kwargs)
    for step in range(count):
        set_grads(params, step)
        opt.step()
        after_step(step)
    return params, opt


def reference(cls, count, monkeypatch, **kwargs):
    with monkeypatch.context() as setup:
        setup.setenv("HF_OPTIM_COMPILE", "0")
        return steps(cls, count, **kwargs)


def test_background_process_starts_once_per_kernel_eager_until_it_exits_then_compiled_and_equal_to_eager(
        stand_in, log_lines, monkeypatch, tmp_path):
    expected, _ = reference(hf_optim.AdamW8bit, 5, monkeypatch)
    fake, warmups = StandIn(), Warmups()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    compiled_after = {}

    def after_step(step):
        compiled_after[step] = (len(fake.compilations), fake.calls)
        if step == 2:
            warmups.finish(0)  # the background processes exit: the next step loads their kernels

    params, _ = steps(hf_optim.AdamW8bit, 5, after_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    # two kernels: 8-bit state (>= 4096 elements) and fp32 state (the smaller tensors); one process each, once
    assert len(warmups.jobs) == 2 and {job[0].layouts[0].format.bits for job in warmups.jobs} == {8, 32}
    assert compiled_after[2] == (0, 0)  # three steps while the processes ran: nothing compiled in-process, eager
    assert compiled_after[3][0] == 2 and compiled_after[3][1] > 0  # the next step compiled (cache hit) and ran them
    assert all(handle.closed and not handle.killed for handle in warmups.handles)  # reaped
    starts = [message for _, message in log_lines if message.startswith("compiling the optimizer's CPU kernel")]
    assert len(starts) == 2
    expected = "adamw_rule, blockwise8 + blockwise8 state, float32 parameters in a background process"
    assert expected in starts[0] + starts[1]
    assert all(f"(once, cached in {tmp_path})" in line for line in starts)
    loaded = [message for _, message in log_lines if "(in a background process; loaded from the cache in" in message]
    assert len(loaded) == 2
    # more steps and a second optimizer of the same kind start and compile nothing more
    steps(hf_optim.AdamW8bit, 2)
    assert len(fake.compilations) == 2 and len(warmups.jobs) == 2


def test_every_kind_of_kernels_job_pickles(stand_in, monkeypatch):
    """What a background process gets: kernels with 4-bit and stacked state, an output, bf16 parameters with
    stochastic rounding; the round trip is checked by :class:`Warmups`."""
    warmups = Warmups()
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    for cls, kwargs in ((hf_optim.AdEMAMix4bit, {}), (hf_optim.LAMB8bit, {}), (hf_optim.Adafactor,
                                                                              {"relative_step": False})):
        steps(cls, 1, **kwargs)
    params = [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params(SHAPES, seed=0)]
    opt = hf_optim.AdamW8bit(params, lr=1e-2, bf16_stochastic_round=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert any(job[0].stochastic and job[2] is not None for job in warmups.jobs)
    assert len({job[0] for job in warmups.jobs}) == len(warmups.jobs) >= 5


def test_background_process_failure_warns_once_per_kernel_with_its_error_and_runs_eagerly(stand_in, log_lines,
                                                                                          monkeypatch):
    expected, _ = reference(hf_optim.Lion8bit, 4, monkeypatch)
    fake, warmups = StandIn(), Warmups(status=1)
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    params, _ = steps(hf_optim.Lion8bit, 4)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    warnings = [message for level, message in log_lines if level == logging.WARNING]
    assert len(warnings) == 2 and len(warmups.jobs) == 2 and fake.compilations == []
    assert "failed (CppCompileError: C++ compile error); it runs eagerly" in warnings[0]


def test_forget_withdraws_this_process_requests(stand_in, monkeypatch):
    warmups = Warmups()
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    steps(hf_optim.Lion8bit, 1)
    cpu_compile.forget()
    assert warmups.handles and all(handle.closed for handle in warmups.handles)


def test_compile_mode_1_compiles_before_the_first_step(stand_in, monkeypatch):
    fake, warmups = StandIn(), Warmups()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    ran = []
    run_update = multi_tensor.run_update
    monkeypatch.setattr(multi_tensor, "run_update", lambda *a, **k: ran.append(run_update(*a, **k)) or ran[-1])
    steps(hf_optim.Lion8bit, 1)
    assert len(fake.compilations) == 2 and ran.count(True) > ran.count(False)  # the first step ran compiled
    assert warmups.jobs == []  # in this process, no background one


def test_a_large_step_waits_for_the_compilation_instead_of_running_eagerly(stand_in, monkeypatch):
    monkeypatch.setattr(cpu_compile, "EAGER_WHILE_COMPILING", 4096)  # the 9000-element tensor's run exceeds it
    fake, warmups = StandIn(), Warmups()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    params = make_params([(9000,), (5000,)], seed=0)
    opt = hf_optim.AdamW8bit(params)
    set_grads(params, 0)
    opt.step()
    assert len(fake.compilations) == 1 and fake.calls > 0  # waited, then ran compiled in the first step
    assert warmups.handles[0].status == 0  # for the background process (FakeWarmup.wait)


def test_a_failed_compilation_warns_once_and_keeps_running_eagerly(stand_in, log_lines, monkeypatch):
    expected, _ = reference(hf_optim.RMSprop8bit, 3, monkeypatch)
    fake = StandIn(fail=True)
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    params, _ = steps(hf_optim.RMSprop8bit, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    warnings = [message for level, message in log_lines if level == logging.WARNING]
    assert len(warnings) == 2 and len(fake.compilations) == 2  # once per kernel, not per step
    assert "failed (RuntimeError: C++ compile error)" in warnings[0] and "runs eagerly" in warnings[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_process_has_nothing_pending(stand_in, monkeypatch):
    warmups = Warmups()
    monkeypatch.setattr(cpu_compile, "_twin", StandIn().twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    steps(hf_optim.AdamW8bit, 1)  # its background processes run: pending
    assert any(entry.pending for entry in cpu_compile._entries.values())
    pid = os.fork()
    if pid == 0:  # the child: exit at once, with the answer as its status
        entries = cpu_compile._entries.values()
        os._exit(0 if not any(entry.pending or entry.warmups for entry in entries) else 1)
    _, status = os.waitpid(pid, 0)
    warmups.finish(0)
    assert cpu_compile.wait(timeout=60)
    assert os.WEXITSTATUS(status) == 0


def test_invalid_compile_mode_is_refused_with_the_valid_values(monkeypatch):
    monkeypatch.setenv("HF_OPTIM_COMPILE", "yes")
    with pytest.raises(ValueError, match=r"HF_OPTIM_COMPILE='yes' is not valid; valid values are 'auto'.*'1'.*'0'"):
        cpu_compile.compile_mode()
    for value, mode in (("", "auto"), (" AUTO ", "auto"), ("1", "1"), ("0", "0")):
        monkeypatch.setenv("HF_OPTIM_COMPILE", value)
        assert cpu_compile.compile_mode() == mode


def test_invalid_compile_mode_raises_at_the_step_before_any_parameter_or_state_changes(stand_in, monkeypatch):
    params = make_params(SHAPES, seed=0)
    before = [p.detach().clone() for p in params]
    opt = hf_optim.AdamW8bit(params)
    set_grads(params, 0)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "true")
    with pytest.raises(ValueError, match=r"HF_OPTIM_COMPILE='true' is not valid") as raised:
        opt.step()
    assert len(str(raised.value).splitlines()) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and not opt.state


def test_compile_mode_0_never_compiles(stand_in, monkeypatch):
    expected, _ = reference(hf_optim.AdEMAMix8bit, 3, monkeypatch)  # HF_OPTIM_COMPILE=0 with the real compiler
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "0")
    params, _ = steps(hf_optim.AdEMAMix8bit, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert fake.compilations == [] and fake.calls == 0 and not cpu_compile._entries


def test_canonical_alias_shares_memory_starts_at_offset_zero_and_is_not_a_view():
    buffer = torch.zeros(2, 4096)
    view = buffer[1, 512:1024].view(-1, 256)
    alias = cpu_kernel.canonical(view)
    assert alias.storage_offset() == 0 and alias._base is None and alias.stride() == view.stride()
    alias.fill_(3.0)
    assert buffer[1, 512:1024].eq(3.0).all() and buffer[1, 511] == 0 and buffer[1, 1024] == 0
    plain = torch.zeros(4)
    assert cpu_kernel.canonical(plain) is plain


# ------------------------------------------------------------------------------------------------------------
# The thread-count choice, on made-up timings


def run(choice, ready, cost_per_count, runs, elements=cpu_threads.TIMED_ELEMENTS):
    picks = []
    for _ in range(runs):
        count = choice.pick(ready)
        picks.append(count)
        choice.record(count, cost_per_count[count] * elements, elements)
    return picks


def test_small_runs_slower_than_their_best_never_ask_for_the_one_thread_variant():
    """A run under TIMED_ELEMENTS is too short to judge a slowdown by its time: only the other processes' load
    counts (a busy meter still asks for the variant)."""
    small = cpu_threads.TIMED_ELEMENTS // 16
    choice = cpu_threads.ThreadChoice(2, load=lambda: 0.4)  # neither quiet nor busy: the runs' own time judges
    run(choice, lambda count: count == 2, {2: 1.0, 1: 1.3}, 5, small)
    run(choice, lambda count: count == 2, {2: 8.0, 1: 1.3}, 20, small)
    assert not choice.wants_one
    run(choice, lambda count: count == 2, {2: 8.0, 1: 1.3}, cpu_threads.SLOW_RUNS)  # runs long enough to time
    assert choice.wants_one
    busy = cpu_threads.ThreadChoice(2, load=lambda: 2.0)
    run(busy, lambda count: count == 2, {2: 1.0, 1: 1.3}, 5, small)
    assert busy.wants_one


def test_a_kernels_slow_first_run_on_an_idle_machine_does_not_ask_for_the_one_thread_variant():
    """A loaded kernel's first run pays one-time costs (its first call, first touches of its temporaries): timed, a
    first run 3x the later ones made the running figure 1.5x the best after WARMUP runs, and cold runs on an idle
    machine compiled the one-thread variant beside their steps (steps 12-45x slower meanwhile)."""
    choice = cpu_threads.ThreadChoice(2, load=lambda: 0.0)
    elements = cpu_threads.TIMED_ELEMENTS
    choice.record(2, 3.0 * elements, elements)
    run(choice, lambda count: count == 2, {2: 1.0, 1: 1.3}, 30)
    assert not choice.wants_one


def test_odd_slow_runs_do_not_ask_for_the_one_thread_variant_a_lasting_slowdown_does():
    """Without a meter of the other processes' load, the kernel's own time judges: only a slowdown that lasts
    SLOW_RUNS runs in a row asks for the one-thread variant (a single slow run once did, on an idle machine)."""
    choice = cpu_threads.ThreadChoice(2, load=lambda: None)
    for _ in range(4):
        run(choice, lambda count: count == 2, {2: 1.0, 1: 1.3}, 10)
        run(choice, lambda count: count == 2, {2: 2.5, 1: 1.3}, cpu_threads.SLOW_RUNS - 1)
    assert not choice.wants_one
    run(choice, lambda count: count == 2, {2: 2.5, 1: 1.3}, cpu_threads.SLOW_RUNS)
    assert choice.wants_one


def test_the_kernels_own_slow_runs_wait_for_the_meters_first_figure():
    """A warm run's kernel ran 3 slow runs (44 ns per element against its best 25) before the meter's first figure
    (two windows of WINDOW seconds) was in, and asked for the one-thread variant on an idle machine."""
    clock = {"now": 0.0}
    meter = cpu_threads.OtherLoad(busy=lambda: clock["now"] * 0.0, own=lambda: 0.0, clock=lambda: clock["now"])
    choice = cpu_threads.ThreadChoice(2, load=meter)
    for cost in (3.0, 1.0, 1.0, 1.8, 1.8, 1.8, 1.8):  # 50 ms apart: within the meter's first two windows
        run(choice, lambda count: count == 2, {2: cost, 1: 1.3}, 1)
        clock["now"] += 0.05
    assert meter.pending and not choice.wants_one
    for _ in range(20):  # the meter reads quiet from now on
        run(choice, lambda count: count == 2, {2: 1.8, 1: 1.3}, 1)
        clock["now"] += 0.05
    assert not meter.pending and meter.cores == 0.0 and not choice.wants_one


def test_a_quiet_meter_outweighs_the_kernels_own_slow_runs():
    """Warm steps of the Llama-3.2-1B LoRA set on an idle machine took 31 ms or 52-61 ms, often several slow ones in a
    row; judged by those runs, warm runs compiled the one-thread variant beside their steps (0.3-3 s each meanwhile).
    With the other processes measured quiet, a slow run is this process's own: one thread would not help."""
    choice = cpu_threads.ThreadChoice(2, load=lambda: 0.0)
    for _ in range(10):
        run(choice, lambda count: count == 2, {2: 1.0, 1: 1.3}, 3)
        run(choice, lambda count: count == 2, {2: 2.2, 1: 1.3}, 2 * cpu_threads.SLOW_RUNS)
    assert not choice.wants_one


def test_own_cpu_time_counts_the_children_this_process_waited_for():
    """What this process runs in children (torch's test programs when it first loads a compiled kernel) is its own
    work, not other processes' load."""
    before = cpu_threads.own_seconds()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                    "while time.process_time() < end: pass"], check=True)
    assert cpu_threads.own_seconds() - before >= 0.35


def test_idle_machine_keeps_all_threads_and_never_asks_for_the_one_thread_variant():
    choice = cpu_threads.ThreadChoice(2, load=lambda: 0.0)
    picks = run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 50)
    assert set(picks) == {2} and not choice.wants_one


def test_busy_machine_switches_to_one_thread_and_tries_all_threads_ever_more_rarely():
    choice = cpu_threads.ThreadChoice(2, load=lambda: 2.0)
    picks = run(choice, lambda count: True, {2: 10.0, 1: 1.0}, 600)
    # each count's first run is not timed (one-time costs): WARMUP timed runs of all threads, then one thread's
    # first run and its first measurement, which wins
    assert choice.wants_one and picks[:cpu_threads.WARMUP + 1] == [2] * (cpu_threads.WARMUP + 1)
    assert picks[cpu_threads.WARMUP + 1 : cpu_threads.WARMUP + 3] == [1, 1]
    tries = [i for i, count in enumerate(picks) if count == 2 and i > cpu_threads.WARMUP]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= cpu_threads.LAST_PROBE  # growing intervals, capped
    assert picks.count(1) > 0.97 * (len(picks) - cpu_threads.WARMUP)


def test_a_slowdown_the_meter_does_not_call_busy_asks_for_one_thread_and_a_quieter_machine_returns_to_all():
    choice = cpu_threads.ThreadChoice(2, load=lambda: 0.4)  # between QUIET and BUSY
    ready = {1: False}
    run(choice, lambda count: count == 2 or ready[1], {2: 1.0, 1: 1.3}, 5)
    assert not choice.wants_one
    run(choice, lambda count: count == 2 or ready[1], {2: 8.0, 1: 1.3}, 3)  # other processes start
    assert choice.wants_one  # 8x its best: compile the one-thread variant (meanwhile keep running with 2)
    ready[1] = True
    assert run(choice, lambda count: True, {2: 8.0, 1: 1.3}, 20)[-1] == 1
    picks = run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 2 * cpu_threads.LAST_PROBE)  # they stop
    assert picks[-1] == 2


def test_when_the_other_processes_stop_all_threads_come_back_within_a_few_runs():
    load = {"cores": 2.0}
    choice = cpu_threads.ThreadChoice(2, load=lambda: load["cores"])
    busy = run(choice, lambda count: True, {2: 30.0, 1: 3.0}, 300)  # tries of 2 threads are rare by now
    assert busy[-1] == 1 and choice.interval > 4 * cpu_threads.FIRST_PROBE
    load["cores"] = 0.0
    quiet = run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 3 * cpu_threads.FIRST_PROBE)
    assert quiet[-2 * cpu_threads.FIRST_PROBE:].count(2) > 1.5 * cpu_threads.FIRST_PROBE


@pytest.mark.parametrize("meter_says", ["quiet", "nothing new"])
def test_the_other_processes_cpu_time_brings_all_threads_back_when_one_thread_speeds_up_only_a_little(meter_says):
    # 2 spinning processes on 2 cores stop: one thread goes from 2/3 of a core to a whole one, 1.5x faster, less than
    # QUIETER; only the other processes' CPU time says the machine is quiet again, at once
    load = {"cores": 1.3}
    choice = cpu_threads.ThreadChoice(2, load=lambda: load["cores"])
    assert run(choice, lambda count: True, {2: 30.0, 1: 2.25}, 300)[-1] == 1
    load["cores"] = 0.02 if meter_says == "quiet" else 1.3
    quiet = run(choice, lambda count: True, {2: 1.0, 1: 1.5}, 4)
    if meter_says == "quiet":
        assert quiet[1:] == [2, 2, 2]  # the next run tries all threads, which win
    else:  # the one-thread figure alone does not make it try all threads soon
        assert quiet == [1, 1, 1, 1]


def test_a_machine_that_gets_busy_is_seen_by_the_other_processes_cpu_time_before_the_kernels_own_time():
    load = {"cores": 0.0}
    choice = cpu_threads.ThreadChoice(2, load=lambda: load["cores"])
    run(choice, lambda count: count == 2, {2: 1.0, 1: 1.3}, 10)
    assert not choice.wants_one
    load["cores"] = 0.4  # between QUIET and BUSY: no judgment either way
    run(choice, lambda count: count == 2, {2: 1.2, 1: 1.3}, 10)
    assert not choice.wants_one
    load["cores"] = 1.0  # busy, while all threads are not yet SLOWDOWN times slower
    run(choice, lambda count: count == 2, {2: 1.2, 1: 1.3}, 1)
    assert choice.wants_one


def test_unknown_other_load_leaves_the_choice_to_the_kernels_own_times():
    choice = cpu_threads.ThreadChoice(2, load=lambda: None)
    run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 20)
    assert not choice.wants_one
    assert run(choice, lambda count: True, {2: 8.0, 1: 1.3}, 10)[-1] == 1


def test_other_load_is_the_cores_busy_time_less_this_process_own_over_the_wall_time_read_once_per_window():
    clock = {"now": 0.0}
    reads = []
    busy = {"seconds": 100.0}
    own = {"seconds": 5.0}

    def read_busy():
        reads.append(clock["now"])
        return busy["seconds"]

    meter = cpu_threads.OtherLoad(busy=read_busy, own=lambda: own["seconds"], clock=lambda: clock["now"])
    assert meter() is None  # the first reading starts the window
    clock["now"] = 0.1
    busy["seconds"] += 0.15
    assert meter() is None and len(reads) == 1  # within the window: not read again
    clock["now"] = 1.0
    busy["seconds"] += 1.55  # 1.7 busy core-seconds over 1 s, 0.9 of them this process's
    own["seconds"] += 0.9
    assert meter() is None and len(reads) == 2  # one window (0.8 cores) is not enough to judge
    clock["now"] = 1.1
    assert meter() is None and len(reads) == 2
    clock["now"] = 2.0
    busy["seconds"] += 1.9  # 1.1 cores of other processes' over the second window
    own["seconds"] += 0.8
    assert meter() == pytest.approx(0.8) and len(reads) == 3  # the lesser of the two windows
    clock["now"] = 3.0
    busy["seconds"] += 1.0  # this process alone: quiet at once
    own["seconds"] += 1.0
    assert meter() == pytest.approx(0.0) and len(reads) == 4
    clock["now"] = 4.0
    busy["seconds"] += 2.0  # a burst of one window (a program starting): not load yet
    assert meter() == pytest.approx(0.0)


def test_other_load_reads_the_cores_of_this_process_from_proc_stat():
    if not os.path.exists("/proc/stat"):
        pytest.skip("/proc/stat is Linux's: elsewhere the meter answers None (tested above)")
    cores = cpu_threads.usable_cores()
    before = cpu_threads.busy_seconds(cores)
    own = cpu_threads.own_seconds()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # keep one core busy in this process
        pass
    # this process's own busy time is a part of the cores' busy time (ticks of 1/100 s on both sides)
    assert cpu_threads.busy_seconds(cores) - before >= cpu_threads.own_seconds() - own - 0.05
    assert cpu_threads.busy_seconds(()) == 0.0


def test_niced_processes_do_not_count_as_load_for_a_process_that_is_not_niced(monkeypatch):
    """The background compiler runs at nice +10 and yields the cores to the training process: the first cold
    quickstart read its compiling as load and compiled a one-thread kernel "because the machine is busy". The
    ``/proc/stat`` lines are proc(5)'s layout (user, nice, system, idle, iowait, irq, softirq, steal, ... in ticks);
    niced processes' user time is the nice column. (A live niced process is not used: under load the kernel's tick
    sampling undercounts a nice-19 process's time in that column against its own precise CPU time.)"""
    stat = ["cpu  1000 700 100 9000 5 3 2 1 0 0",
            "cpu0 600 400 60 4500 3 2 1 1 0 0",
            "cpu1 400 300 40 4500 2 1 1 0 0 0",
            "intr 12345"]
    monkeypatch.setattr(cpu_threads, "_proc_stat_lines", lambda: stat)
    tick = 1 / cpu_threads._TICKS_PER_SECOND
    not_niced = (600 + 60 + 2 + 1 + 1) + (400 + 40 + 1 + 1)  # user, system, irq, softirq, steal of cpu0 and cpu1
    assert cpu_threads.busy_seconds((0, 1), niced=False) == pytest.approx(not_niced * tick)
    assert cpu_threads.busy_seconds((0, 1), niced=True) == pytest.approx((not_niced + 400 + 300) * tick)
    assert cpu_threads.busy_seconds((1,), niced=True) == pytest.approx((400 + 300 + 40 + 1 + 1) * tick)
    # by default a process counts niced time exactly when it runs niced itself (its own time is in that column)
    for niceness, niced in ((0, False), (5, True)):
        monkeypatch.setattr(cpu_threads, "_own_niceness", lambda niceness=niceness: niceness)
        assert cpu_threads.busy_seconds((0, 1)) == cpu_threads.busy_seconds((0, 1), niced=niced)
    monkeypatch.setattr(cpu_threads, "_proc_stat_lines", lambda: None)
    assert cpu_threads.busy_seconds((0, 1)) is None


def test_thread_choice_is_not_made_with_a_single_thread():
    choice = cpu_threads.ThreadChoice(1, load=lambda: 2.0)
    assert set(run(choice, lambda count: True, {1: 1.0}, 10)) == {1}


def test_threads_context_sets_and_restores_the_calling_threads_count():
    if not cpu_threads.adjustable():
        pytest.skip("this torch has no OpenMP runtime: the thread count is left alone there (tested by design)")
    before = torch.get_num_threads()
    with cpu_threads.threads(1):
        assert torch.get_num_threads() == 1
        seen = []
        other = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        other.start()
        other.join()
        assert seen == [before]  # other threads keep theirs
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_compiled_one_thread_and_all_threads_compute_the_same_bits(monkeypatch):
    if not cpu_threads.adjustable() or torch.get_num_threads() == 1:
        pytest.skip("needs an OpenMP runtime and more than one thread")
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    cpu_compile.forget()
    results = {}
    for count in (torch.get_num_threads(), 1):
        monkeypatch.setattr(cpu_compile, "threads_for", lambda kernel, count=count: count)
        for cls in (hf_optim.AdamW8bit, hf_optim.AdEMAMix4bit):
            results[count, cls] = steps(cls, 3)[0]
    for cls in (hf_optim.AdamW8bit, hf_optim.AdEMAMix4bit):
        assert all(torch.equal(a, b) for a, b in zip(results[torch.get_num_threads(), cls], results[1, cls]))
    compiled = {count for entry in cpu_compile._entries.values() for count in entry.ready}
    assert compiled == {1, torch.get_num_threads()}
    cpu_compile.forget()


def test_per_tensor_path_uses_the_same_policy(stand_in, monkeypatch):
    monkeypatch.setattr(Runner, "on_multi_tensor_path", lambda self, full, param: False)
    expected, _ = reference(hf_optim.AdamW8bit, 2, monkeypatch)
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    params, _ = steps(hf_optim.AdamW8bit, 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert fake.calls > 0


def stacked_steps(count, after_step=lambda step: None):
    """AdEMAMix8bit (a stacked first slot) on two groups: a small one, whose flat state is one chunk (contiguous
    stacked rows), and a large one, whose chunks are slices of longer rows: a kernel for each layout."""
    small, large = make_params([(10, 5), (10,)], seed=1), make_params(SHAPES, seed=2)
    opt = hf_optim.AdEMAMix8bit([{"params": small}, {"params": large}], lr=1e-2, min_8bit_size=0)
    params = small + large
    for step in range(count):
        set_grads(params, step)
        opt.step()
        after_step(step)
    return params


USER_SOURCE = "\n".join(f"def f{i}(x):\n    return [y * {i} for y in x if y]" for i in range(40))


def user_work_between_steps(seconds: float = 0.5) -> list[str]:
    """A user's Python work between two steps, in a thread of the user's while this one waits for it: it parses
    and compiles code and walks ``sys.modules`` without copying it. Nothing of hf_optim's may run meanwhile: a thread
    that loaded kernels beside the user's once imported modules there ('dictionary changed size during iteration')
    and ran Python's AST code, which Python 3.11 does not make thread-safe (a pytest session aborted)."""
    import ast

    problems = []

    def work():
        try:
            modules, deadline = len(sys.modules), time.monotonic() + seconds
            while time.monotonic() < deadline:
                compile(ast.parse(USER_SOURCE), "<user>", "exec")
                for _ in sys.modules.values():
                    pass
            if len(sys.modules) != modules:
                problems.append(f"sys.modules grew from {modules} to {len(sys.modules)} while the user's code ran")
        except Exception as error:  # noqa: BLE001 (what the user's thread would have died of)
            problems.append(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return problems


@pytest.mark.slow
def test_a_real_background_process_warms_the_cache_and_this_process_then_loads_it(monkeypatch, tmp_path, log_lines):
    """The real background worker compiles AdEMAMix's kernels for both layouts of its stacked slot and saves them;
    this process loads them between its steps (eager until loaded, nothing compiled here), a later run loads them at
    its first step, in the thread that steps, with the user's Python undisturbed between the steps; every result
    equals the eager run's bit for bit, and torch's random state is untouched. A saved kernel given a call of the
    other layout refuses it and the call runs eagerly, with the same results."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # empty: only the background worker fills it
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(cpu_threads, "adjustable", lambda: False)  # no one-thread variant, however busy the machine
    cpu_compile.forget()
    with monkeypatch.context() as eager:
        eager.setenv("HF_OPTIM_COMPILE", "0")
        expected = stacked_steps(4)
    handles = []
    start_warmup = cpu_compile.start_warmup
    monkeypatch.setattr(cpu_compile, "start_warmup", lambda *job: handles.append(start_warmup(*job)) or handles[-1])
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    misses = counters["inductor"]["fxgraph_cache_miss"]

    def after_step(step):
        if step == 0:
            assert len(handles) == 2  # one kernel per layout of the stacked slot
            assert all(handle.wait() == 0 for handle in handles), [handle.error() for handle in handles]

    random_state = torch.get_rng_state()
    params = stacked_steps(4, after_step)
    cpu_compile.wait()
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert torch.equal(torch.get_rng_state(), random_state)
    assert counters["inductor"]["fxgraph_cache_miss"] == misses  # nothing compiled in this process
    kernels = list(cpu_compile._entries)
    threads = torch.get_num_threads()
    assert sorted(kernel.spread for kernel in kernels) == [(False, False), (True, False)]
    assert [set(entry.loaded) for entry in cpu_compile._entries.values()] == [{threads}, {threads}]
    assert not any(entry.misfits for entry in cpu_compile._entries.values())
    queue = compile_requests.queue().directory
    assert {path.suffix for path in queue.iterdir()} <= {".lock", ".log"}  # no job or request left in the queue
    for kernel in kernels:  # what it leaves for later processes: the marker and the saved kernel beside it
        marker = compile_requests.warm_marker(kernel, threads)
        assert marker.exists() and compiled_artifact.path_beside(marker).exists()

    # a saved kernel never raises on a call its guards refuse: the contiguous layout's kernel given strided rows
    dense, strided = sorted(kernels, key=lambda kernel: kernel.spread)
    param, grad, out, tensors, hyper, _ = cpu_compile._entries[strided].probe(5)
    param.normal_(generator=torch.Generator().manual_seed(0))
    grad.normal_(generator=torch.Generator().manual_seed(1))
    twin = [t.clone() for t in (param, *tensors)]
    elementwise.update(dense.rule, dense.layouts, twin[0], grad, out, twin[1:], hyper)
    assert not multi_tensor.run_update(dense.rule, dense.layouts, param, grad, out, tensors, hyper, kernel=dense)
    assert all(torch.equal(a, b) for a, b in zip((param, *tensors), twin))
    assert cpu_compile._entries[dense].misfits == 1
    assert [message for level, message in log_lines if level == logging.WARNING and "does not fit" in message]

    # a later run: no process started; the first step loads the saved kernels, in the thread that steps (no thread
    # of hf_optim's runs beside it), and runs on them; the user's Python between the steps is left alone
    cpu_compile.forget()
    loaded_after, own_threads, problems = {}, set(), []

    def later_step(step):
        loaded_after[step] = sum(len(entry.loaded) for entry in cpu_compile._entries.values())
        own_threads.update(thread.name for thread in threading.enumerate() if thread.name.startswith("hf_optim"))
        problems.extend(user_work_between_steps())

    params = stacked_steps(4, later_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert torch.equal(torch.get_rng_state(), random_state)
    assert len(handles) == 2 and loaded_after == {0: 2, 1: 2, 2: 2, 3: 2} and not own_threads and not problems
    assert counters["inductor"]["fxgraph_cache_miss"] == misses
    cpu_compile.forget()


def test_a_kernel_queued_by_another_process_is_not_queued_again_and_runs_when_its_marker_appears(
        stand_in, log_lines, monkeypatch):
    """The real queue, this test playing the worker (no process started): a kernel already queued gets this
    process's request only; the steps run eagerly until its marker appears, then compiled (a cache hit)."""
    expected, _ = reference(hf_optim.Lion8bit, 4, monkeypatch)
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    started = []
    monkeypatch.setattr(compile_queue.Queue, "ensure_worker", lambda self, root: started.append(root))
    monkeypatch.setattr(compile_requests.QueuedCompile, "CHECK_EVERY_S", 0.0)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    warmups = Warmups()  # which kernels these steps need
    with monkeypatch.context() as probe:
        probe.setattr(cpu_compile, "start_warmup", warmups)
        steps(hf_optim.Lion8bit, 1)
    cpu_compile.forget()
    lion8 = next(job[0] for job in warmups.jobs if job[0].layouts[0].format.bits == 8)
    key = compile_requests.kernel_key(lion8, torch.get_num_threads())
    queue = compile_requests.queue()
    other = _other_process_identity()
    queue.directory.mkdir(parents=True)
    (queue.directory / f"{key}.job").write_bytes(b"queued by another process")
    (queue.directory / f"{key}.{other}.req").touch()

    def after_step(step):
        if step == 1:  # the worker compiled the 8-bit kernel
            marker = compile_requests.marker_of(key)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()

    params, _ = steps(hf_optim.Lion8bit, 4, after_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert (queue.directory / f"{key}.job").read_bytes() == b"queued by another process"  # not queued again
    assert started  # made sure a worker runs for it
    assert fake.compilations == [lion8.rule] and fake.calls > 0  # loaded when its marker appeared, and ran
    assert not list(queue.directory.glob(f"{key}.{compile_queue.me()}.*"))  # this process's request withdrawn


def test_an_error_of_the_worker_reaches_the_requester_as_one_warning_and_the_kernel_runs_eagerly(
        stand_in, log_lines, monkeypatch):
    expected, _ = reference(hf_optim.RMSprop8bit, 3, monkeypatch)
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(compile_queue.Queue, "ensure_worker", lambda self, root: None)
    monkeypatch.setattr(compile_requests.QueuedCompile, "CHECK_EVERY_S", 0.0)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    queue = compile_requests.queue()

    def after_step(step):
        if step == 0:  # the worker's part: it takes each job and fails on it
            while (key := queue.next_job()) is not None:
                queue.claim(key)
                queue.fail(key, "CppCompileError: C++ compile error")

    params, _ = steps(hf_optim.RMSprop8bit, 3, after_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    warnings = [message for level, message in log_lines if level == logging.WARNING]
    assert len(warnings) == 2 and fake.compilations == []  # one per kernel (8-bit and fp32 state)
    assert all("failed (CppCompileError: C++ compile error); it runs eagerly" in line for line in warnings)
    assert [path.name for path in queue.directory.iterdir() if path.suffix in (".job", ".req", ".failed")] == []


def _other_process_identity() -> str:
    """The identity of a process other than this one that outlives the test (this test process's parent)."""
    parent = os.getppid()
    return f"{parent}-{compile_queue._start_time(parent)}"


def test_a_kernel_a_background_process_compiled_before_is_compiled_at_the_first_step_without_a_new_process(
        stand_in, log_lines, monkeypatch):
    """The warm marker a background process leaves: the next run neither starts a process nor runs eagerly."""
    expected, _ = reference(hf_optim.AdamW8bit, 2, monkeypatch)
    fake, warmups = StandIn(), Warmups()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", warmups)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    steps(hf_optim.AdamW8bit, 1)  # first run: starts the processes (the fakes never finish)
    assert len(warmups.jobs) == 2
    for kernel, _, _, threads in warmups.jobs:  # what the worker leaves when it succeeds
        marker = compile_requests.warm_marker(kernel, threads)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    cpu_compile.forget()
    params, _ = steps(hf_optim.AdamW8bit, 2)
    assert len(warmups.jobs) == 2  # no new process
    assert len(fake.compilations) == 2 and fake.calls > 0  # compiled in-process at the first step, and ran
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    later = [message for _, message in log_lines if message.startswith("compiling the optimizer's CPU kernel")][2:]
    assert len(later) == 2 and not any("in a background process" in line for line in later)


def test_warm_marker_names_the_same_kernel_alike_in_every_process(tmp_path):
    """The marker's name must not depend on the process (hash randomization, what a format object cached): the
    background process writes it, a later run looks it up."""
    script = ("import torch, hf_optim\nfrom hf_optim import formats\n"
              "from hf_optim.kernels.torch_path import compile_requests, cpu_kernel\n"
              "from hf_optim.optim.lamb import lamb_rule\n"
              "layouts = (formats.SlotLayout(formats.format_named('blockwise8'), True),"
              " formats.SlotLayout(formats.format_named('fp32'), False))\n"
              "kernel = cpu_kernel.Kernel(lamb_rule, layouts, (1, 1), True, torch.float32, torch.float32, False,"
              " (False, False))\n"
              "print(compile_requests.warm_marker(kernel, 2).name)\n")
    names = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(seed), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
                            ).stdout.strip() for seed in (1, 2, 3, 4)}
    assert len(names) == 1 and names.pop().endswith(".ready")


@pytest.mark.parametrize("policy", ["", "passive", "PASSIVE", "active"])
def test_the_one_thread_variants_log_line_names_the_passive_wait_policy_unless_it_is_set(policy, log_lines,
                                                                                         monkeypatch):
    monkeypatch.setenv(cpu_threads.WAIT_POLICY_ENV, policy)
    layouts = (formats.SlotLayout(formats.format_named("blockwise8"), True),)
    kernel = cpu_kernel.Kernel(adamw_rule, layouts, (1,), False, torch.float32, torch.float32, False, (False,))
    entry = cpu_compile._Entry(adamw_rule, ready={2})
    cpu_compile._announce(kernel, entry, 1, "background")  # the one-thread variant of a compiled kernel
    cpu_compile._announce(kernel, entry, 2, "background")  # (another count: no variant, no hint)
    (_, variant), (_, other) = log_lines
    assert "1 thread (the machine is busy)" in variant and "OMP_WAIT_POLICY" not in other
    assert ("OMP_WAIT_POLICY=PASSIVE, set before Python starts" in variant) == (policy.lower() != "passive")
    assert variant.endswith(")")  # the console test's pattern for this line: "... (once, cached in ...)"
