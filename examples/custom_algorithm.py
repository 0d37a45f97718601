"""Adding an algorithm to hf_optim from outside the package: Signum, sign-SGD with momentum (Bernstein et al. 2018,
arXiv 1802.04434), with decoupled weight decay.

One PyTorch rule, its (optional) Triton twin, one registration call: hf_optim derives ``Signum32bit``,
``Signum8bit``, ``PagedSignum``, ``PagedSignum8bit``, ``PagedSignum32bit``, and the Trainer accepts
``optim="signum"``, ``"signum_8bit"``, ``"paged_signum_8bit"``, ... (docs/guide/extending.md, "Adding an
algorithm", shows this file; ``tests/algorithms/test_custom_algorithm.py`` runs it).

    python examples/custom_algorithm.py
"""

from typing import NamedTuple

import torch

import hf_optim


class SignumHyper(NamedTuple):
    """The scalars one step reads, computed on the host; the field order is the Triton kernel's argument order."""

    decay: float  # 1 - lr * weight_decay
    lr: float
    beta: float
    one_minus_beta: float  # in double precision on the host: 1 - beta in fp32 would lose digits


def signum_hyper(group: dict, step: int) -> SignumHyper:
    return SignumHyper(decay=1.0 - group["lr"] * group["weight_decay"], lr=group["lr"], beta=group["beta"],
                       one_minus_beta=1.0 - group["beta"])


def signum_rule(param, grad, states, h: SignumHyper):
    """fp32 tensors in, fp32 tensors out: hf_optim dequantizes and requantizes 8-bit state around it."""
    (momentum,) = states
    momentum = h.beta * momentum + h.one_minus_beta * grad
    param = param * h.decay - h.lr * torch.sign(momentum)
    return param, [momentum]


try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the PyTorch rule runs everywhere
    signum_triton = None
else:

    @triton.jit
    def signum_triton(p, g, m, unused1, unused2, h):
        """The twin of signum_rule, the same fp32 operations in the same order (rows 2 and 3 are unused)."""
        m = h.beta * m + h.one_minus_beta * g
        direction = tl.where(m > 0, 1.0, tl.where(m < 0, -1.0, 0.0))
        p = p * h.decay - h.lr * direction
        return p, m, unused1, unused2


SIGNUM = hf_optim.Algorithm(
    name="signum",
    class_name="Signum",
    slots=(hf_optim.StateSpec("state1", signed=True),),  # one signed state: 8-bit with the signed map
    hyper=SignumHyper,
    hyper_at=signum_hyper,
    rule=signum_rule,
    triton_rule=signum_triton,
)
signum = hf_optim.register_algorithm(SIGNUM, defaults={"lr": 1e-4, "beta": 0.9, "weight_decay": 0.0})
Signum, Signum8bit, PagedSignum8bit = signum["Signum"], signum["Signum8bit"], signum["PagedSignum8bit"]


if __name__ == "__main__":
    model = torch.nn.Linear(128, 64)
    optimizer = Signum8bit(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 128)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(optimizer.state[model.weight]["state1"].dtype, [e.name for e in hf_optim.available_optimizers()][-5:])
