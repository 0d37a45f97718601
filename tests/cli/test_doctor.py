"""``hf-optim doctor`` on the CPU: the tables, ``--json``, exit status 1 on a mismatch or a fallback, one-line errors.

Each run is kept small with ``--quick`` (no timed steps) and ``--algorithms`` (one algorithm's formats and dtypes);
conftest runs the PyTorch path eagerly (``HF_OPTIM_COMPILE=0``), so the CPU's candidate is the eager path itself and
the comparison machinery is checked by corrupting one result.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import sigint_as_in_a_terminal

from hf_optim import cli
from hf_optim.doctor import report as report_module
from hf_optim.doctor import selftest
from hf_optim.kernels import backend
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.optim import registry

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU report (a GPU machine reports its GPU)")


@pytest.fixture(autouse=True)
def _fresh_guards(fresh_guards):
    yield


def doctor(capsys, *args):
    code = cli.main(["doctor", "--quick", *args])
    out, err = capsys.readouterr()
    return code, out, err


@cpu_only
def test_table_on_cpu(capsys):
    code, out, _ = doctor(capsys, "--algorithms", "lion")
    assert code == 0
    for title in ("Versions", "Devices", "Caches of compiled kernels", "Self-test on cpu: torch against torch (eager)"):
        assert title in out
    assert "all 15 cases match on torch" in out  # 32-bit/8-bit/fp8/4-bit stochastic/4-bit blockwise x fp32/bf16/fp16
    assert "One step on a" not in out  # --quick: no timings


@cpu_only
def test_json_keys(capsys):
    code, out, _ = doctor(capsys, "--json", "--algorithms", "rmsprop,adafactor")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"versions", "devices", "caches", "self_test", "timings", "timings_skipped",
                           "triton_compiles", "fallbacks", "ok"}
    assert report["ok"] is True and report["timings"] is None and report["timings_skipped"] == "--quick"
    assert {"torch", "triton", "transformers", "trl", "bitsandbytes", "hf_optim", "cuda_runtime",
            "cuda_driver"} <= set(report["versions"])
    assert report["versions"]["torch"] == torch.__version__
    (cpu,) = report["devices"]
    assert cpu["device"] == "cpu" and cpu["backend"] == backend.backend_name(torch.device("cpu"))
    assert cpu["paging"].startswith("unavailable")
    assert set(report["caches"]) == {"inductor", "triton"}
    cases = report["self_test"]["cases"]
    # RMSprop: 32-bit, 8-bit, fp8 and 4-bit; Adafactor: 32 and 8-bit (its first moment); each in three dtypes
    assert [(c["algorithm"], c["state"]) for c in cases][::3] == [
        ("rmsprop", "32-bit"), ("rmsprop", "8-bit blockwise"), ("rmsprop", "8-bit float (fp8)"),
        ("rmsprop", "4-bit stochastic"), ("rmsprop", "4-bit blockwise"), ("adafactor", "32-bit"),
        ("adafactor", "8-bit blockwise")]
    assert {c["dtype"] for c in cases} == {"fp32", "bf16", "fp16"}
    assert all(c["status"] == "exact" for c in cases)
    assert any(c["codes"] > 0 for c in cases)  # the quantized cases compare codes


def corrupt_candidate(monkeypatch, algorithm: str, state_format: str, dtype: torch.dtype):
    """After each step of the path under test (not the reference) for one case, move one parameter element by one
    ulp: the doctor must report exactly that case."""
    step = selftest.step

    def corrupted(optimizer, env):
        step(optimizer, env)
        group = optimizer.param_groups[0]
        p = group["params"][0]
        chosen = optimizer.algorithm == algorithm and group["state_format"] == state_format and p.dtype == dtype
        if env != selftest.REFERENCE_ENV and chosen:
            with torch.no_grad():
                largest = p.view(-1).abs().argmax()  # one ulp there is one ulp at the tensor's scale
                p.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)[largest] += 1  # next float

    monkeypatch.setattr(selftest, "step", corrupted)


@cpu_only
def test_exit_1_on_a_mismatch(capsys, monkeypatch):
    corrupt_candidate(monkeypatch, "lion", "blockwise8", torch.bfloat16)
    code, out, _ = doctor(capsys, "--json", "--algorithms", "lion")
    assert code == 1
    report = json.loads(out)
    bad = [c for c in report["self_test"]["cases"] if c["status"] != "exact"]
    assert [(c["state"], c["dtype"], c["status"]) for c in bad] == [("8-bit blockwise", "bf16", "MISMATCH")]
    assert bad[0]["param_ulps"] == 1.0 and bad[0]["detail"] == "after step 1" and report["ok"] is False
    code, out, _ = doctor(capsys, "--algorithms", "lion")
    assert code == 1 and "MISMATCH" in out and "1 of 15 cases failed: MISMATCH (exit status 1)" in out


def test_tolerances():
    """A 1-ulp parameter difference passes the interpreter's tolerance but not the exact one; a code one step apart
    passes the reduction-order tolerance only on few codes."""
    a = torch.randn(1000)
    b = a.clone()
    largest = a.abs().argmax()  # its ulp is the tensor's scale's (a smaller element's ulp is a fraction of it)
    b[largest] = torch.nextafter(a[largest], a[largest] * 2)
    assert selftest.ulps(b, a) == 1.0 and selftest.ulps(a, a) == 0.0
    one_ulp = selftest.Difference(param_ulps=1.0)
    assert not one_ulp.within(selftest.EXACT, 1) and one_ulp.within(selftest.CPU_MATH, 1)
    assert not selftest.Difference(param_ulps=3.0).within(selftest.CPU_MATH, 2)
    codes = torch.arange(200, dtype=torch.uint8)
    nudged = codes.clone()
    nudged[5] += 1
    assert selftest.code_distance(nudged, codes, packed=False) == (1, 200, 1)
    assert selftest.code_distance(nudged, codes, packed=True) == (1, 400, 1)  # the low nibble moved
    assert selftest.Difference(codes_differing=1, codes=200, code_step=1).within(selftest.REDUCTIONS, 1)
    assert not selftest.Difference(codes_differing=3, codes=200, code_step=1).within(selftest.REDUCTIONS, 1)
    assert not selftest.Difference(codes_differing=1, codes=200, code_step=2).within(selftest.REDUCTIONS, 1)


@cpu_only
def test_interpreter_case_runs_the_triton_kernels():
    """``--interpret``'s candidate on the CPU: the fused Triton kernel, in the interpreter (conftest set
    TRITON_INTERPRET), against the eager reference."""
    cand = selftest.candidate(torch.device("cpu"), interpret=True)
    lion = registry.lookup_algorithm("lion")
    result = selftest.check(lion, "blockwise8", "bf16", torch.device("cpu"), cand, shapes=((33, 37), (300,)), steps=2)
    assert (result.backend, result.status, result.tolerance) == ("triton (interpreter)", "exact", "1 ulp/step")
    # it ran the Triton step: the kernels of its one kernel group (bf16 parameters; both tensors are under
    # min_8bit_size, so fp32 state)
    assert [r.label for r in triton_guard.compile_records()] == ["fused/lion bf16 32-bit"]


@cpu_only
def test_a_kernel_that_falls_back_fails_the_case(monkeypatch):
    """A Triton kernel that does not compile here: the case's numbers match (the PyTorch path ran), but the doctor
    reports it as fallen back."""
    from hf_optim.kernels.triton_path import elementwise as triton_elementwise

    monkeypatch.setattr(backend, "TRITON_DEVICE_TYPES", (*backend.TRITON_DEVICE_TYPES, "cpu"))
    kernel = triton_elementwise._fused_update_kernel

    def broken(*args, **kwargs):
        raise RuntimeError("ptxas fatal: Unsupported .target 'sm_20'")

    monkeypatch.setattr(kernel, "warmup", broken)
    cand = selftest.candidate(torch.device("cpu"))
    assert cand.name == "triton"
    adamw = registry.lookup_algorithm("adamw")
    first = selftest.check(adamw, "blockwise8", "fp32", torch.device("cpu"), cand, shapes=((300,),), steps=2)
    again = selftest.check(adamw, "blockwise8", "fp32", torch.device("cpu"), cand, shapes=((300,),), steps=2)
    assert (first.status, again.status) == ("fell back", "fell back")  # the second never tried Triton


@cpu_only
@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--device", "cuda:3"], "no CUDA device is visible"),
    (["--device", "tpu"], "'tpu' is not a device"),
    (["--algorithms", "lionn"], "no algorithm 'lionn' (did you mean 'lion'?)"),
    (["--interpret", "--device", "cuda"], "no CUDA device is visible"),
])
def test_user_errors_are_one_line(capsys, args, message):
    code = cli.main(["doctor", *args])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_python_dash_m_entry_point():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-m", "hf_optim.doctor", "--nope"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("python -m hf_optim.doctor: error: unrecognized arguments: --nope "
                                   "(see python -m hf_optim.doctor --help)")


@pytest.mark.gpu
def test_doctor_on_the_gpu(capsys):
    """On a GPU: the Triton path of two algorithms (an elementwise one, and LAMB's passes) against the eager
    reference on CUDA, paging checked, nothing fell back; then the timed steps of one algorithm."""
    code, out, err = doctor(capsys, "--json", "--algorithms", "adamw,lamb")
    report = json.loads(out)
    assert code == 0, [c for c in report["self_test"]["cases"] if c["status"] not in ("exact", "within tolerance")]
    assert report["self_test"]["backend"] == "triton" and report["self_test"]["device"] == "cuda"
    assert all(c["status"] == "exact" for c in report["self_test"]["cases"] if c["algorithm"] == "adamw")
    cuda = [d for d in report["devices"] if d["device"].startswith("cuda")]
    assert cuda and cuda[0]["arch"].startswith("sm_") and cuda[0]["paging"].startswith("works")
    assert report["triton_compiles"] and not report["fallbacks"]["triton"]
    code = cli.main(["doctor", "--algorithms", "lion"])
    out, _ = capsys.readouterr()
    assert code == 0 and "torch.optim.AdamW(fused=True)" in out and "Lion 8-bit" in out


def test_the_cpu_self_test_is_eager_unless_compiled_is_asked(monkeypatch):
    """Compiling every algorithm x format x dtype takes minutes on a cold cache: by default the CPU's candidate is
    the eager path (no compile process starts), --compiled tests the compiled kernels a run uses."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")
    monkeypatch.setattr(backend, "backend_name", lambda device: "torch-compile")
    assert selftest.candidate(cpu) == selftest.Candidate("torch", {"HF_OPTIM_COMPILE": "0"})
    assert selftest.candidate(cpu, compiled=True) == selftest.Candidate("torch-compile", {"HF_OPTIM_COMPILE": "1"})
    assert cli.main(["doctor", "--compiled", "--nope"]) == 2  # the flag exists; the bad one is still one line


