"""Shared test helpers: the class list, small deterministic problems, and child processes that see Ctrl-C."""

import signal

import torch

import hf_optim

ALL_CLASSES = [
    obj for obj in (getattr(hf_optim, name) for name in hf_optim.__all__)
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not hf_optim.HfOptimizer
]
EIGHT_BIT = [cls for cls in ALL_CLASSES if "8bit" in cls.__name__]


def make_params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def set_grads(params, step, scale=1.0):
    gen = torch.Generator().manual_seed(10_000 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def run_steps(opt, params, steps, start=0):
    for step in range(start, start + steps):
        set_grads(params, step)
        opt.step()


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child that a test sends SIGINT: the default disposition, as a shell gives it.

    An ignored SIGINT is inherited through exec, and Python then never raises ``KeyboardInterrupt``. A pytest worker
    can run with it ignored (a library loaded by an earlier test in the same worker can set that), so a test that
    relied on the worker's disposition would test the worker, not the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class CudaScalar(torch.Tensor):
    """A rule's scalar that divides as torch does on CUDA: ``tensor / scalar`` is ``tensor * (1 / scalar)`` with the
    fp32 reciprocal (torch's CPU kernels divide; they differ by an ulp now and then). The Triton twins follow the
    CUDA semantics (``triton_rules``: ``inv_...`` fields), so the reference they are compared with bit for bit does
    too. Every other operation sees a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, CudaScalar) else a for a in args]
        divides = func in (torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide)
        if divides and isinstance(args[1], CudaScalar) and not isinstance(args[0], CudaScalar):
            return plain[0] * (torch.ones((), dtype=torch.float32) / plain[1])
        return func(*plain, **(kwargs or {}))
