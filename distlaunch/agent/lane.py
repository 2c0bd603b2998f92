"""Round 0's workers spawned with light imports: ``spawn`` starts each as
``process.WorkerProcess`` would (``os.posix_spawn``: its own session, stdout and stderr
on pipes, stdin as ``subprocess`` would give it, inherited descriptors closed, SIGPIPE
and SIGXFSZ back to their defaults, bound to its CPUs), with the environment the agent
would give it (``workerenv.slot_env``), watched by the orphan guard and reached by the
signal relay from its spawn. ``Started`` holds what was started until the launcher's
agent takes it over (``specs.adopt_first_round``, which checks each worker was started
as it would start it) or undoes it (``Started.abandon``).

The single-node fast lane (``quick.py``, whose ``Early`` adds the store's listener) and
a Slurm agent's head-planned round 0 (``agent/entry.py``) spawn with it before anything
heavier is loaded: the standard library's ``os``,
``signal`` and ``ctypes`` (the guard), and our light modules; no ``typing``,
``dataclasses``, ``socket``, ``subprocess`` or ``tempfile``.
"""

from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace

from ..cpus import cpu_sets
from ..errors import LaunchInterrupted, SpawnError
from ..workerenv import SHM_DIR, create_progress, shm_prefix, slot_env
from .guard import OrphanGuard, remove_matching, remove_tree
from .signals import SignalRelay

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


