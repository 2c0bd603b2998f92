"""One attempt of a node's worker group: start every worker, relay output, and stop the
group at the first failure (SIGTERM to each process group, ``stop_timeout`` seconds of
grace, then SIGKILL), as torchrun's agent does.

Event-driven, no polling: one ``select`` over the workers' pipes, their pidfds and the
signal wake-up fd, so a failure is seen (and the group restarted) within milliseconds.
Only when the kernel gives no pidfd for a worker (before Linux 5.3, or out of file
descriptors) is that worker polled (waitpid WNOHANG every POLL_SECONDS).

Processes that left a worker's process group and session (setsid: daemonising tools) are
not reached by the group signals; the agent adopts them when their parent exits (it is a
child subreaper, see ``guard.py``), and kills them with their descendants once every
worker has exited.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..report import say
from ..startup import resume_gc
from ..topology import WorkerSlot
from .guard import OrphanGuard
from .output import StreamSink
from .process import WorkerProcess
from .signals import SignalRelay

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:  # made by the node agent (watch.py sits above this module: it reads stacks)
    from ..rounds import WorkerFailure  # only at a failure: not on the launch path
    from .merged import DedupConsole
    from .watch import Watchdog

# After every worker exited, how long to wait for pipes still held open by processes
# that left the worker's process group (seconds).
DRAIN_SECONDS = 2.0
# How often a worker without a pidfd is checked for exit (seconds).
POLL_SECONDS = 0.05
# seconds after a stop signal before saying that workers keep the launcher waiting (at most
# half the stop timeout): workers that obey the signal are gone by then, nothing is said
SAY_STOPPING_AFTER = 0.5


@dataclass(frozen=True)
class LaunchSpec:
    """What to start for one worker."""

    slot: WorkerSlot
    argv: list[str]
    env: dict[str, str]
    stdout: StreamSink
    stderr: StreamSink
    error_file: str | None = None
    cpus: frozenset[int] | None = None  # CPU affinity (None: inherited)
    stdin: bool = False  # reads the launcher's stdin (else /dev/null)


@dataclass(frozen=True)
class AttemptResult:
    """How one attempt of the group ended."""

    failure: WorkerFailure | None  # the first worker of this group that failed, if any
    stop_signal: int | None  # the launcher was told to stop by this signal


class WorkerGroup:
    def __init__(
        self,
        specs: list[LaunchSpec],
        relay: SignalRelay,
        guard: OrphanGuard,
        stop_timeout: float,
        on_failure: Callable[[WorkerFailure], object] | None = None,
        stop_fd: int | None = None,
        stop_signal: Callable[[], int] | None = None,
        on_started: Callable[[list[int]], None] | None = None,
    ):
        """``on_failure(f)`` runs (on this thread) at the first local failure. When
        ``stop_fd`` becomes readable the group is stopped from outside: its workers get
        ``stop_signal()`` (default SIGTERM), then SIGKILL after ``stop_timeout``.
        ``on_started(pids)`` runs once every worker is started (pid == process group)."""
        self.on_started = on_started
        self.specs = specs
        self.stop_fd = stop_fd
        self.stop_signal = stop_signal
        self.relay = relay
        self.guard = guard
        self.stop_timeout = stop_timeout
        self.on_failure = on_failure
        self.workers: list[WorkerProcess] = []
        # --hang-timeout / --stacks-on-failure (agent/watch.py); None: neither
        self.watchdog: Watchdog | None = None
        # --dedup-output's console streams (shared by the sinks of several workers)
        self.merged: list[DedupConsole] = list(
            {id(m): m for s in specs for m in (s.stdout.dedup, s.stderr.dedup) if m}.values()
        )
        self._sel: selectors.BaseSelector | None = None
        self._ran = False  # run() or stop() took the started workers over
        self._closed = False

    def live(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.returncode is None]

    def start(self, started: list[WorkerProcess] | None = None) -> None:
        """Start every worker (each in its own process group, watched by the guard from
        its spawn); a stop signal that came during the spawns reaches them all. Raises
        SpawnError if one cannot be started; call ``close()`` then (``run()`` does).
        ``started``: the specs' workers, already started (and watched) by the fast lane
        (``quick.py``): taken over as they are."""
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self.relay.wakeup_fd, selectors.EVENT_READ, None)
        for i, spec in enumerate(self.specs):
            if started is not None:
                w = started[i]
            else:
                w = WorkerProcess(spec.slot, spec.argv, spec.env, cpus=spec.cpus, stdin=spec.stdin)
            self.workers.append(w)
            if started is None:  # (the fast lane's are watched since their spawn)
                self.guard.watch(w.pid)
            os.set_blocking(w.stdout.fileno(), False)
            os.set_blocking(w.stderr.fileno(), False)
            sel.register(w.stdout, selectors.EVENT_READ, spec.stdout)
            sel.register(w.stderr, selectors.EVENT_READ, spec.stderr)
        # the exits the fast lane saw first, in their order: exits already there come
        # back in the order registered, and the first failure reaped is the root cause
        pairs = sorted(zip(self.workers, self.specs), key=lambda ws: ws[0].exit_time or float("inf"))
        for w, spec in pairs:
            if w.pidfd is not None:
                sel.register(w.pidfd, selectors.EVENT_READ, (w, spec))
        if self.relay.stop_signal is not None:  # it came during the spawns: reach every worker
            for w in self.workers:  # once (the relay reached those started before it came)
                if self.relay.stop_signal not in w.signalled:
                    w.signal_group(self.relay.stop_signal)
        if self.on_started:
            self.on_started([w.pid for w in self.workers])

    def run(self) -> AttemptResult:
        """Start the workers (unless ``start()`` did) and block until all have exited.
        Raises SpawnError if one cannot be started (the ones already started are stopped
        first)."""
        self._ran = True
        resume_gc()  # start-up is over (a pre-parsed launch paused the collector: startup.py)
        try:
            if self._sel is None:
                self.start()
            assert self._sel is not None
            if self.stop_fd is not None:
                self._sel.register(self.stop_fd, selectors.EVENT_READ, "stop")
            if self.watchdog:
                self.watchdog.start()
            return self._loop(self._sel)
        finally:
            self.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop a group that was started but never run (round 0 started early, whose
        store or agent then failed) as ``run()`` stops one from outside: ``sig`` to each
        worker's process group, up to ``stop_timeout`` seconds of grace (a second Ctrl-C
        cuts it short), then SIGKILL; their output is read to its end and printed. Blocks
        until every worker has exited; then ``close()``. A group not started, or already
        run, is only closed."""
        if self._sel is None or self._ran or self._closed:
            self.close()
            return
        self._ran = True
        stop_r, stop_w = os.pipe()
        os.write(stop_w, b"x")  # the loop reads it as an outside stop at once
        self.stop_fd, self.stop_signal = stop_r, lambda: sig
        try:
            self._sel.register(stop_r, selectors.EVENT_READ, "stop")
            self._loop(self._sel)
        finally:
            self.close()
            os.close(stop_r)
            os.close(stop_w)

    def close(self) -> None:
        """Kill (SIGKILL) and reap the workers still running, with what they left behind,
        and close their output. Idempotent; ``run()`` and ``stop()`` end with it. A group
        started but never run is stopped first, with the grace of ``stop()``: its workers
        have run unsupervised, and may be mid-work with output not yet read."""
        if self._sel is not None and not self._ran and not self._closed:
            self.stop()
            return
        if self._closed:
            return
        self._closed = True
        self._kill_all_and_reap()
        for spec in self.specs:
            spec.stdout.close()
            spec.stderr.close()
        for w in self.workers:  # pipes the loop did not read to their end
            w.stdout.close()
            w.stderr.close()
        for m in self.merged:
            m.flush()
        if self._sel is not None:
            self._sel.close()

    def _loop(self, sel: selectors.BaseSelector) -> AttemptResult:
        failure: WorkerFailure | None = None
        outside = False
        kill_at: float | None = None  # set once stopping: when SIGKILL follows SIGTERM
        say_at: float | None = None  # when to say that workers keep us waiting, if they still do
        drain_until: float | None = None
        open_pipes = 2 * len(self.workers)
        while open_pipes or self.live():
            if self.relay.stop_signal is not None and kill_at is None:
                kill_at = time.monotonic() + self.stop_timeout  # signal already forwarded
                say_at = time.monotonic() + min(SAY_STOPPING_AFTER, self.stop_timeout / 2)
            if self.relay.kill_now:
                kill_at = 0.0
            now = time.monotonic()
            if say_at is not None and now >= say_at:
                say_at = None
                self._say_stopping()
            if kill_at is not None and now >= kill_at:
                for w in self.live():
                    w.signal_group(signal.SIGKILL)
                kill_at = float("inf")
            if not self.live():
                if drain_until is None:
                    self._kill_leftovers()
                    drain_until = now + DRAIN_SECONDS
                elif now >= drain_until:
                    break
            deadlines = [t for t in (kill_at, drain_until, say_at) if t is not None and t != float("inf")]
            unwatched = [
                (w, spec)
                for w, spec in zip(self.workers, self.specs)
                if w.returncode is None and w.pidfd is None
            ]
            if unwatched:
                deadlines.append(now + POLL_SECONDS)
            watch = self.watchdog if failure is None and not outside and kill_at is None else None
            if watch and watch.due() is not None:
                deadlines.append(watch.due())  # type: ignore[arg-type]
            deadlines += [d for m in self.merged if (d := m.next_deadline()) is not None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            events = sel.select(timeout)
            # a worker found exited by polling (it has no pidfd) comes as a stand-in key
            events += [
                (selectors.SelectorKey(-1, -1, selectors.EVENT_READ, target), selectors.EVENT_READ)
                for target in unwatched
                if target[0].poll()
            ]
            for key, _ in events:
                target = key.data
                if target is None:
                    self.relay.drain()
                elif target == "stop":
                    sel.unregister(key.fileobj)  # self.stop_fd
                    if failure is None and self.relay.stop_signal is None:
                        outside = True
                        kill_at = self._stop_group(self.stop_signal() if self.stop_signal else signal.SIGTERM)
                elif isinstance(target, StreamSink):
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:  # drained already by _fail
                        continue
                    if data:
                        target.feed(data)
                        if self.watchdog:
                            self.watchdog.output(time.monotonic())
                    else:
                        sel.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]  # registered as a worker's pipe (a file)
                        open_pipes -= 1
                else:
                    w, spec = target
                    if w.pidfd is not None:
                        sel.unregister(w.pidfd)
                    # Exits after a stop was requested are its consequence, not a cause.
                    stopping = failure is not None or outside or self.relay.stop_signal is not None
                    if self.watchdog:  # a rank that finished is progress (rank 0 may save alone)
                        self.watchdog.output(time.monotonic())
                    if w.reap() != 0 and not stopping:
                        failure = self._fail(w, spec)
                        kill_at = self._stop_group(signal.SIGTERM)
            for m in self.merged:
                m.due(time.monotonic())
            if watch and self.relay.stop_signal is None and failure is None and not outside:
                t = time.monotonic()
                due = watch.due()
                if due is not None and t >= due and watch.check(t):
                    failure = self._hang(watch, t)
                    if failure is not None:
                        if self.on_failure:
                            self.on_failure(failure)
                        kill_at = self._stop_group(signal.SIGTERM)
        return AttemptResult(failure, self.relay.stop_signal)

    def _say_stopping(self) -> None:
        """Once, SAY_STOPPING_AFTER s after a stop signal (workers that obey it are gone
        by then and nothing is said): workers that ignore it keep the launcher waiting up
        to ``stop_timeout``, so say so and how to cut it short (mpirun says it too)."""
        n = len(self.live())
        if n and self.stop_timeout > 0 and not self.relay.kill_now:
            hint = "; Ctrl-C again to kill now" if self.relay.stop_signal == signal.SIGINT else ""
            say(f"stopping {n} worker{'s' if n > 1 else ''} (up to {self.stop_timeout:g} s{hint})")

    def _stop_group(self, sig: int) -> float:
        """Signal every live worker's group; return when SIGKILL is due."""
        for w in self.live():
            w.signal_group(sig)
        return time.monotonic() + self.stop_timeout

    def _fail(self, w: WorkerProcess, spec: LaunchSpec) -> WorkerFailure:
        # The traceback was written before the exit; read what the pipe still holds.
        try:
            while data := os.read(w.stderr.fileno(), 1 << 16):
                spec.stderr.feed(data)
        except (BlockingIOError, ValueError):  # ValueError: pipe already closed at EOF
            pass
        failure = w.failure(spec.stderr.tail_text(), spec.error_file)
        if self.watchdog and self.watchdog.reads_stacks():
            # where the others were when it failed: before the group is stopped
            ex = self.watchdog.explain(self._live_pids(), None, f"rank {w.slot.rank} {failure.how}")
            if ex is not None:
                failure = dataclasses.replace(failure, stacks=ex.stacks)
        if self.on_failure:
            self.on_failure(failure)
        return failure

    def _live_pids(self) -> dict[int, int]:
        return {w.slot.rank: w.pid for w in self.live()}

    def _hang(self, watch: Watchdog, now: float) -> WorkerFailure | None:
        """No rank progressed for the hang timeout: explain where each was (the stacks),
        and make that the group's failure, named after the odd rank out. None: this
        node's ranks all wait alike and another node may hold the odd one out: it gets
        a moment to claim the hang first (watch.defer)."""
        pids = self._live_pids()
        if not pids:  # every worker has exited (the pipes drain): no hang to explain
            return None
        ex = watch.deferred_with or watch.explain(pids, watch.idle(now))
        if ex is not None and ex.alike and watch.defer(now):
            watch.deferred_with = ex  # read and shown once
            return None
        from ..rounds import WorkerFailure

        odd = ex.odd if ex is not None and ex.odd is not None else min(pids)
        w, spec = next((w, s) for w, s in zip(self.workers, self.specs) if w.slot.rank == odd)
        return WorkerFailure(
            odd,
            w.slot.local_rank,
            w.slot.node_rank,
            socket.gethostname(),
            w.pid,
            1,
            time.time(),
            spec.stderr.tail_text(),
            hang=True,
            cause=ex.cause if ex is not None else f"hang: no rank progressed for {watch.timeout:g} s",
            stacks=ex.stacks if ex is not None else "",
        )

    def _kill_leftovers(self) -> None:
        # Processes a worker spawned into its own group outlive it: the group is the job's;
        # so are the processes that left it (and the worker's session) and were adopted.
        for w in self.workers:
            w.signal_group(signal.SIGKILL)
        self.guard.kill_strays()

    def _kill_all_and_reap(self) -> None:
        for w in self.workers:
            if w.returncode is None:
                w.signal_group(signal.SIGKILL)
                w.reap()
        self.guard.kill_strays()
        for w in self.workers:
            self.guard.forget(w.pid)
