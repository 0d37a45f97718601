"""A Triton kernel that fails to compile or load falls back to the PyTorch path: once, with one warning, same math.

Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter (conftest sets ``TRITON_INTERPRET=1``);
the automatic backend is made to treat CPU tensors as Triton's (``backend.TRITON_DEVICE_TYPES``), so the fallback is
the automatic one a GPU user gets, not ``HF_OPTIM_BACKEND=triton`` (which turns the failure into an error). A failure
is injected by making one kernel's ``warmup`` (Triton's compile-and-load entry point) raise a ``triton``
CompilationError. The ``gpu``-marked cases run the same on CUDA tensors, with the real compiler.
"""

import ast
import copy
import logging

import pytest
import torch

import hf_optim
from hf_optim.kernels import backend
from hf_optim.kernels.torch_path import compile_guard, multi_tensor
from hf_optim.kernels.triton_path import guard as triton_guard
from hf_optim.optim.adafactor import triton_passes as triton_adafactor  # noqa: E402
from hf_optim.optim.lamb import triton_passes as triton_lamb  # noqa: E402
from hf_optim.optim.runner import Runner

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(ON_GPU, reason="GPU machine: the cuda cases run the kernels")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]

from triton.compiler.errors import CompilationError  # noqa: E402

from hf_optim.kernels.triton_path import elementwise as triton_elementwise  # noqa: E402

SHAPES = [(40, 70), (300,), (5000,), ()]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32]
ERROR = "PTX .version 9.9 does not support .target sm_75"


@pytest.fixture(autouse=True)
def _fresh_guards(fresh_guards):
    yield


@pytest.fixture
def automatic_triton(monkeypatch, device):
    """The automatic backend, with CPU tensors counted as Triton's (run in the interpreter)."""
    monkeypatch.delenv("HF_OPTIM_BACKEND", raising=False)
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(backend, "TRITON_DEVICE_TYPES", (*backend.TRITON_DEVICE_TYPES, "cpu"))


def compile_error() -> CompilationError:
    return CompilationError(None, ast.parse("x").body[0], f"{ERROR}\nptxas fatal: Ptx assembly aborted")


def fail_warmup(monkeypatch, module, name: str, armed=lambda: True) -> list:
    """Make ``module.name``'s warmup raise whenever ``armed()``; returns the list of its failed calls."""
    kernel = getattr(module, name)
    calls = []

    def warmup(*args, **kwargs):
        if armed():
            calls.append(name)
            raise compile_error()
        return kernel.__class__.warmup(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel, "warmup", warmup)
    return calls


def make_params(device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(device)) for s, dt in zip(SHAPES, DTYPES)]


def set_grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype).to(p.device)


def assert_identical(opt, params, ref_opt, ref_params):
    for p, ref_p in zip(params, ref_params):
        assert torch.equal(p, ref_p), f"{tuple(p.shape)} {p.dtype}: parameters differ"
        state, ref_state = opt.state[p], ref_opt.state[ref_p]
        assert state.keys() == ref_state.keys()
        for key, ref in ref_state.items():
            value = state[key]
            if isinstance(ref, torch.Tensor):
                assert value.dtype == ref.dtype and torch.equal(value, ref), f"{tuple(p.shape)}: {key} differs"
            else:
                assert value == ref


def fallback_warnings(records):
    return [r for r in records if r.levelno == logging.WARNING and "failed to compile or load" in r.getMessage()]


