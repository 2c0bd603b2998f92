"""The fast lane of the narrow form (``preparse``): a single node's workers spawned after
only light imports, and a job whose workers all exit 0 early ended without the agent.

A no-op worker is done ~13 ms after its spawn, long before the launcher has imported its
store loop and agent (~60 ms), so for short jobs the launcher's serial work *is* the
wall time. Here, before the first spawn, only ``os``, ``signal``, ``select``,
``_socket``, ``_thread``, ``ctypes`` (the subreaper) and our light modules are loaded
(no ``typing``, ``dataclasses``, ``socket``, ``subprocess``, ``tempfile``,
``threading``, ``contextlib``), in the order the full path keeps: the orphan guard is
forked, the signal relay installed, the store's listening socket bound, the scratch
directory made and handed to the guard, then every worker is spawned (``agent/lane.py``:
``os.posix_spawn``: its own session, stdout and stderr on pipes, stdin as
``subprocess`` would give it, inherited descriptors closed, SIGPIPE and SIGXFSZ back to
their defaults, bound to its CPUs) and watched by the guard from its spawn, with the
environment the agent would give it (``workerenv.build_worker_env``).

Then a thread imports the full path while the main thread waits on the workers' pidfds
and the relay, from once the workers should have started (``Early.import_delay``): the
imports beside the workers' interpreter starts would take a CPU from them (and the
interpreter from the main thread at the job's end). A worker's connection to the store
(served by the full path only: it waits in the listener's backlog) starts them at once.
If every worker exits with 0 and its pipes are closed first, the job ends here
(``finish``): output drained with the usual prefixes, workers reaped, leftovers and
strays killed as a group's end kills them, scratch and segments removed, the guard told
to quit, exit 0. Anything else (a worker failing or still running when the imports are
done, a signal, pipes still held open; the imports not done by then are made on the main
thread) hands over to the full path (``command.run_parsed``), whose launcher takes these
workers over (``specs.adopt_first_round``, which checks that each was started exactly as
it would start it) and supervises them as its own from there: failures, restarts, stop
signals, hang watch, exit barrier. ``start`` declines (returns None) anything it does
not handle.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from .agent.guard import OrphanGuard
from .agent.lane import Started, seat_slots, spawn, usable_python
from .agent.output import StreamSink
from .agent.signals import SignalRelay
from .report import say
from .workerenv import (
    MAX_RESTARTS,
    STORE_HOST,
    in_slurm_job,
    make_scratch,
    omp_notice,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import threading

    from .preparse import Parsed

# What the full path imports, loaded by a thread while the workers run.
FULL_PATH = (
    "distlaunch.command",
    "distlaunch.modes",
    "distlaunch.launcher",
    "distlaunch.store",
    "distlaunch.agent.node",
)
MAX_WORKERS = 64  # more go the full path (their spawns dominate anyway)
# The full path's imports (~40 ms of CPU) wait until the workers should have started:
# this many times what this process's own start took, per wave of workers on the CPUs
# (``import_delay``), at most MAX_IMPORT_DELAY seconds.
START_MARGIN = 1.5
MAX_IMPORT_DELAY = 0.25

early: Early | None = None  # started here, not yet taken over by the launcher


class Early(Started):
    """What the fast lane started: ``Started``'s (guard, relay, the scratch directory
    and round 0's workers) and the store's listening socket (a file descriptor)."""

    def __init__(self, run_id: str, guard: OrphanGuard, relay: SignalRelay) -> None:
        super().__init__(run_id, guard, relay)
        self.listener: int | None = None
        self.token = os.urandom(16).hex()
        self.store_port = 0

    def import_delay(self, start_cpu: float) -> float:
        """Seconds after the spawns before ``wait`` imports the full path, given the CPU
        seconds this process's start took (``time.process_time()`` at its first line of
        ours: an interpreter's start on this machine, as each worker's): the workers'
        interpreters start in ceil(workers / CPUs) waves. Imports beside the workers'
        starts would take a CPU from them (a no-op job then waits for both); a job that
        outlasts its start is handed over this much later, unless a worker connects to
        the store first (``wait``: the imports start then), a failure or signal at once."""
        waves = -(-len(self.workers) // self.cpus)
        return min(MAX_IMPORT_DELAY, START_MARGIN * start_cpu * waves)

    def take_listener(self) -> int:
        fd = self.listener
        assert fd is not None
        self.listener = None
        return fd

    def taken(self) -> None:
        """The launcher supervises it all from now on (pipes and pidfds are its own)."""
        global early
        early = None

    def abandon(self) -> None:
        """``Started.abandon``, and the store's listener closed. Idempotent."""
        if self.listener is not None:
            os.close(self.take_listener())
        super().abandon()


