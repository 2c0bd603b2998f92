"""One worker process: spawn in its own session, signal its process group, reap it, and
describe how it ended.

Workers get the user's soft RLIMIT_NOFILE back: the store, hosted in this process, raises
it to the hard limit for its thousands of clients (``store.server``), and a worker would
otherwise inherit that (select() breaks past fd 1024; some programs loop over every
possible fd). The limit is read when this module is imported, which the launcher does
before it starts a store, and set on the worker right after exec with prlimit(2) (no
preexec_fn, unsafe with the agent's threads): the worker's first instructions run with
the raised limit, its program's code (after the loader; Python's start-up) with the
user's.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import time
from collections.abc import Iterable

from ..errors import SpawnError
from ..topology import WorkerSlot

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    import subprocess  # loaded by the first spawn here: an adopted worker needs none of it
    from typing import IO

    from ..rounds import WorkerFailure  # only at a failure: not on the launch path

# (soft, hard) RLIMIT_NOFILE before any store in this process raised the soft limit.
USER_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)


def _restore_nofile(pid: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == USER_NOFILE[0]:
        return
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (USER_NOFILE[0], hard))
    except (OSError, ValueError):  # the worker already exited (or the limit is invalid now)
        pass


def _bind_thread(cpus: frozenset[int]) -> set[int] | None:
    """Bind the calling thread to ``cpus``; returns its previous CPUs to restore, or None
    when the binding was refused (CPUs taken offline or out of this cpuset since they
    were chosen: the worker then runs with the launcher's affinity)."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return None
    return before


class _Adopted:
    """``Popen``'s poll() and wait() for a worker this process started without
    ``subprocess`` (``WorkerProcess.adopt``): the same return codes (-N: killed by
    signal N)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _status(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: unknown, as subprocess says 0
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._status(os.WNOHANG)

    def wait(self) -> int:
        code = self._status(0)
        assert code is not None
        return code


class WorkerProcess:
    """A started worker: its own session and process group (pgid == pid), stdout and
    stderr on pipes, stdin from /dev/null (or this process's stdin when ``stdin``), and a
    pidfd that becomes readable at exit.

    ``pidfd`` is None when the kernel gives none (ENOSYS before Linux 5.3; EMFILE or
    ENFILE when out of file descriptors): the owner then learns of the exit from
    ``poll()``. Raises SpawnError when the program cannot be started.
    """

    # set by ``_started`` (both ways in: spawned here, or adopted)
    slot: WorkerSlot
    argv: list[str]
    popen: subprocess.Popen[bytes] | _Adopted
    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    returncode: int | None
    exit_time: float | None
    pidfd: int | None
    signalled: set[int]  # the signals ``signal_group`` sent

    def __init__(
        self,
        slot: WorkerSlot,
        argv: list[str],
        env: dict[str, str],
        cpus: frozenset[int] | None = None,
        stdin: bool = False,
    ):
        # CPU affinity is per thread and inherited at fork: bind the spawning thread for
        # the duration of the spawn, so the worker (and anything it starts at once) begins
        # bound; no preexec_fn, which is unsafe with the agent's threads
        import subprocess  # (~2.5 ms of CPU with locale: not for adopted workers)

        restore = _bind_thread(cpus) if cpus is not None else None
        try:
            popen = subprocess.Popen(
                argv,
                env=env,
                stdin=None if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                bufsize=0,
            )
        except OSError as e:
            raise SpawnError(f"cannot start rank {slot.rank}: {argv[0]!r}: {e.strerror}") from e
        finally:
            if restore is not None:
                os.sched_setaffinity(0, restore)
        # spawned with PIPE, so both exist (Popen types them Optional)
        assert popen.stdout is not None and popen.stderr is not None
        self._started(slot, argv, popen, popen.stdout, popen.stderr, None, ())
        try:
            _restore_nofile(self.pid)
            try:
                self.pidfd = os.pidfd_open(self.pid)
            except (OSError, AttributeError):  # AttributeError: a Python built without pidfd_open
                pass  # poll() instead
        except BaseException:  # never leave a started worker nobody supervises
            self.signal_group(signal.SIGKILL)
            self.popen.wait()
            raise

    @classmethod
    def adopt(
        cls,
        slot: WorkerSlot,
        argv: list[str],
        pid: int,
        stdout: int,
        stderr: int,
        pidfd: int | None,
        signalled: set[int],
        exited: float | None = None,
    ) -> WorkerProcess:
        """A worker the fast lane (``quick.py``) started as this class would (its own
        session, output on the pipes whose read ends are ``stdout`` and ``stderr``),
        taken over with its pidfd (None: polled), the signals already sent to it and
        when the fast lane saw it exit (``time.time()``; None: it did not): supervised
        from here on as if spawned here."""
        self = cls.__new__(cls)  # (not __init__, which spawns)
        out, err = open(stdout, "rb", buffering=0), open(stderr, "rb", buffering=0)
        self._started(slot, argv, _Adopted(pid), out, err, pidfd, signalled)
        self.exit_time = exited
        return self

    def _started(
        self,
        slot: WorkerSlot,
        argv: list[str],
        popen: subprocess.Popen[bytes] | _Adopted,
        stdout: IO[bytes],
        stderr: IO[bytes],
        pidfd: int | None,
        signalled: Iterable[int],
    ) -> None:
        """What a started worker holds (``__init__`` and ``adopt``, one place for both)."""
        self.slot = slot
        self.argv = argv
        self.popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode = None
        self.exit_time = None
        self.pidfd = pidfd
        self.signalled = set(signalled)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (also after the leader exited,
        to reach what it left behind). Missing groups are ignored."""
        self.signalled.add(sig)
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def poll(self) -> bool:
        """True once the worker has exited (reaped then); never blocks (waitpid WNOHANG)."""
        if self.returncode is None and self.popen.poll() is not None:
            self.reap()
        return self.returncode is not None

    def reap(self) -> int:
        """Collect the exit status; blocks until the worker exits, so call it once the
        pidfd (or ``poll()``) said it did. Returns the subprocess-style return code."""
        if self.returncode is None:
            self.returncode = self.popen.wait()
            if self.exit_time is None:  # (else the fast lane saw the exit: adopt)
                self.exit_time = time.time()
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
        return self.returncode

    def failure(self, stderr_tail: str, error_file: str | None) -> WorkerFailure:
        from ..rounds import WorkerFailure

        text = None
        if error_file:
            try:
                with open(error_file) as f:
                    text = f.read()
            except OSError:
                pass
        return WorkerFailure(
            self.slot.rank,
            self.slot.local_rank,
            self.slot.node_rank,
            socket.gethostname(),
            self.pid,
            self.reap(),  # exited already: returns the recorded status
            self.exit_time or time.time(),
            stderr_tail,
            text,
        )
