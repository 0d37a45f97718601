"""A Triton kernel that fails to compile or load on a user's GPU falls back to the PyTorch path, once, with a warning.

An optimizer step launches one or more Triton kernels per *kernel configuration* (:class:`KernelConfig`: a hashable
key naming the kernels' compile-time choices, and a label for messages). The step's code for one configuration runs
inside :func:`run`, and launches every kernel through :func:`launch`. :func:`run` then

1. records the launches instead of launching them (the step's code must not read results of its own launches on
   the host: nothing in hf_optim's Triton plans does, so a step never waits for the GPU; and a buffer a kernel
   reaches only through an address table must be passed to :func:`keep_alive`);
2. compiles and loads every recorded kernel with its real arguments (Triton's ``JITFunction.warmup``, which compiles
   only on a miss of Triton's in-memory cache, then the compiled kernel's binary load on the device), so a compile
   or load failure happens before anything is launched: no optimizer state is ever half updated (LAMB's direction
   pass updates the moments before its ratio and apply passes run; Adafactor has six passes);
3. launches them in order.

On an error in step 2 (or in the very first launch of a configuration on a device, before any kernel of it ran),
unless ``HF_OPTIM_BACKEND=triton`` forbids it (then :class:`TritonKernelError` names the kernel), :func:`run` logs
ONE warning for that (configuration, device) naming the kernel, the device's arch, the Triton version and the
error's first line, remembers the failure and returns False; the caller runs the same tensors on the PyTorch path
(the same math), and :func:`failed` keeps sending that configuration there for the rest of the process.

Use (``step.GroupStep.run`` does this per batch of tensors; the kernels launch through :func:`launch`)::

    config = triton_guard.KernelConfig(("fused", "adamw", torch.bfloat16, "blockwise8"), "fused/adamw bf16 8-bit")
    if triton_guard.failed(config, device) or not triton_guard.run(config, device, lambda: my_passes(...)):
        ...  # these tensors take the PyTorch path

Messages go to the ``hf_optim`` logger, not to ``warnings``: importing hf_optim gives that logger a console handler
(``hf_optim.integrations.transformers``), so Trainer and ``hf-optim train`` users see them once, above the progress
bar; a ``-W error`` warnings filter cannot turn a working fallback into a crash; and the compile notice (INFO) and the
fallback warning share one channel.

The first time a configuration is prepared on a device in a process, one INFO line says what is compiled and where
Triton caches it (``TRITON_CACHE_DIR``, or Triton's default ``~/.triton/cache``): "compiling or loading", because
whether Triton's on-disk cache holds it is only known once the compile returns (:func:`compile_records` has the
answer, from Triton's compilation listener, with the seconds it took).

Cost per guarded step: one extra argument binding and cache lookup per launch (the warmup), about 7 us of host
time per launch with Triton 3.9's binder on a 2-core CPU (``benchmarks/performance/guard_overhead.py``); no device
work and no synchronization.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import torch

from hf_optim.kernels import backend

logger = logging.getLogger("hf_optim")


@dataclass(frozen=True)
class KernelConfig:
    """One configuration of kernels: ``key`` (hashable: the kernels' compile-time choices) and ``label`` (for
    messages, e.g. ``"fused/adamw"``). Configurations with equal keys share one failure record."""

    key: Hashable
    label: str


@dataclass(frozen=True)
class Failure:
    """A configuration that failed to compile or load on a device, and now runs on the PyTorch path."""

    label: str
    device: str
    arch: str
    triton_version: str
    error: str
    """The error's type and first line."""


@dataclass
class CompileRecord:
    """The first preparation of a configuration on a device in this process."""

    label: str
    device: str
    arch: str
    seconds: float
    kernels: int = 0
    """How many kernels Triton compiled or loaded from its on-disk cache (0: all were already in memory)."""
    cache_hits: int = 0
    """How many of them came from the on-disk cache."""


class TritonKernelError(RuntimeError):
    """A Triton kernel failed to compile or load while ``HF_OPTIM_BACKEND=triton`` forbids the fallback."""