def start(parsed: Parsed) -> Early | None:
    """Start the narrow form's workers (see the module docstring), or None: not a job
    this lane handles (nothing started then). Raises LaunchInterrupted (a stop signal
    before the first spawn) or SpawnError, with nothing left running."""
    global early
    script, script_args, options, _given = parsed
    count = int(options["nproc_per_node"])
    environ = os.environ
    python = usable_python()
    if (
        not 1 <= count <= MAX_WORKERS
        # a Slurm allocation's head runs a job over its nodes; in a step the relay's
        # forwarding differs (signals.py)
        or in_slurm_job(environ)
        or python is None
        or options["max_restarts"] > MAX_RESTARTS  # (the full path's error)
        or not os.path.isfile(script)  # (the full path's error; one stat)
    ):
        return None
    guard = OrphanGuard()  # before any thread
    relay = SignalRelay(lambda: (), forward_all=True)  # not under Slurm (checked above)
    e = Early(os.urandom(6).hex(), guard, relay)  # the run id LaunchConfig would draw
    try:
        _prepare(e)
        if e.scratch == "":  # no temporary directory this lane can use: the full path's errors
            e.abandon()
            return None
        slots = seat_slots(0, count, 0, count, 1)
        store = (STORE_HOST, e.store_port, e.token)
        spawn(e, slots, [python, script, *script_args], options, ("localhost", e.master_port), store)
    except NotImplementedError:  # posix_spawn without setsid (an old libc): the full path's
        e.abandon()
        return None
    except BaseException:
        e.abandon()
        raise
    if count > 1 and "OMP_NUM_THREADS" not in environ:  # as launcher.run says it (not again)
        say(omp_notice(count))
    early = e
    return e


def _prepare(e: Early) -> None:
    import _socket

    for port_of in ("listener", "master"):
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        try:
            if port_of == "listener":  # as socket.create_server((STORE_HOST, 0), backlog=4096)
                s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
                s.bind((STORE_HOST, 0))
                s.listen(4096)
                e.store_port = s.getsockname()[1]
                e.listener = s.detach()
            else:  # MASTER_PORT: a free port (specs.free_port)
                s.bind(("", 0))
                e.master_port = s.getsockname()[1]
        finally:
            s.close()
    try:
        e.scratch = make_scratch(e.run_id, e.guard)
    except OSError:  # no usable temporary directory: declined (the full path's error)
        e.scratch = ""


