"""The ahead-of-time compile table under its former command: ``python -m hf_optim.gpu_static`` (same arguments, same
output; the tool and its documentation are the package :mod:`hf_optim.gpu_static`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: a checkout named there is the one measured

from hf_optim.gpu_static.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
