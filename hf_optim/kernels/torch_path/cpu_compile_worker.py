"""The background process of ``HF_OPTIM_COMPILE=auto``: compiles one CPU kernel into inductor's cache and exits.

``python -m hf_optim.kernels.torch_path.cpu_compile_worker JOB``: ``JOB`` is a pickled ``(Kernel, hyper, key, threads)``
written by :func:`hf_optim.kernels.torch_path.cpu_compile.start_warmup` (removed here once read). The kernel is compiled
exactly as the training process compiles it (:func:`cpu_compile._run_probe`: the same compiled function, probe inputs,
dynamic marks, options and thread count), so that process's own compilation afterwards is a cache hit. Exit status 0
when compiled (it then leaves :func:`cpu_compile.warm_marker`'s file, so later runs compile from the cache at their
first step); 1 with the error's type and first line as the last line of stderr when not. It runs at a lower priority
(``nice`` +10) than the training it works beside.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys

NICENESS = 10


def main(argv: list[str]) -> int:
    """Compile the job in ``argv[1]``; the exit status."""
    with contextlib.suppress(OSError, AttributeError):  # not permitted, or no nice() on this platform
        os.nice(NICENESS)
    try:
        from hf_optim.kernels.torch_path import cpu_compile

        with open(argv[1], "rb") as job:
            kernel, hyper, key, threads = pickle.load(job)
        with contextlib.suppress(OSError):
            os.unlink(argv[1])
        entry = cpu_compile._Entry(cpu_compile._twin(kernel.rule))
        entry.probe = cpu_compile._probe_factory(kernel, hyper, key)
        cpu_compile._run_probe(kernel, entry, threads)
        marker = cpu_compile.warm_marker(kernel, threads)  # the next process compiles from the cache at once
        if marker is not None:
            with contextlib.suppress(OSError):
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
    except Exception as error:
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        print(f"{type(error).__name__}: {first_line}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
