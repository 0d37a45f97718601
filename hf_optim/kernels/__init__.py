"""The lowest layer: what one optimizer step computes and how its state is stored, for every backend.

At the top, what the rest of hf_optim reads: :mod:`~hf_optim.kernels.algorithm` (an algorithm as one registered
description), :mod:`~hf_optim.kernels.state_store` (an optimizer state's slots and their bitsandbytes layout) and
:mod:`~hf_optim.kernels.backend` (which path steps a tensor). Below them, by kind: ``formats/`` (each state format
as one object, and the PyTorch math of its codes), ``torch_path/`` (the PyTorch path, eager and compiled: the
reference) and ``triton_path/`` (the shared Triton machinery, imported only when a Triton step runs). Each
algorithm's own rule and Triton twin live in ``hf_optim/optim/<algorithm>/``. Nothing here imports
``hf_optim.optim``, ``hf_optim.integrations`` or any other higher layer (``tests/architecture/test_import_layers.py``).
"""
