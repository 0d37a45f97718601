"""The PyTorch path, the reference of every other: the elementwise update over any state format
(:mod:`elementwise`), the multi-tensor step over flat state buffers (:mod:`multi_tensor`, :mod:`flat_state`), its
CPU compilation by inductor (:mod:`cpu_compile` and its background :mod:`cpu_compile_worker`, :mod:`cpu_threads`)
and the eager fallback when compiling fails (:mod:`compile_guard`), bf16 stochastic rounding (:mod:`rounding`) and
the correctly rounded operations the rules use (:mod:`exact_math`). It may import ``hf_optim.formats``,
the top-level kernels modules and torch; never ``triton``, ``hf_optim.kernels.triton_path`` (not even lazily:
machines without Triton run this path) or a higher layer.
"""
