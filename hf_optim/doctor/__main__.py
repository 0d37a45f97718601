"""``python -m hf_optim.doctor``: the same as ``hf-optim doctor``."""

import sys

from hf_optim.doctor import main

sys.exit(main(prog="python -m hf_optim.doctor"))
