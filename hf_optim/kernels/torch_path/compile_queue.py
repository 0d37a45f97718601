"""The queue of CPU kernels waiting for the one background compiler of a machine and inductor cache directory.

Files in ``<inductor cache>/hf_optim/queue/`` (``KEY``: a kernel's :func:`~hf_optim.kernels.torch_path.cpu_compile.
kernel_key`, the name of its warm marker; ``WHO``: ``<pid>-<start time>`` of a requesting process, so that a reused
PID is not taken for a live requester):

- ``worker.lock``: held (``flock``) by the one worker process for its whole life. The process that starts a worker
  takes it first and hands its open file to the worker, so two workers never run at once; the kernel releases it when
  the worker dies, so a crash leaves no stale lock. ``worker.log``: the last worker's stderr.
- ``KEY.job``: the pickled job, written to a temporary file and renamed (never seen half written); ``KEY.compiling``
  while the worker compiles it, ``KEY.attempts`` counts the workers that started it (a worker that dies mid-kernel,
  killed or out of memory, leaves it: the next worker retries it once, then reports the death as the failure).
- ``KEY.WHO.req``: one per process waiting for the kernel. A process that finds a kernel queued or compiling only adds
  its own, so a kernel is compiled once however many processes need it.
- ``KEY.WHO.failed``: the compile error for that requester (it reads and removes it).

Done means the kernel's warm marker exists (the worker writes it once inductor's cache holds the kernel). The worker
compiles the jobs one after another, oldest first, skipping (and removing) those whose requesters have all exited,
and exits when no job with a live requester is left: it outlives its requesters by at most the kernel it is
compiling. It removes what dead requesters left (requests, failures, temporary files).

This module imports neither torch nor the rest of hf_optim: the requesting side is cheap, and the worker can take its
lock before it imports torch.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; the kernels then compile in the training thread (cpu_compile)
    fcntl = None

LOCK = "worker.lock"
LOG = "worker.log"
WORKER = Path(__file__).with_name("cpu_compile_worker.py")
MAX_ATTEMPTS = 2
"""Workers that may start a kernel; one dying in it (killed, out of memory) leaves it to the next once."""
STALE_TEMP_S = 300.0
"""Age after which a temporary file in the queue is a crashed writer's leftover."""


def supported() -> bool:
    """Whether this platform has the lock the single worker relies on."""
    return fcntl is not None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc), ``"0"`` where that is unknown, None when it does
    not exist or has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): whether it exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "0"
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped
        return None
    return fields[19].decode()  # field 22 of stat(5); fields[0] is field 3


_me: tuple[int, str] | None = None


