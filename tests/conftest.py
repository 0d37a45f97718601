"""Test setup: offline, deterministic, eager kernels unless a test opts into the compiled path."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The compiled CPU path is exercised by tests that ask for it (test_compiled_path.py); everything else runs the
# eager PyTorch reference, which starts instantly.
os.environ.setdefault("HF_OPTIM_COMPILE", "0")
# The suite runs processes beside each other (the background compiler, torchrun ranks, notebook kernels, the AOT
# compile table's jobs): OpenMP threads that spin while they wait would take the others' cores. Only how idle
# threads wait changes, not what they compute. Set before torch (and its OpenMP runtime) is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging  # noqa: E402
import platform  # noqa: E402
from importlib import metadata  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run in Triton's CPU interpreter (test_triton_kernels.py). Triton reads this when
# triton.language and each kernel are defined, so it must be set before anything imports triton (bitsandbytes
# and transformers do). It changes nothing else: only hf_optim's Triton backend runs Triton kernels on CPU, and
# only when a test forces it with HF_OPTIM_BACKEND=triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def machine_line() -> str:
    """The CPU, the ISA torch's CPU kernels use, torch, Triton and CUDA: results can depend on them (torch's CPU
    kernels round differently with and without FMA), so a failure report names them."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "not installed"
    cuda = f"yes ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "no"
    return (f"machine: {cpu}, {os.cpu_count()} CPUs | torch CPU capability {capability} "
            f"({f'ATEN_CPU_CAPABILITY={forced}' if forced else 'ATEN_CPU_CAPABILITY unset'}) | "
            f"torch {torch.__version__} | Triton {triton_version} | CUDA: {cuda}")


def pytest_report_header(config):
    return machine_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """-q hides the session header: then the line ends the run instead."""
    if config.get_verbosity() < 0:
        terminalreporter.write_line(machine_line())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


SLOWEST_MODULES = ("test_gpu_static", "test_triton_kernels", "test_trl_integration", "test_notebooks",
                   "test_triton_plans", "test_cli", "test_distributed", "test_deepspeed", "test_torch_contract")
"""Modules that take a minute or more on a 2-core CPU (pytest's --durations), run first so that, split across
workers, the last one to start does not end the run alone; the others keep their file order."""
MAX_WORKERS = 4
"""Each worker imports torch, transformers and TRL (about 1 GiB) and some tests start processes of their own."""


def pytest_xdist_auto_num_workers(config):
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def _module_rank(item) -> int:
    name = item.path.stem
    return SLOWEST_MODULES.index(name) if name in SLOWEST_MODULES else len(SLOWEST_MODULES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: within a module, and among the rest, the file order stays
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fresh_guards():
    """Forget the Triton and torch.compile fallbacks before and after a test (they last for the process)."""
    from hf_optim.kernels.torch_path import compile_guard
    from hf_optim.kernels.triton_path import guard as triton_guard

    triton_guard.reset()
    compile_guard.reset()
    yield
    triton_guard.reset()
    compile_guard.reset()


@pytest.fixture
def hf_optim_records():
    """Every record of the ``hf_optim`` logger, INFO included. caplog cannot be used: once an optimizer was created
    the logger has its own console handler and does not propagate to the root logger, where caplog listens, so what
    caplog sees would depend on which test ran first."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("hf_optim")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def use_triton(monkeypatch):
    """Force the Triton backend (in the interpreter on CPU)."""
    monkeypatch.setenv("HF_OPTIM_BACKEND", "triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def cuda_scalars(monkeypatch):
    """The PyTorch path's rules get :class:`CudaScalar` scalars."""
    from helpers import CudaScalar

    from hf_optim.kernels.torch_path import elementwise

    original = elementwise.scalar_tensors
    monkeypatch.setattr(elementwise, "scalar_tensors",
                        lambda hyper: type(hyper)(*(v.as_subclass(CudaScalar) for v in original(hyper))))


@pytest.fixture
def launched(monkeypatch):
    """The fused configurations launched (``triton_elementwise.launch`` records them)."""
    from hf_optim.kernels.triton_path import elementwise as triton_elementwise
    from hf_optim.kernels.triton_path import step as triton_step
    from hf_optim.optim.lamb import triton_passes as triton_lamb

    configs = []
    original = triton_elementwise.launch

    def recording(config, *args, **kwargs):
        configs.append(config)
        return original(config, *args, **kwargs)

    monkeypatch.setattr(triton_elementwise, "launch", recording)
    for module in (triton_step, triton_lamb):
        monkeypatch.setattr(module, "launch_fused", recording)
    return configs


@pytest.fixture
def small_cpu_kernels(monkeypatch, tmp_path):
    """The CPU kernels' policy on small tensors: an inductor cache of the test's own, chunks of 2048 elements
    (tensors from 4096 in place), no one-thread variant however busy the machine, and no kernel left from another
    test."""
    from hf_optim.kernels.torch_path import cpu_compile, cpu_threads, multi_tensor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "adjustable", lambda: False)
    monkeypatch.setattr(multi_tensor, "CHUNK", 2048)
    monkeypatch.setattr(multi_tensor, "IN_PLACE_MIN", 4096)
    cpu_compile.forget()
    yield
    cpu_compile.forget()