class Worker:
    """One worker started here: what it was started with, and its ends of the pipes."""

    __slots__ = (
        "rank",
        "argv",
        "env",
        "cpus",
        "stdin",
        "pid",
        "stdout",
        "stderr",
        "pidfd",
        "signalled",
        "exited",
    )

    def __init__(
        self, rank: int, argv: list[str], env: dict[str, str], cpus: frozenset[int] | None, stdin: bool
    ):
        self.rank, self.argv, self.env, self.cpus, self.stdin = rank, argv, env, cpus, stdin
        self.pid = self.stdout = self.stderr = -1
        self.pidfd: int | None = None
        self.signalled: set[int] = set()  # what was sent (the launcher does not send it again)
        self.exited: float | None = None  # time.time() when quick.wait saw it exit

    def signal_group(self, sig: int) -> None:
        """As ``WorkerProcess.signal_group`` (the relay's target until the take-over)."""
        if self.pid <= 0:  # not started, or reaped (killpg(-1) would fail: EINVAL)
            return
        self.signalled.add(sig)
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Started:
    """What was started here: guard, relay, the scratch directory (``scratch``) and
    round 0's workers, their MASTER_PORT (``master_port``) and the environment their
    own variables were added to (``base_env``)."""

    def __init__(
        self,
        run_id: str,
        guard: OrphanGuard,
        relay: SignalRelay,
        base_env: dict[str, str] | None = None,
    ) -> None:
        """``base_env``: default this process's environment."""
        self.run_id, self.guard, self.relay = run_id, guard, relay
        self.master_port = 0
        self.scratch = ""
        self.base_env = dict(os.environ) if base_env is None else base_env
        self.workers: list[Worker] = []
        self.cpus = 1  # how many CPUs the workers share

    def taken(self) -> None:
        """The launcher's agent supervises it all from now on (pipes and pidfds are
        its own)."""

    def abandon(self) -> None:
        """Undo everything (a start that failed, or one the launcher could not take
        over): SIGKILL each worker's group, reap it, close its pipes, remove the scratch
        directory and the workers' shared-memory segments, restore the signals, quit
        the guard. Idempotent."""
        self.taken()
        self.relay.targets = lambda: ()  # (a signal now must not reach a reaped pid)
        live = [w for w in self.workers if w.pid > 0]
        for w in live:  # every group before any leader is reaped (as quick.finish)
            w.signal_group(signal.SIGKILL)
        for w in live:
            os.waitpid(w.pid, 0)
            w.pid = -1
        if live:
            self.guard.kill_strays()  # what they moved out of their groups (as a group's close)
        for w in self.workers:
            for fd in (w.stdout, w.stderr, w.pidfd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            w.stdout = w.stderr = -1
            w.pidfd = None
        if self.scratch:
            remove_tree(self.scratch)
            self.scratch = ""
        # the segments, as node.py removes a round's (the guard, quit normally, does not)
        remove_matching(os.path.join(SHM_DIR, shm_prefix(self.run_id, os.getpid()) + "*"))
        self.relay.restore()
        self.guard.close(wait=1.0)


def usable_python() -> str | None:
    """The interpreter the lane starts workers with (``env.python_exec``'s: PYTHON_EXEC,
    else this one), or None where the lane cannot start them: a relative path (the
    agent's subprocess would search the worker's PATH) or no ``os.pidfd_open``."""
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    return python if os.path.isabs(python) and hasattr(os, "pidfd_open") else None


def seat_slots(first_rank: int, count: int, node_rank: int, world_size: int, num_nodes: int) -> list[Any]:
    """The ``count`` slots of one node's seat as ``topology.WorkerSlot`` has them (a
    dataclass, not loaded here): ranks ``first_rank`` on, local ranks from 0."""
    return [
        SimpleNamespace(
            rank=first_rank + i,
            local_rank=i,
            node_rank=node_rank,
            world_size=world_size,
            local_world_size=count,
            num_nodes=num_nodes,
        )
        for i in range(count)
    ]


def spawn(
    e: Started,
    slots: list[Any],
    argv: list[str],
    options: dict[str, Any],
    master: tuple[str, int],
    store: tuple[str, int, str],
    base: dict[str, str] | None = None,
) -> None:
    """Spawn round 0's worker of each of ``slots`` (anything with a ``WorkerSlot``'s
    fields) with ``argv``, as the launcher's agent would (``specs.build_specs``: the
    environment of ``workerenv.slot_env``, error and progress files in ``e.scratch``,
    CPUs by ``options["bind_to"]``, stdin for rank 0, as ``--stdin 0``), each watched
    by the guard and reached by the relay from its spawn; ``options``: ``max_restarts``,
    ``role`` and ``bind_to`` as the launcher's configuration has them; ``base``: the
    environment their variables are added to (default ``e.base_env``). Raises
    LaunchInterrupted (a stop signal before the first spawn) or SpawnError; the caller
    undoes what was started (``Early.abandon``)."""
    # descriptors this process inherited without close-on-exec: subprocess's close_fds
    closes = [
        (os.POSIX_SPAWN_CLOSE, fd)
        for fd in map(int, os.listdir("/proc/self/fd"))
        if fd > 2 and _inheritable(fd)
    ]
    usable = os.sched_getaffinity(0)
    e.cpus = max(1, len(usable))
    cpus = cpu_sets(options["bind_to"], len(slots), usable)
    shm = shm_prefix(e.run_id, os.getpid(), 0)
    if base is None:
        base = e.base_env
    e.relay.targets = lambda: e.workers
    if e.relay.stop_signal is not None:  # stopped before anything started: start nothing
        raise LaunchInterrupted(e.relay.stop_signal)
    for slot in slots:
        rank = slot.rank
        error_file = os.path.join(e.scratch, f"error_0_{rank}.json")
        path = os.path.join(e.scratch, f"progress_0_{rank}")
        try:
            create_progress(path)
            progress: str | None = path
        except OSError:  # the scratch dir's disk is full: the rank is watched by its output
            progress = None
        env = slot_env(
            slot,
            base,
            run_id=e.run_id,
            restart_count=0,
            max_restarts=options["max_restarts"],
            role=options["role"],
            master=master,
            store=store,
            error_file=error_file,
            shm=shm,
            agent_store=False,
            progress_file=progress,
            python=True,
        )
        w = Worker(rank, argv, env, cpus[slot.local_rank], rank == 0)  # --stdin 0
        _spawn_one(e, w, closes)
        e.workers.append(w)  # (the relay's targets: started workers only)
    if e.relay.stop_signal is not None:  # it came during the spawns: reach every worker once
        for w in e.workers:
            if e.relay.stop_signal not in w.signalled:
                w.signal_group(e.relay.stop_signal)


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return False


def _spawn_one(e: Started, w: Worker, closes: list[tuple[int, int]]) -> None:
    """As ``process.WorkerProcess`` spawns (see the module docstring)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions: list[tuple[object, ...]] = list(closes)
    if not w.stdin:
        actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0))
    actions += [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    before = None
    if w.cpus is not None:  # the spawning thread's CPUs are the worker's (process._bind_thread)
        before = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, w.cpus)
        except OSError:
            before = None
    try:
        w.pid = os.posix_spawn(
            w.argv[0],
            w.argv,
            w.env,
            file_actions=actions,
            setsid=True,
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )
    except BaseException as err:
        os.close(out_r)
        os.close(err_r)
        if isinstance(err, OSError):
            raise SpawnError(f"cannot start rank {w.rank}: {w.argv[0]!r}: {err.strerror}") from err
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
        if before is not None:
            os.sched_setaffinity(0, before)
    w.stdout, w.stderr = out_r, err_r
    e.guard.watch(w.pid)
    try:
        w.pidfd = os.pidfd_open(w.pid)
    except OSError:  # out of descriptors: the full path polls it
        w.pidfd = None
