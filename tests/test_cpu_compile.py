"""When the CPU kernels compile (hf_optim.kernels.cpu_compile) and with how many threads they run (cpu_threads).

The fast tests replace inductor by a stand-in that runs the eager update (the policy is what is tested, not the
compiler); the real compiler is exercised by the slow tests here and in test_multi_tensor.py.
"""

import logging
import os
import sys
import threading
import time

import pytest
import torch
from helpers import make_params, set_grads

import hf_optim
from hf_optim.kernels import cpu_compile, cpu_threads, elementwise, multi_tensor
from hf_optim.optim.base import HfOptimizer

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


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)
    cpu_compile.forget()
    yield
    cpu_compile.forget()


@pytest.fixture
def log_lines():
    """Messages of the ``hf_optim`` logger at INFO and above, from any thread."""
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    logger = logging.getLogger("hf_optim")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


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


def test_background_compile_logs_once_runs_eagerly_meanwhile_and_equals_eager(stand_in, log_lines, monkeypatch,
                                                                              tmp_path):
    expected, _ = reference(hf_optim.AdamW8bit, 4, monkeypatch)
    release = threading.Event()
    fake = StandIn(release)
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")

    def after_step(step):
        if step == 1:
            assert fake.calls == 0  # two steps so far, both eager: the compilation is held back
            release.set()
            assert cpu_compile.wait(timeout=60)

    params, _ = steps(hf_optim.AdamW8bit, 4, after_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert fake.calls > 0  # steps 3 and 4 ran the compiled kernel
    # two kernels: 8-bit state (>= 4096 elements) and fp32 state (the smaller tensors); one line each, once
    starts = [message for _, message in log_lines if message.startswith("compiling the optimizer's CPU kernel")]
    assert len(starts) == 2 and len(fake.compilations) == 2
    assert "adamw_rule, 8-bit + 8-bit state, float32 parameters in the background" in starts[0] + starts[1]
    assert all(f"(once, cached in {tmp_path})" in line for line in starts)
    # more steps and a second optimizer of the same kind compile nothing more
    steps(hf_optim.AdamW8bit, 2)
    assert len(fake.compilations) == 2


def test_compile_mode_1_compiles_before_the_first_step(stand_in, monkeypatch):
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    ran = []
    run_update = multi_tensor.run_update
    monkeypatch.setattr(multi_tensor, "run_update", lambda *a, **k: ran.append(run_update(*a, **k)) or ran[-1])
    steps(hf_optim.Lion8bit, 1)
    assert len(fake.compilations) == 2 and ran.count(True) > ran.count(False)  # the first step ran compiled


def test_a_large_step_waits_for_the_compilation_instead_of_running_eagerly(stand_in, monkeypatch):
    monkeypatch.setattr(cpu_compile, "EAGER_WHILE_COMPILING", 4096)  # the 9000-element tensor's run exceeds it
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    params = make_params([(9000,), (5000,)], seed=0)
    opt = hf_optim.AdamW8bit(params)
    set_grads(params, 0)
    opt.step()
    assert len(fake.compilations) == 1 and fake.calls > 0  # waited, then ran compiled in the first step


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
def test_a_forked_process_has_no_compiler_thread_and_nothing_pending(stand_in, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(cpu_compile, "_twin", StandIn(release).twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    steps(hf_optim.AdamW8bit, 1)  # its compilations are held back: pending
    assert any(entry.pending for entry in cpu_compile._entries.values())
    pid = os.fork()
    if pid == 0:  # the child: exit at once, with the answer as its status
        clean = cpu_compile._worker is None and not any(entry.pending for entry in cpu_compile._entries.values())
        os._exit(0 if clean else 1)
    _, status = os.waitpid(pid, 0)
    release.set()
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


def test_background_compiler_has_a_lower_priority_and_a_short_switch_interval_meanwhile(stand_in, monkeypatch):
    before = sys.getswitchinterval()
    release = threading.Event()
    seen, niceness = [], []
    fake = StandIn(release)

    def twin(rule):
        compiled = fake.twin(rule)

        def watched(*args):
            seen.append(sys.getswitchinterval())
            if sys.platform.startswith("linux"):
                niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return compiled(*args)

        return watched

    monkeypatch.setattr(cpu_compile, "_twin", twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    steps(hf_optim.Lion8bit, 1)
    release.set()
    assert cpu_compile.wait(timeout=60)
    assert seen and all(interval <= cpu_compile.SWITCH_INTERVAL for interval in seen[:len(fake.compilations)])
    if sys.platform.startswith("linux"):  # the compiler thread only: the training's thread keeps its priority
        main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert niceness[0] == min(19, main + cpu_compile.NICENESS) and niceness[0] > main or main == 19
    deadline = time.monotonic() + 10  # the worker restores it right after its last job's bookkeeping
    while sys.getswitchinterval() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sys.getswitchinterval() == before


def test_canonical_alias_shares_memory_starts_at_offset_zero_and_is_not_a_view():
    buffer = torch.zeros(2, 4096)
    view = buffer[1, 512:1024].view(-1, 256)
    alias = cpu_compile.canonical(view)
    assert alias.storage_offset() == 0 and alias._base is None and alias.stride() == view.stride()
    alias.fill_(3.0)
    assert buffer[1, 512:1024].eq(3.0).all() and buffer[1, 511] == 0 and buffer[1, 1024] == 0
    plain = torch.zeros(4)
    assert cpu_compile.canonical(plain) is plain


# ------------------------------------------------------------------------------------------------------------
# The thread-count choice, on made-up timings


def run(choice, ready, cost_per_count, runs):
    picks = []
    for _ in range(runs):
        count = choice.pick(ready)
        picks.append(count)
        choice.record(count, cost_per_count[count] * 1000, 1000)
    return picks


def test_idle_machine_keeps_all_threads_and_never_asks_for_the_one_thread_variant():
    choice = cpu_threads.ThreadChoice(2, busy=lambda: False)
    picks = run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 50)
    assert set(picks) == {2} and not choice.wants_one


def test_busy_machine_switches_to_one_thread_and_tries_all_threads_ever_more_rarely():
    choice = cpu_threads.ThreadChoice(2, busy=lambda: True)
    picks = run(choice, lambda count: True, {2: 10.0, 1: 1.0}, 600)
    assert choice.wants_one and picks[:cpu_threads.WARMUP] == [2] * cpu_threads.WARMUP
    assert picks[cpu_threads.WARMUP] == 1  # the first measurement of one thread, which wins
    tries = [i for i, count in enumerate(picks) if count == 2 and i > cpu_threads.WARMUP]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= cpu_threads.LAST_PROBE  # growing intervals, capped
    assert picks.count(1) > 0.97 * (len(picks) - cpu_threads.WARMUP)


def test_slowdown_without_a_high_load_average_asks_for_one_thread_and_a_quieter_machine_returns_to_all():
    choice = cpu_threads.ThreadChoice(2, busy=lambda: False)
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
    choice = cpu_threads.ThreadChoice(2, busy=lambda: True)
    busy = run(choice, lambda count: True, {2: 30.0, 1: 3.0}, 300)  # tries of 2 threads are rare by now
    assert busy[-1] == 1 and choice.interval > 4 * cpu_threads.FIRST_PROBE
    quiet = run(choice, lambda count: True, {2: 1.0, 1: 1.3}, 3 * cpu_threads.FIRST_PROBE)
    assert quiet[-2 * cpu_threads.FIRST_PROBE:].count(2) > 1.5 * cpu_threads.FIRST_PROBE


def test_thread_choice_is_not_made_with_a_single_thread():
    choice = cpu_threads.ThreadChoice(1, busy=lambda: True)
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
    monkeypatch.setattr(HfOptimizer, "_on_multi_tensor_path", lambda self, full, param: False)
    expected, _ = reference(hf_optim.AdamW8bit, 2, monkeypatch)
    fake = StandIn()
    monkeypatch.setattr(cpu_compile, "_twin", fake.twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "1")
    params, _ = steps(hf_optim.AdamW8bit, 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    assert fake.calls > 0


def test_background_compile_does_not_rewind_the_training_threads_random_numbers(stand_in, monkeypatch):
    """Dynamo saves the CPU random state before tracing and restores it after (convert_frame.preserve_global_state);
    the stand-in does the same, in the compiler thread, while the training thread draws (its dropout masks)."""
    import inspect

    from torch._dynamo import convert_frame
    assert "torch.random.set_rng_state(" in inspect.getsource(convert_frame)  # what the guard intercepts
    traced, drawn = threading.Event(), threading.Event()
    fake = StandIn()

    def twin(rule):
        compiled = fake.twin(rule)

        def like_dynamo(*args):
            if compiled.compiling:
                saved = torch.random.get_rng_state()
                traced.set()
                drawn.wait(60)
                torch.random.set_rng_state(saved)
            return compiled(*args)

        return like_dynamo

    monkeypatch.setattr(cpu_compile, "_twin", twin)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    params = make_params(SHAPES, seed=0)
    opt = hf_optim.Lion8bit(params)
    set_grads(params, 0)
    torch.manual_seed(1)
    expected = torch.rand(8)
    torch.manual_seed(1)
    opt.step()
    assert traced.wait(60)
    first = torch.rand(4)  # drawn while the compiler thread traces
    drawn.set()
    assert cpu_compile.wait(timeout=60)
    assert torch.equal(torch.cat([first, torch.rand(4)]), expected)
    torch.random.set_rng_state(torch.random.get_rng_state())  # outside the compiler thread it still works
    state = torch.random.get_rng_state()
    torch.rand(3)
    torch.random.set_rng_state(state)
    assert torch.equal(torch.random.get_rng_state(), state)