def me() -> str:
    """``<pid>-<start time>`` of this process (computed again in a forked child)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        _me = (pid, f"{pid}-{_start_time(pid) or '0'}")
    return _me[1]


def alive(who: str) -> bool:
    """Whether the process named ``who`` (:func:`me`'s form) still runs: the same PID, started at the same time."""
    pid, _, start = who.partition("-")
    if not pid.isdigit():
        return False
    found = _start_time(int(pid))
    return found is not None and (found == start or "0" in (found, start))


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` so that no reader ever sees it half written (a temporary file beside it, renamed)."""
    temporary = path.with_name(f".tmp-{me()}-{time.monotonic_ns()}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Queue:
    """The queue directory ``directory`` (created when first written)."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)

    # -- requesting side ------------------------------------------------------------------------------------------

    def _request_file(self, key: str, who: str | None = None) -> Path:
        return self.directory / f"{key}.{who or me()}.req"

    def _failed_file(self, key: str, who: str | None = None) -> Path:
        return self.directory / f"{key}.{who or me()}.failed"

    def queued(self, key: str) -> bool:
        """Whether ``key`` waits in the queue or is being compiled."""
        return (self.directory / f"{key}.job").exists() or (self.directory / f"{key}.compiling").exists()

    def request(self, key: str, job: bytes) -> None:
        """Ask for ``key`` on behalf of this process: add this process's request, and the job unless it is queued
        or being compiled already."""
        self.directory.mkdir(parents=True, exist_ok=True)
        request = self._request_file(key)
        if not request.exists():
            write_atomically(request, b"")
        if not self.queued(key):
            write_atomically(self.directory / f"{key}.job", job)

    def requested(self, key: str) -> bool:
        """Whether this process's request for ``key`` is still there (the worker removes it when done)."""
        return self._request_file(key).exists()

    def failure(self, key: str) -> str | None:
        """The error the worker met on ``key`` for this process (read once: the file is removed), or None."""
        path = self._failed_file(key)
        try:
            error = path.read_text(errors="replace").strip()
        except FileNotFoundError:
            return None
        _unlink(path)
        return error or "the compiler process failed"

    def withdraw(self, key: str) -> None:
        """This process no longer waits for ``key`` (the worker then skips it unless another process waits)."""
        _unlink(self._request_file(key))
        _unlink(self._failed_file(key))

    def worker_running(self) -> bool:
        """Whether a worker holds the lock (tests, diagnostics)."""
        with self._lock() as held:
            return not held

    @contextlib.contextmanager
    def _lock(self):
        """Try to take the worker lock; yields its file descriptor, or None when another process holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
            else:
                yield fd
        finally:
            os.close(fd)  # the lock goes with it, unless a started worker holds the same open file

    def ensure_worker(self, package_root: str) -> subprocess.Popen | None:
        """Start the worker unless one runs; it gets the lock this process took, so no second one can start
        meanwhile. Returns the started process (its parent should reap it), or None."""
        with self._lock() as fd:
            if fd is None:
                return None
            with open(self.directory / LOG, "wb") as log:
                # Its own session: a Ctrl-C meant for the training does not kill it mid-kernel (it then finishes
                # that kernel and exits, as its requesters are gone). No inherited stdin/stdout: a caller reading
                # this process's output to its end does not wait for it.
                return subprocess.Popen(
                    [sys.executable, str(WORKER), package_root, str(self.directory), str(fd)], pass_fds=(fd,),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    # -- worker side ----------------------------------------------------------------------------------------------

    def _scan(self) -> dict[str, dict]:
        """The queue's files by key: ``job``/``compiling`` (paths or None) and live ``requests`` (who -> path);
        removes the requests and failures of processes that have exited and crashed writers' temporary files."""
        found: dict[str, dict] = {}
        now = time.time()
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return found
        for name in names:
            path = self.directory / name
            if name.startswith(".tmp-"):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_TEMP_S:
                        _unlink(path)
                continue
            parts = name.split(".")
            if len(parts) < 2 or parts[0] in ("worker",):
                continue
            entry = found.setdefault(parts[0], {"job": None, "compiling": None, "requests": {}})
            if len(parts) == 2 and parts[1] in ("job", "compiling"):
                entry[parts[1]] = path
            elif len(parts) == 3 and parts[2] in ("req", "failed"):
                if not alive(parts[1]):
                    _unlink(path)
                elif parts[2] == "req":
                    entry["requests"][parts[1]] = path
        return found

    def next_job(self) -> str | None:
        """The oldest queued key with a live requester; drops the jobs nobody waits for any more."""
        candidates = []
        for key, entry in self._scan().items():
            if entry["job"] is None:
                continue
            if not entry["requests"]:
                self._forget_job(key)
                continue
            with contextlib.suppress(FileNotFoundError):
                candidates.append((entry["job"].stat().st_mtime, key))
        return min(candidates)[1] if candidates else None

    def claim(self, key: str) -> bytes:
        """Take ``key``'s job out of the queue to compile it (``KEY.compiling``); returns the job."""
        attempts = self.directory / f"{key}.attempts"
        with open(attempts, "ab") as counter:
            counter.write(b".")
        compiling = self.directory / f"{key}.compiling"
        os.replace(self.directory / f"{key}.job", compiling)
        return compiling.read_bytes()

    def recover(self) -> None:
        """At a worker's start: a job left ``compiling`` was a dead worker's. Queue it again, or, when it was started
        :data:`MAX_ATTEMPTS` times already, report the death to its requesters."""
        for key, entry in self._scan().items():
            if entry["compiling"] is None:
                continue
            try:
                attempts = (self.directory / f"{key}.attempts").stat().st_size
            except FileNotFoundError:
                attempts = 0
            if attempts >= MAX_ATTEMPTS:
                self.fail(key, f"the compiler process died while compiling it, {attempts} times (killed, or out of "
                               "memory?)")
            else:
                os.replace(entry["compiling"], self.directory / f"{key}.job")

    def done(self, key: str) -> None:
        """``key`` is compiled (its marker written): remove its job and requests."""
        for path in self._scan().get(key, {"requests": {}})["requests"].values():
            _unlink(path)
        self._forget_job(key)

    def fail(self, key: str, error: str) -> None:
        """``key`` failed with ``error``: tell each live requester (``KEY.WHO.failed``) and remove the job."""
        for who, path in self._scan().get(key, {"requests": {}})["requests"].items():
            with contextlib.suppress(OSError):
                write_atomically(self._failed_file(key, who), error.encode())
            _unlink(path)
        self._forget_job(key)

    def _forget_job(self, key: str) -> None:
        for suffix in ("job", "compiling", "attempts"):
            _unlink(self.directory / f"{key}.{suffix}")
