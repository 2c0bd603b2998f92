"""One worker process: spawn in its own session, signal its process group, reap it, and
describe how it ended."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from ..errors import SpawnError
from ..topology import WorkerSlot


@dataclass(frozen=True)
class WorkerFailure:
    """How a worker failed: the root-cause record shown to the user."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    returncode: int  # negative: killed by signal -returncode (subprocess convention)
    timestamp: float  # time.time() when the launcher saw the exit
    stderr_tail: str
    error_file_text: str | None = None

    @property
    def exit_code(self) -> int:
        """What a shell would report: the exit status, or 128+N for death by signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def how(self) -> str:
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name} (exit code {self.exit_code})"
        return f"exit code {self.returncode}"


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


class WorkerProcess:
    """A started worker: its own session and process group (pgid == pid), stdout and
    stderr on pipes, stdin from /dev/null, and a pidfd that becomes readable at exit."""

    def __init__(self, slot: WorkerSlot, argv: list[str], env: dict[str, str],
                 cwd: str | None = None, cpus: frozenset[int] | None = None):
        self.slot = slot
        self.argv = argv
        # CPU affinity is per thread and inherited at fork: bind the spawning thread for
        # the duration of the spawn, so the worker (and anything it starts at once) begins
        # bound; no preexec_fn, which is unsafe with the agent's threads
        restore = _bind_thread(cpus) if cpus is not None else None
        try:
            self.popen = subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, bufsize=0)
        except OSError as e:
            raise SpawnError(f"cannot start rank {slot.rank}: {argv[0]!r}: {e.strerror}") from e
        finally:
            if restore is not None:
                os.sched_setaffinity(0, restore)
        self.pid = self.popen.pid
        self.pidfd = os.pidfd_open(self.pid)
        self.returncode: int | None = None
        self.exit_time: float | None = None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's whole process group (also after the leader exited,
        to reach what it left behind). Missing groups are ignored."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def reap(self) -> int:
        """Collect the exit status once the pidfd said the process ended (does not block
        then). Returns the subprocess-style return code."""
        if self.returncode is None:
            self.returncode = self.popen.wait()
            self.exit_time = time.time()
            os.close(self.pidfd)
        return self.returncode

    def failure(self, stderr_tail: str, error_file: str | None) -> WorkerFailure:
        text = None
        if error_file:
            try:
                with open(error_file) as f:
                    text = f.read()
            except OSError:
                pass
        return WorkerFailure(self.slot.rank, self.slot.local_rank, self.slot.node_rank,
                             socket.gethostname(), self.pid, self.returncode,
                             self.exit_time or time.time(), stderr_tail, text)
