"""The shared Triton machinery: one launch steps a whole param group. :mod:`step` plans a group's launches,
:mod:`elementwise` is the fused elementwise kernel that runs an algorithm's Triton rule (written as
:mod:`exact_math` says, and kept beside its PyTorch rule in ``hf_optim/optim/<algorithm>/triton_rule.py``), and
:mod:`configs` enumerates every kernel configuration for ahead-of-time compilation (a multi-pass algorithm's own
passes, ``hf_optim/optim/<algorithm>/triton_passes.py``, through its ``TritonPlan.specs``). The per-format state I/O
(:mod:`quant8`, :mod:`quant4`, :mod:`fp8`, :mod:`encode8`) twins ``hf_optim.formats``; :mod:`rounding` twins
``hf_optim.numerics.rounding``; :mod:`tile` is the tile every kernel works on, :mod:`multi_tensor` the launch tables,
:mod:`guard` the compile-before-launch fallback. Every module but :mod:`guard` imports ``triton`` at module level, so
nothing outside this folder imports them before a Triton step runs. Modules here may import the rest of
``hf_optim.kernels``; never a higher layer.
"""