def wait(e: Early, delay: float) -> bool:
    """Wait for the workers, importing the full path on a thread from ``delay`` seconds
    on (see ``import_delay``), or from a worker's first connection to the store (served
    by the full path): True when every worker exited with 0 and its pipes are
    closed before the imports are done, and no stop signal came (``finish`` may end the
    job), False otherwise: a worker failed, a signal came, or the imports are done while
    a worker runs (hand over then; the imports not started by then are the caller's)."""
    done_r, done_w = os.pipe()
    thread: threading.Thread | None = None
    switch = sys.getswitchinterval()

    def imports() -> None:
        try:
            for name in FULL_PATH:
                __import__(name)
        except BaseException:  # the main thread imports them again and sees the error
            pass
        finally:
            os.write(done_w, b"x")

    poller = select.poll()
    poller.register(done_r, select.POLLIN)
    poller.register(e.relay.wakeup_fd, select.POLLIN)
    # readable: a worker's connection waits in its backlog, for the full path's store
    # (not accepted here), so the imports start at once
    listener = e.listener
    if listener is not None:
        poller.register(listener, select.POLLIN)
    watching = {w.pidfd: w for w in e.workers if w.pidfd is not None}
    for fd in watching:
        poller.register(fd, select.POLLIN)
    ok = len(watching) == len(e.workers)
    start_at = time.monotonic() + delay
    try:
        while ok and watching:
            timeout = None if thread is not None else max(0.0, start_at - time.monotonic())
            events = poller.poll(None if timeout is None else 1e3 * timeout)
            if thread is None and (not events or any(fd == listener for fd, _ in events)):
                # the full path is needed: the workers outlast their start, or one is at
                # the store (its listener stays readable until the store accepts)
                if listener is not None:
                    poller.unregister(listener)
                import threading  # (here: not loaded by a job that ends before)

                sys.setswitchinterval(0.0005)  # the main thread gets the interpreter soon after a wake
                thread = threading.Thread(target=imports, name="distlaunch-imports", daemon=True)
                thread.start()
            for fd, _ in events:
                if fd == listener:
                    continue
                w = watching.pop(fd, None)
                if w is None:  # the imports are done, or a signal came: hand over
                    ok = False
                    break
                poller.unregister(fd)
                # peek (not reaped: a worker that failed is the full path's to reap)
                info = os.waitid(os.P_PID, w.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                w.exited = time.time()  # (the launcher's root cause is the first exit)
                if info is None or info.si_code != os.CLD_EXITED or info.si_status != 0:
                    ok = False
                    break
        if ok:  # every writer of every pipe gone (else a process they left holds one)
            pipes = select.poll()
            for w in e.workers:
                pipes.register(w.stdout, select.POLLIN)
                pipes.register(w.stderr, select.POLLIN)
            ok = sum(1 for _, ev in pipes.poll(0) if ev & select.POLLHUP) == 2 * len(e.workers)
        # a stop signal that came with the last exit (in the same poll, or since): the
        # launcher ends the job as it ends a stopped one (128+N), not this lane with 0
        ok = ok and e.relay.stop_signal is None
    finally:
        if not ok:
            if thread is not None:
                thread.join()  # the main thread imports nothing the thread is importing
            sys.setswitchinterval(switch)
            os.close(done_r)
            os.close(done_w)
    return ok


def finish(e: Early) -> None:
    """End a job whose workers all exited with 0 (``wait``), as its group and launcher
    would: their output to the console with the ``[rank]: `` prefixes, each reaped,
    what is left of their process groups and the strays killed, the scratch directory
    and segments removed, signals restored, the guard told to quit. The caller exits."""
    e.relay.targets = lambda: ()  # they have exited: nothing to forward a signal to
    for w in e.workers:
        for fd, console in ((w.stdout, 1), (w.stderr, 2)):
            sink = StreamSink(f"[{w.rank}]: ".encode(), console, None, keep_tail=False)
            while data := os.read(fd, 1 << 16):
                sink.feed(data)
            sink.close()
        os.close(w.stdout)
        os.close(w.stderr)
        w.stdout = w.stderr = -1
    # as WorkerGroup._kill_leftovers, before the leaders are reaped: a leader not yet
    # reaped keeps its group's id from being reused by a new process
    for w in e.workers:
        w.signal_group(signal.SIGKILL)
    for w in e.workers:
        os.waitpid(w.pid, 0)
        w.pid = -1  # (reaped: abandon() must not signal or reap it again)
        assert w.pidfd is not None
        os.close(w.pidfd)
        w.pidfd = None
    e.guard.kill_strays()  # (after the reaping: an unreaped leader would count as one)
    e.workers = []
    e.abandon()  # (nothing left to kill): scratch, segments, the listener, the relay, the guard
