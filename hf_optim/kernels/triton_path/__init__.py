"""The shared Triton machinery: one launch steps a whole param group. :mod:`step` plans a group's launches,
:mod:`elementwise` is the fused elementwise kernel that runs an algorithm's Triton rule (written as
:mod:`exact_math` says, and kept beside its PyTorch rule in ``hf_optim/optim/<algorithm>/triton_rule.py``), and
:mod:`configs` enumerates every kernel configuration for ahead-of-time compilation (a multi-pass algorithm's own
passes, ``hf_optim/optim/<algorithm>/triton_passes.py``, through its ``TritonPlan.specs``). Each state format's
Triton branch (its row I/O and tuning, twins of ``hf_optim.formats``) is one :class:`rows.TritonRows` its format names
(:mod:`rows` declares fp32's and the lookup; :mod:`quant8` with :mod:`encode8`, :mod:`quant4` and :mod:`fp8` the
others'); :mod:`rounding` twins ``hf_optim.numerics.rounding``; :mod:`tile` is the tile every kernel works on,
:mod:`multi_tensor` the launch tables, :mod:`guard` the compile-before-launch fallback. Every module but :mod:`guard`
imports ``triton`` at module level, so nothing outside this folder imports them before a Triton step runs. Modules
here may import the rest of ``hf_optim.kernels``; never a higher layer.
"""
