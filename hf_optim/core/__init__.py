"""What an optimizer is, independent of how it runs: an algorithm as one registered description
(:mod:`algorithm`: slots, elementwise rule, scalars, Triton twin), the data a non-elementwise algorithm gives
(:mod:`own_update`), a hybrid's partition of parameters into labelled rules (:mod:`partition`), and an optimizer
state's slots with their bitsandbytes layout (:mod:`state_store`). Below the compute paths (``hf_optim.kernels``),
above the state formats (``hf_optim.formats``).
"""
