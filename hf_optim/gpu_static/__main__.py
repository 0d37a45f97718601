"""``python -m hf_optim.gpu_static``: the ahead-of-time compile table (also ``python benchmarks/gpu/gpu_static.py``)."""

import sys

from hf_optim.gpu_static.cli import main

sys.exit(main(prog="python -m hf_optim.gpu_static"))