@cpu_only
def test_the_full_cpu_doctor_times_nothing_eagerly_and_says_how_to_time(capsys):
    """An eager CPU step is the reference, seconds where the compiled kernel takes milliseconds: the full doctor
    (no --quick) does not time it, and says that --compiled times what a run uses."""
    code = cli.main(["doctor", "--algorithms", "rmsprop"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "One step on a" not in out and "no timed steps" in out and "--compiled" in out
    assert cli.main(["doctor", "--json", "--algorithms", "rmsprop"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["timings"] is None and report["timings_skipped"] == report_module.NO_EAGER_TIMINGS


@cpu_only
def test_redirected_doctor_prints_the_machine_first_then_progress_lines_and_ctrl_c_is_one_line(tmp_path):
    """With its output in a file: versions and devices are there before the self-test starts, a progress line per
    case goes to stderr, and Ctrl-C ends it with one line and status 130 (no traceback)."""
    import signal

    out = tmp_path / "doctor.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with out.open("w") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "hf_optim.cli", "doctor", "--quick"], stdout=stdout,
                                   stderr=subprocess.PIPE, text=True, env=env,
                                   preexec_fn=sigint_as_in_a_terminal)
        try:
            first = process.stderr.readline()  # blocks until the first case starts (torch imported by then)
            assert first.startswith("doctor: ") and "(1/" in first, first
            assert "Versions" in out.read_text() and "Devices" in out.read_text()
            # at once: the whole eager self-test can take under a second (torch 2.14.1 finished it within the
            # second this test used to wait)
            process.send_signal(signal.SIGINT)
            rest = process.stderr.read()
            code = process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    lines = [line for line in rest.splitlines() if not line.startswith("doctor: ")]
    assert code == 130 and lines == ["hf-optim doctor: interrupted"], (
        f"exit status {code}; stderr after the first line:\n{rest[-3000:]}\nstdout's end:\n{out.read_text()[-2000:]}")
    assert all(line.startswith("doctor: ") and line.rstrip().endswith(")") for line in rest.splitlines()[:-1])