CASES = [
    pytest.param(hf_optim.AdamW8bit, {"lr": 1e-2, "weight_decay": 0.1}, triton_elementwise, "_fused_update_kernel",
                 "fused/adamw", id="AdamW8bit"),
    pytest.param(hf_optim.Lion4bit, {"lr": 1e-3}, triton_elementwise, "_fused_update_kernel", "fused/lion",
                 id="Lion4bit"),
    pytest.param(hf_optim.LAMB8bit, {"lr": 1e-2, "weight_decay": 0.01}, triton_lamb, "_ratio_kernel",
                 "passes/lamb", id="LAMB8bit-ratio-pass"),
    pytest.param(hf_optim.Adafactor, {"lr": 1e-2, "relative_step": False, "beta1": 0.9, "optim_bits": 8},
                 triton_adafactor, "_finalize_kernel", "passes/adafactor", id="Adafactor8bit-third-pass"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls,kwargs,module,kernel,label", CASES)
def test_failing_kernel_falls_back_once_with_pytorch_results(cls, kwargs, module, kernel, label, device, monkeypatch,
                                                              automatic_triton, hf_optim_records):
    """A kernel that fails from the first step: one warning over three steps, naming the kernel, the arch, the
    Triton version and the error's first line; parameters and state bit for bit those of the PyTorch path (LAMB's
    and Adafactor's failing later passes never let their first pass update the moments)."""
    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    ref_params = make_params(device)
    ref_opt = cls(ref_params, **kwargs)
    monkeypatch.delenv("HF_OPTIM_BACKEND")
    params = make_params(device)
    opt = cls(params, **kwargs)
    assert opt.backend == "triton"
    calls = fail_warmup(monkeypatch, module, kernel)
    for step in range(3):
        set_grads(ref_params, step)
        set_grads(params, step)
        ref_opt.step()
        opt.step()
    assert_identical(opt, params, ref_opt, ref_params)
    # one configuration per kernel group of the tensors (dtype, state formats: the kernels are specialized on them),
    # each tried once, never again, with one warning
    failures = triton_guard.failures()
    assert len(failures) > 1 and all(f.label.startswith(label + " ") for f in failures)
    assert calls == [kernel] * len(failures)
    warnings = fallback_warnings(hf_optim_records)
    assert len(warnings) == len(failures)
    message = warnings[0].getMessage()
    arch = "cpu-interpreter" if device == "cpu" else "sm_"
    assert failures[0].label in message and arch in message and f"Triton {triton.__version__}" in message
    assert f"CompilationError: {ERROR}" in message and "Ptx assembly aborted" not in message  # the first line only


@pytest.mark.parametrize("cls,kwargs,module,kernel", [
    pytest.param(hf_optim.AdamW8bit, {"lr": 1e-2}, triton_elementwise, "_fused_update_kernel", id="AdamW8bit"),
    pytest.param(hf_optim.LAMB8bit, {"lr": 1e-2}, triton_lamb, "_apply_kernel", id="LAMB8bit-apply-pass"),
    pytest.param(hf_optim.Adafactor, {"lr": 1e-2, "relative_step": False, "beta1": 0.9}, triton_adafactor,
                 "_apply_kernel", id="Adafactor-sixth-pass"),
])
@pytest.mark.parametrize("device", DEVICES)
def test_fallback_mid_run_keeps_the_state_the_triton_path_made(cls, kwargs, module, kernel, device, monkeypatch,
                                                                automatic_triton, hf_optim_records):
    """Two steps on Triton, then the kernel fails (a new specialization that does not compile): the failing step
    changes nothing before the fallback takes over (all passes compile before any launches), and the per-tensor
    state the Triton path made carries on, moved into flat buffers where the multi-tensor path applies: the
    result equals the same run whose fallback steps tensor by tensor, in place (the reference, independent of the
    flat buffers' adoption)."""
    runs, failed = {}, 0
    for reference in (False, True):
        triton_guard.reset()
        with monkeypatch.context() as patch:
            if reference:
                patch.setattr(Runner, "multi_tensor_eligible", lambda self, full, param: False)
            before = []
            fail_warmup(patch, module, kernel, armed=lambda before=before: len(before) > 2)  # from the third step
            params = make_params(device)
            opt = cls(params, **kwargs)
            entry_states = []
            update_fallback = opt._rules.main.update_fallback

            def spy(group, items, update_fallback=update_fallback, opt=opt, params=params, entry_states=entry_states):
                entry_states.append({id(p): copy.deepcopy(opt.state[p]) for p in params})
                update_fallback(group, items)

            patch.setattr(opt._rules.main, "update_fallback", spy)
            for step in range(4):
                before.append({id(p): copy.deepcopy(opt.state[p]) for p in params})
                set_grads(params, step)
                opt.step()
            runs[reference] = (opt, params)
            failed += len(triton_guard.failures())
        assert len(entry_states) == 2  # steps 3 and 4 fell back
        for p in params:  # at the fallback's entry in step 3: the state step 2 left, but the counted step
            expected = {**before[2][id(p)], "step": before[2][id(p)]["step"] + 1}
            for key, value in expected.items():
                got = entry_states[0][id(p)][key]
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
    (opt, params), (ref_opt, ref_params) = runs[False], runs[True]
    assert_identical(opt, params, ref_opt, ref_params)
    if cls is not hf_optim.Adafactor:  # its state is not in flat buffers (factored statistics)
        assert all(opt._store.locate(p, opt.state[p]) is not None for p in params)
    # once per failed configuration (one per kernel group of the tensors) and run (the guard was reset between them)
    assert failed >= 2 and len(fallback_warnings(hf_optim_records)) == failed


@pytest.mark.parametrize("device", DEVICES)
def test_forced_triton_backend_raises_naming_the_kernel(device, monkeypatch, hf_optim_records):
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    fail_warmup(monkeypatch, triton_lamb, "_ratio_kernel")
    params = make_params(device)
    opt = hf_optim.LAMB8bit(params, lr=1e-2)
    set_grads(params, 0)
    start = [p.detach().clone() for p in params]
    with pytest.raises(triton_guard.TritonKernelError, match=r"passes/lamb .*HF_OPTIM_BACKEND=triton forbids"):
        opt.step()
    assert all(torch.equal(p, s) for p, s in zip(params, start))  # no pass launched
    assert all(opt.state[p]["state1"].unique().numel() == 1 for p in params)  # still the initial zeros (or zero code)
    assert not fallback_warnings(hf_optim_records) and not triton_guard.failures()


class FakeCompiled:
    def __init__(self, log, name, fail_load):
        self.log, self.name, self.fail_load = log, name, fail_load

    def _init_handles(self):
        self.log.append(("load", self.name))
        if self.fail_load:
            raise RuntimeError("Triton Error [CUDA]: device kernel image is invalid\nmore")


class FakeKernel:
    """Stands for a JITFunction on a GPU: ``warmup`` compiles (reporting to Triton's compilation listener) and
    returns the compiled kernel; ``kernel[grid](...)`` launches."""

    def __init__(self, log, name, fail_load=False, cache_hit=False):
        self.log, self.name, self.fail_load, self.cache_hit = log, name, fail_load, cache_hit

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("compile", self.name))
        listener = triton.knobs.compilation.listener
        if listener is not None:
            listener(src=None, metadata={}, metadata_group={}, times=None, cache_hit=self.cache_hit)
        return FakeCompiled(self.log, self.name, self.fail_load)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(("launch", self.name))


def test_every_kernel_compiles_and_loads_before_any_launch(monkeypatch, hf_optim_records):
    """On a device (faked: the ``meta`` device, with fake kernels): the first preparation says what it compiles and
    where Triton caches it, once; every kernel is compiled and loaded before the first launch; a load failure of the
    last kernel launches nothing, warns once, and the configuration is not tried again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/hf-optim-test-triton-cache")
    monkeypatch.delenv("HF_OPTIM_BACKEND", raising=False)
    device = torch.device("meta")
    log = []
    kernels = [FakeKernel(log, "a", cache_hit=True), FakeKernel(log, "b"), FakeKernel(log, "c")]

    def work():
        for kernel in kernels:
            triton_guard.launch(kernel, (1,), "argument")

    config = triton_guard.KernelConfig(("three passes",), "passes/test")
    assert triton_guard.run(config, device, work) and triton_guard.run(config, device, work)
    first = [("compile", "a"), ("load", "a"), ("compile", "b"), ("load", "b"), ("compile", "c"), ("load", "c"),
             ("launch", "a"), ("launch", "b"), ("launch", "c")]
    assert log == first + first  # every step prepares (a new specialization compiles before anything launches)
    infos = [r.getMessage() for r in hf_optim_records if r.levelno == logging.INFO]
    assert infos == ["compiling or loading Triton kernel passes/test for meta once in this process; Triton caches it "
                     "in /tmp/hf-optim-test-triton-cache"]
    (record,) = triton_guard.compile_records()
    assert (record.label, record.kernels, record.cache_hits) == ("passes/test", 3, 1)

    log.clear()
    kernels[2].fail_load = True
    other = triton_guard.KernelConfig(("three passes", "variant"), "passes/test variant")
    assert not triton_guard.run(other, device, work)
    assert ("launch", "a") not in log and log[-1] == ("load", "c")
    assert not triton_guard.run(other, device, work)  # remembered: not even prepared again
    assert triton_guard.failed(other, device) and not triton_guard.failed(config, device)
    (warning,) = fallback_warnings(hf_optim_records)
    assert "passes/test variant" in warning.getMessage()
    assert "RuntimeError: Triton Error [CUDA]: device kernel image is invalid" in warning.getMessage()


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda"])
def test_failed_compile_of_the_multi_tensor_path_runs_it_eagerly(device, monkeypatch, hf_optim_records):
    """torch.compile failing on a GPU (a Triton that inductor cannot use): one warning, the device runs the
    multi-tensor update eagerly, the same bits as the eager path. (On the CPU a kernel compiles through
    hf_optim.kernels.torch_path.cpu_compile, whose failure runs that kernel eagerly after one warning:
    tests/kernels/test_cpu_compile.py.)"""
    from torch._dynamo.exc import BackendCompilerFailed

    monkeypatch.setenv("HF_OPTIM_BACKEND", "torch")
    monkeypatch.setenv(multi_tensor.COMPILE_ENV, "0")
    ref_params = make_params(device)
    ref_opt = hf_optim.AdamW8bit(ref_params, lr=1e-2)
    monkeypatch.setenv(multi_tensor.COMPILE_ENV, "1")
    params = make_params(device)
    opt = hf_optim.AdamW8bit(params, lr=1e-2)
    assert opt.backend == "torch-compile"
    attempts = []

    def broken(*args):
        attempts.append(args)
        raise BackendCompilerFailed("inductor", RuntimeError("InvalidCxxCompiler: No working C++ compiler found"), None)

    monkeypatch.setattr(multi_tensor, "compiled_update", lambda *args: broken)
    for step in range(3):
        set_grads(ref_params, step)
        set_grads(params, step)
        monkeypatch.setenv(multi_tensor.COMPILE_ENV, "0")
        ref_opt.step()
        monkeypatch.setenv(multi_tensor.COMPILE_ENV, "1")
        opt.step()
    assert_identical(opt, params, ref_opt, ref_params)
    assert len(attempts) == 1 and opt.backend == "torch"
    (warning,) = [r for r in hf_optim_records if r.levelno == logging.WARNING]
    assert f"torch.compile failed to compile the optimizer update on {params[0].device}" in warning.getMessage()
    assert list(compile_guard.failures()) == [str(params[0].device)]