@dataclass
class _Launch:
    kernel: object
    grid: object
    args: tuple
    kwargs: dict


@dataclass
class _Recorder:
    launches: list[_Launch] = field(default_factory=list)
    kept: list = field(default_factory=list)


_recording: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("hf_optim_triton_recording",
                                                                              default=None)
_failures: dict[tuple, Failure] = {}
_prepared: set[tuple] = set()
_records: list[CompileRecord] = []
_fallback_runs = [0]  # guarded runs sent to the PyTorch path (hf-optim doctor tells a case that fell back)


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or, inside :func:`run`, record it to be compiled first and launched after.

    Every launch of a guarded configuration goes through here (outside :func:`run`, e.g. in a test of one kernel,
    it launches at once).
    """
    recorder = _recording.get()
    if recorder is None:
        kernel[grid](*args, **kwargs)
    else:
        recorder.launches.append(_Launch(kernel, grid, args, kwargs))


def keep_alive(*tensors) -> None:
    """Inside :func:`run`: keep ``tensors`` alive until the recorded launches went out. Needed for a buffer a kernel
    reaches only through an address table (LAMB's direction scratch), which Python would otherwise free when the
    step's code returns, before the launch. Outside :func:`run` it does nothing (the launch already went out)."""
    recorder = _recording.get()
    if recorder is not None:
        recorder.kept.extend(tensors)


def failed(config: KernelConfig, device: torch.device) -> bool:
    """Whether ``config`` failed on ``device`` earlier in this process (its tensors take the PyTorch path)."""
    if (config.key, _device_key(device)) in _failures:
        _fallback_runs[0] += 1
        return True
    return False


def run(config: KernelConfig, device: torch.device, work: Callable[[], None]) -> bool:
    """Run ``work`` (which launches ``config``'s kernels through :func:`launch`) compile-first; True when it ran.

    False: ``config`` failed to compile or load on ``device`` (now, with one warning, or before); nothing was
    launched and the caller runs the same tensors on the PyTorch path. Raises :class:`TritonKernelError` instead
    when ``HF_OPTIM_BACKEND=triton``. Errors raised by ``work`` itself (building tables, allocating scratch) and by
    launches after the first one propagate unchanged.

    Args:
        config: the kernels' configuration.
        device: the device the tensors are on (current during ``work``: the caller makes it so).
        work: the step's code for ``config``, with no arguments.
    """
    key = (config.key, _device_key(device))
    if key in _failures:
        _fallback_runs[0] += 1
        return False
    recorder = _Recorder()
    token = _recording.set(recorder)
    try:
        work()
    finally:
        _recording.reset(token)
    if not recorder.launches:  # nothing to update (empty tensors): nothing to compile either
        return True
    first = key not in _prepared
    try:
        if first:
            _prepare_first(config, device, recorder.launches)
        else:
            _prepare(recorder.launches)
    except Exception as error:  # noqa: BLE001 - any compile/load failure: Triton raises many types
        _fail(config, device, error)
        return False
    _prepared.add(key)
    for index, item in enumerate(recorder.launches):
        if first and index == 0:
            try:  # a lazily built launcher or loaded binary fails here; nothing of this configuration ran yet
                item.kernel[item.grid](*item.args, **item.kwargs)
            except Exception as error:  # noqa: BLE001
                _prepared.discard(key)
                _fail(config, device, error)
                return False
        else:
            item.kernel[item.grid](*item.args, **item.kwargs)
    return True


def _prepare(launches: list[_Launch]) -> None:
    """Compile (on a miss of Triton's cache) and load every kernel of ``launches`` with its real arguments."""
    for item in launches:
        compiled = item.kernel.warmup(*item.args, grid=item.grid, **item.kwargs)
        load = getattr(compiled, "_init_handles", None)  # None in the interpreter (no binary)
        if load is not None:
            load()


def _prepare_first(config: KernelConfig, device: torch.device, launches: list[_Launch]) -> None:
    """:func:`_prepare`, announced by one log line and timed, with Triton's compilation listener counting on-disk
    cache hits (the listener the user set, if any, still hears every compile)."""
    arch = device_arch(device)
    interpreted = device.type == "cpu"
    if not interpreted:
        logger.info("compiling or loading Triton kernel %s for %s once in this process; Triton caches it in %s",
                    config.label, arch, cache_dir())
    record = CompileRecord(config.label, str(device), arch, 0.0)
    start = time.perf_counter()
    with _listening(record):
        _prepare(launches)
    record.seconds = time.perf_counter() - start
    _records.append(record)


@contextlib.contextmanager
def _listening(record: CompileRecord) -> Iterator[None]:
    knobs = _knobs()
    if knobs is None:
        yield
        return
    previous = knobs.compilation.listener

    def listener(*args, **kwargs):
        record.kernels += 1
        record.cache_hits += bool(kwargs.get("cache_hit"))
        if previous is not None:
            previous(*args, **kwargs)

    knobs.compilation.listener = listener
    try:
        yield
    finally:
        knobs.compilation.listener = previous


def _fail(config: KernelConfig, device: torch.device, error: Exception) -> None:
    failure = Failure(config.label, str(device), device_arch(device), triton_version(), first_line(error))
    message = (f"Triton kernel {failure.label} failed to compile or load on {failure.device} ({failure.arch}, "
               f"Triton {failure.triton_version}): {failure.error}")
    if backend.forced_backend() == "triton":
        raise TritonKernelError(f"{message}. {backend.ENV_VAR}=triton forbids the PyTorch fallback: unset it (or set "
                                f"{backend.ENV_VAR}=torch) to run these tensors on the PyTorch path") from error
    _failures[(config.key, _device_key(device))] = failure
    _fallback_runs[0] += 1
    logger.warning("%s. Its tensors run on the PyTorch path from now on (the same math, slower); `hf-optim doctor` "
                   "checks this GPU", message)


def first_line(error: BaseException) -> str:
    """``Type: first non-empty line of the message`` (of a Triton ``CompilationError``, the line of its own
    message, not the ``at 12:4:`` location that starts its text, followed by the kernel's source)."""
    detail = getattr(error, "error_message", None)
    text = detail if isinstance(detail, str) and detail.strip() else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def failures() -> list[Failure]:
    """Every configuration that fell back to the PyTorch path in this process."""
    return list(_failures.values())


def fallback_runs() -> int:
    """How many times in this process a configuration's tensors were sent to the PyTorch path (each step of each
    failed configuration counts)."""
    return _fallback_runs[0]


def compile_records() -> list[CompileRecord]:
    """Every configuration prepared for the first time on a device in this process, in order."""
    return list(_records)


def reset() -> None:
    """Forget failures and preparations (tests; a process normally keeps them for its whole life)."""
    _failures.clear()
    _prepared.clear()
    _records.clear()
    _fallback_runs[0] = 0


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def device_arch(device: torch.device) -> str:
    """``sm_XY`` on NVIDIA GPUs, the gfx name on ROCm, the device name on XPU, ``cpu-interpreter`` on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip:
            name = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or "rocm"
            return name.split(":")[0]
        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major}{minor}"
    if device.type == "xpu":
        return torch.xpu.get_device_name(device)
    return "cpu-interpreter" if device.type == "cpu" else device.type


def triton_version() -> str:
    """The installed Triton's version ("not installed" without it); imports triton."""
    if not backend.triton_available():
        return "not installed"
    import triton

    return triton.__version__


def _knobs():
    try:
        from triton import knobs
    except ImportError:  # Triton < 3.4: no knobs, no listener
        return None
    return knobs


def cache_dir() -> str:
    """Where Triton caches compiled kernels: ``TRITON_CACHE_DIR``, or Triton's default (``~/.triton/cache``)."""
    knobs = _knobs() if backend.triton_available() else None
    if knobs is not None:
        return str(knobs.cache.dir)
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
