"""The probes a CPU kernel is compiled on have the layout of every call the steps make to it, for every registered
algorithm x state format, through the phases of ``HF_OPTIM_COMPILE=auto``: eager while the background worker
compiles, then loading, then loaded.

A compiled kernel (a saved one above all) guards on its inputs' layout: shapes up to the block count, dtypes,
contiguity and strides. Its probe (:func:`cpu_kernel.probe_factory`) must therefore lay its tensors out as the
calls do, or the loaded kernel refuses the calls (a stacked slot, AdEMAMix's two EMAs, is contiguous where its flat
buffer is one chunk long and a slice of longer rows where it is longer: the probe once had only the second layout, and
a saved kernel raised on the first). Compiling every kernel with inductor would take minutes, so the compiler here is
a stand-in that compares each call's tensors with the probe made for the call's block count, then runs the eager
update; ``test_cpu_compile.py``'s slow test compiles and loads both layouts of AdEMAMix's kernel for real.

Groups: a small one (its flat state one chunk), a large one (many chunks, tensors updated in place and gathered), and
non-contiguous parameters, which step tensor by tensor (one chunk that is the whole tensor, and several).
"""

from __future__ import annotations

import pytest
import torch
from format_helpers import build

from hf_optim.kernels.torch_path import cpu_compile, cpu_kernel, elementwise
from hf_optim.optim import registry

SMALL = [(10, 5), (10,)]
"""512 flat elements with padding: one chunk."""
LARGE = [(64, 80), (300,), (9000,)]
"""Above the patched ``CHUNK`` (2048) and ``IN_PLACE_MIN`` (4096): chunks in place and gathered."""
ALONE = [(16, 32), (96, 70)]
"""Transposed, so not contiguous: stepped tensor by tensor, in one chunk (512 elements, the whole tensor) and in
several."""

CASES = [
    pytest.param(family, fmt, id=f"{family.algorithm.name}-{fmt.name}")
    for family in registry.families()
    for fmt in family.base._supported_formats()
]


def layout(tensor: torch.Tensor | None) -> tuple | None:
    """What a compiled kernel's guards see of a tensor besides the block count: dtype, shape, contiguity, where its
    view starts, and its strides (a non-contiguous tensor's first stride, the distance between stacked rows, only as
    'more than a row')."""
    if tensor is None:
        return None
    contiguous = tensor.is_contiguous()
    strides = tensor.stride() if contiguous else ("rows apart", *tensor.stride()[1:])
    if not contiguous:
        assert tensor.stride(0) > tensor[0].numel(), tensor.stride()
    return tensor.dtype, tuple(tensor.shape), contiguous, tensor.storage_offset(), tensor._base is None, strides


def call_layout(param, grad, out, tensors, stochastic) -> list:
    return [layout(t) for t in (param, grad, out, *tensors, *(stochastic or ()))]


class LayoutChecker:
    """Stands in for ``torch.compile`` of the kernels: each call's tensors must be laid out as the probe the kernel
    was compiled on, made for the call's block count (the dynamic dimension); then it runs the eager update."""

    def __init__(self):
        self.checked = self.probes = 0
        self.kernels: set[cpu_kernel.Kernel] = set()

    def twin(self, rule):
        def compiled(rule_, layouts, param, grad, out, tensors, hyper, stochastic=None):
            kernel = cpu_kernel.kernel_of(rule_, layouts, param, grad, out, tensors, stochastic)
            entry = cpu_compile._entries[kernel]
            probe_param, probe_grad, probe_out, probe_tensors, _, probe_stochastic = entry.probe(param.shape[0])
            expected = call_layout(probe_param, probe_grad, probe_out, probe_tensors, probe_stochastic)
            assert call_layout(param, grad, out, tensors, stochastic) == expected, kernel.describe()
            if param.shape[0] == cpu_kernel.PROBE_BLOCKS and not param.any():
                self.probes += 1  # the compilation itself, on the probe
            else:
                self.checked += 1
                self.kernels.add(kernel)
            elementwise.update(rule_, layouts, param, grad, out, tensors, hyper, stochastic)

        return compiled


class Worker:
    """Stands in for the background worker: the requests stay pending until :meth:`finish`."""

    def __init__(self):
        self.handles = []

    def __call__(self, kernel, hyper, key, threads):
        handle = Pending()
        self.handles.append(handle)
        return handle

    def finish(self):
        for handle in self.handles:
            handle.status = 0


class Pending:
    def __init__(self):
        self.status, self.started = None, 0.0

    def poll(self):
        return self.status

    def wait(self):
        self.status = 0 if self.status is None else self.status
        return self.status

    def error(self):
        return ""

    def close(self, kill=False):
        pass


def make_params(shapes, transposed=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        shape = tuple(reversed(shape)) if transposed else shape
        value = torch.randn(shape, generator=generator)
        params.append(torch.nn.Parameter(value.t() if transposed else value))
    return params


def run(cls, fmt, steps, after_step=lambda step: None):
    groups = [make_params(SMALL, seed=1), make_params(LARGE, seed=2), make_params(ALONE, transposed=True, seed=3)]
    opt = build(cls, [{"params": group} for group in groups], state_format=fmt.name, min_8bit_size=0)
    params = [p for group in groups for p in group]
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator).mul_(0.1)
        opt.step()
        after_step(step)
    return params


@pytest.mark.parametrize("family, fmt", CASES)
def test_every_call_has_its_kernels_probe_layout_through_eager_loading_and_loaded(family, fmt, small_cpu_kernels,
                                                                                   monkeypatch):
    cls = family.base
    with monkeypatch.context() as eager:
        eager.setenv("HF_OPTIM_COMPILE", "0")
        expected = run(cls, fmt, 4)
    checker, worker = LayoutChecker(), Worker()
    monkeypatch.setattr(cpu_compile, "_twin", checker.twin)
    monkeypatch.setattr(cpu_compile, "start_warmup", worker)
    monkeypatch.setenv("HF_OPTIM_COMPILE", "auto")

    def after_step(step):
        if step == 0:  # eager so far; the worker is done: the next step takes its kernels (loads or compiles them)
            assert checker.checked == 0
            worker.finish()

    params = run(cls, fmt, 4, after_step)
    assert all(torch.equal(a, b) for a, b in zip(expected, params))
    kernels = [kernel for kernel, entry in cpu_compile._entries.items() if entry.ready]
    # Adafactor's factored passes and a whole-tensor format (rank-1 4-bit) run eagerly: no kernel of their own
    assert bool(kernels) == (family.algorithm.name != "adafactor" and not fmt.whole_tensor)
    assert checker.probes == len(kernels) and checker.kernels == set(kernels)  # each compiled, and called
    stacked = any(rows > 1 for kernel in kernels for rows in kernel.rows)
    if stacked:  # both layouts of a stacked slot were met, each by a kernel of its own
        assert {any(kernel.spread) for kernel in kernels if max(kernel.rows) > 1} == {False, True}
