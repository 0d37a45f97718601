"""hf_optim: memory-efficient optimizers for Hugging Face training, compatible with bitsandbytes' state format.

Every class is a ``torch.optim.Optimizer`` with the constructor arguments of its ``bitsandbytes.optim``
namesake, so switching is a one-line import change. New algorithms are added with :func:`register_algorithm`
(docs/guide/extending.md, "Adding an algorithm").
"""

from hf_optim import _startup

__version__ = "0.1.0"

if _startup.deferred():  # the hf-optim command: --help and typos are answered before torch is imported
    def __getattr__(name: str):
        # `from hf_optim import run` imports the module; dunder lookups (copy, pickle, help) find nothing
        if not (name.startswith("__") or _startup.is_submodule(name)):
            _startup.finish()
            if name in globals():
                return globals()[name]
        raise AttributeError(f"module 'hf_optim' has no attribute {name!r}")
else:
    from hf_optim._exports import *  # noqa: F403
    from hf_optim._exports import __all__  # noqa: F401
