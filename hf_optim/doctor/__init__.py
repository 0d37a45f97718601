"""``hf-optim doctor`` (also ``python -m hf_optim.doctor``): what this machine runs, and a self-test of it.

Reports versions (torch, CUDA runtime and driver, Triton, transformers, TRL, bitsandbytes, hf_optim), each device
with its arch and the backend it gets (``triton``, ``torch-compile``, ``torch``), whether paged optimizers' CUDA
managed memory works, and where inductor and Triton cache compiled kernels; then self-tests the backend against
the eager PyTorch reference for every algorithm x state format x parameter dtype on small odd-sized tensors
(:mod:`hf_optim.doctor.selftest`), and times one step per algorithm on a 4096 x 4096 tensor beside torch's fused
AdamW (skipped with ``--quick``). On the CPU the self-test runs eagerly and nothing is timed unless ``--compiled``
asks for the compiled kernels (compiling them all takes minutes on a cold cache; an eager step is the reference, not
what training runs, so its time would mislead): the doctor answers within a minute on a 2-core CPU. Versions and
devices print first; without a terminal, one progress line per case goes to stderr. Exit status: 0 when every case
matches on the backend the device gets; 1 on a mismatch, an error, or a kernel that failed to compile and fell back
to the PyTorch path; 2 on a bad command line; 130 on Ctrl-C (one line).

This module imports only the standard library: the checks (torch, triton) are imported after the command line is
read, so ``--interpret`` can set ``TRITON_INTERPRET`` before anything imports triton (when something already has,
the doctor runs itself again in a fresh interpreter with the variable set).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

DESCRIPTION = (
    "Versions, devices and the backend each gets, paged optimizers' managed memory, the caches of compiled kernels; "
    "then a self-test of that backend against the eager PyTorch reference (every algorithm x state format x "
    "parameter dtype, a few steps on small tensors) and one timed step per algorithm on a 4096 x 4096 tensor beside "
    "torch's fused AdamW. On the CPU the self-test runs eagerly and the timed steps need --compiled. Exit "
    "status 1 on a mismatch, an error, or a kernel that fell back to the PyTorch path; 130 on Ctrl-C."
)


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line on stderr (exit 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser(prog: str = "hf-optim doctor") -> argparse.ArgumentParser:
    result = _Parser(prog=prog, description=DESCRIPTION)
    result.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    result.add_argument("--quick", action="store_true", help="skip the timed steps")
    result.add_argument("--compiled", action="store_true",
                        help="on the CPU, self-test and time the torch-compile kernels a run uses (compiles each "
                             "algorithm x state format x dtype first: minutes on a cold cache); default: the "
                             "self-test runs eagerly and nothing is timed")
    result.add_argument("--interpret", action="store_true",
                        help="on the CPU, self-test the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1) "
                             "instead of the torch-compile path: slow, but checks the kernels' math without a GPU")
    result.add_argument("--device", default=None,
                        help="the device to self-test (default: cuda when available, else cpu; e.g. cuda:1)")
    result.add_argument("--algorithms", default=None, metavar="NAME[,NAME...]",
                        help="self-test only these algorithms (default: every registered one: hf-optim optimizers)")
    return result


def main(argv: list[str] | None = None, prog: str = "hf-optim doctor") -> int:
    """Run the doctor with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser(prog).parse_args(argv)
    except SystemExit as exit:  # --help, or a bad command line (its one line is printed): a status, not an exit
        return exit.code if isinstance(exit.code, int) else 2
    try:
        if args.interpret and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if "triton" in sys.modules:  # its kernels were defined compiled: only a fresh interpreter can interpret
                env = {**os.environ, "TRITON_INTERPRET": "1"}
                return subprocess.call([sys.executable, "-m", "hf_optim.doctor", *argv], env=env)
            os.environ["TRITON_INTERPRET"] = "1"
        from hf_optim import _startup

        _startup.finish()  # `import hf_optim` in full (the hf-optim command defers it)
        from hf_optim.doctor.report import run

        return run(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, whatever the doctor was doing (importing torch, a case)
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
