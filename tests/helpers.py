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


INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between same-dtype tensors in units in the last place (same-sign finite values)."""
    return int((a.detach().view(INT_VIEW[a.dtype]).long() - b.detach().view(INT_VIEW[a.dtype]).long()).abs().max())


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at magnitude ``x`` (fp32 tensor of magnitudes)."""
    _, exponent = torch.frexp(x)
    return torch.finfo(dtype).eps * torch.exp2(exponent.float() - 1)


def assert_params_close(a: torch.Tensor, b: torch.Tensor, where: str, steps: int) -> None:
    """Within 1 ulp per step of the parameter's magnitude, floored at the tensor's mean magnitude.

    Near zero a 1-ulp difference in the update term is many ulps of a tiny parameter, hence the floor. Per step,
    because torch's CPU ``sqrt`` is not correctly rounded on AVX-512 hosts (measured: ~20% of fp32 results one
    ulp off), while the kernels' ``sqrt_rn`` is, as torch's CUDA ``sqrt`` is."""
    dtype = a.dtype
    a, b = a.detach().float(), b.detach().float()
    scale = torch.maximum(torch.maximum(a.abs(), b.abs()), a.abs().mean())
    worst = ((a - b).abs() / ulp(scale, dtype)).max().item()
    assert worst <= steps, f"{where}: parameters {worst:.2f} ulp apart after {steps} steps"


def assert_bit_identical(ref_opt, ref_params, opt, params, exact_params=True):
    for ref_p, p in zip(ref_params, params):
        where = f"{tuple(p.shape)} {p.dtype}"
        if exact_params:
            assert torch.equal(p.view(INT_VIEW[p.dtype]), ref_p.view(INT_VIEW[p.dtype])), f"{where}: parameter"
        else:
            assert_params_close(p, ref_p, where, steps=2)
        ref_state, state = ref_opt.state[ref_p], opt.state[p]
        assert ref_state.keys() == state.keys()
        for key, ref in ref_state.items():
            value = state[key]
            if isinstance(ref, torch.Tensor):
                assert value.dtype == ref.dtype and value.shape == ref.shape, f"{where}: {key}"
                assert torch.equal(value.contiguous().view(-1).view(torch.uint8),
                                   ref.contiguous().view(-1).view(torch.uint8)), f"{where}: {key} differs"
            else:
                assert value == ref
