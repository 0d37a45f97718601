"""The one background compiler of ``HF_OPTIM_COMPILE=auto`` for a machine and inductor cache directory.

``python .../cpu_compile_worker.py PACKAGE_ROOT QUEUE_DIR [LOCK_FD]``, started by
:meth:`hf_optim.kernels.torch_path.compile_queue.Queue.ensure_worker` (run as a file, not with ``-m``: importing
``hf_optim`` would import torch before the lock is taken). First, before importing torch, it takes the queue's lock
(``LOCK_FD``: the lock its starter took and handed over) and exits at once if another process holds it. Then it
compiles the queued kernels one after another, oldest first, at a lower priority (``nice`` +10) than the training it
works beside, each exactly as the requesting process compiles it (:func:`cpu_kernel.run_probe`: the same compiled
function, probe inputs, dynamic marks, options and thread count), so that process's own compilation afterwards is a
cache hit. After each kernel it writes the kernel's warm marker (done), or the error's type and first line for each
requester (failed). It exits when no queued kernel has a live requester (:mod:`compile_queue`).
"""

from __future__ import annotations

import contextlib
import os
import sys

NICENESS = 10


def _take_lock(queue_dir: str, handed: str | None) -> int | None:
    """The worker lock's file descriptor, or None when another worker holds it (stdlib only: torch is not imported
    yet)."""
    import fcntl

    fd = int(handed) if handed else os.open(os.path.join(queue_dir, "worker.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op on the open file our starter locked for us
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def main(argv: list[str]) -> int:
    """Compile the queue in ``argv[2]`` until no live requester waits; the exit status (0 also when another worker
    runs)."""
    if _take_lock(argv[2], argv[3] if len(argv) > 3 else None) is None:
        return 0
    with contextlib.suppress(OSError, AttributeError):  # not permitted, or no nice() on this platform
        os.nice(NICENESS)
    sys.path[0] = argv[1]  # the package's root, instead of this file's directory (whose modules would shadow)

    import pickle

    from hf_optim.kernels.torch_path import compile_queue, compile_requests, compiled_artifact, cpu_kernel

    queue = compile_queue.Queue(argv[2])
    queue.recover()
    while (key := queue.next_job()) is not None:
        try:
            kernel, hyper, rounding_key, threads = pickle.loads(queue.claim(key))
            marker = compile_requests.marker_of(key)
            if not marker.exists():  # else compiled since it was queued (by an earlier job of the same kernel)
                probe = cpu_kernel.probe_factory(kernel, hyper, rounding_key)
                compiled = cpu_kernel.twin(kernel.rule)
                if compiled_artifact.supported():  # compiles it (one compilation) and saves it beside the marker
                    cpu_kernel.save(kernel, compiled, probe, threads, compiled_artifact.path_beside(marker))
                else:
                    cpu_kernel.run_probe(kernel, compiled, probe, threads)
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()  # its requesters, and later processes, now compile it from the cache
        except Exception as error:
            first_line = (str(error).strip().splitlines() or [""])[0][:300]
            print(f"{key}: {type(error).__name__}: {first_line}", file=sys.stderr, flush=True)
            queue.fail(key, f"{type(error).__name__}: {first_line}")
        else:
            queue.done(key)
        cpu_kernel.release_compiled()  # what dynamo and inductor keep of the kernel: the worker stays small
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
