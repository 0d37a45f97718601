"""The two compute paths and the choice between them.

``torch_path/`` is the PyTorch path, eager and compiled by inductor, and the reference; ``triton_path/`` holds the
Triton kernels, imported only when a Triton step runs; :mod:`backend` is the one visible function that picks a path
for a tensor. Each algorithm's own rule and Triton twin live in ``hf_optim/optim/<algorithm>/``, the state formats
in ``hf_optim/formats/``, the descriptions in ``hf_optim/core/``. Nothing here imports ``hf_optim.optim`` or any
other higher layer (``tests/architecture/test_import_layers.py``).
"""
