"""Signals sent to the launcher are forwarded to every worker's process group.

Workers live in their own sessions, so a terminal's Ctrl-C reaches only the launcher;
relaying it keeps mpirun/torchrun's behaviour (the workers see the signal). SIGINT,
SIGTERM, SIGHUP and SIGQUIT also mean "stop the job, no restart"; a second SIGINT
escalates to SIGKILL at once. SIGUSR1/SIGUSR2 are only forwarded.

Except in a launcher that is a task of a Slurm job step (``srun ... distlaunch run``, the
agents of an allocation): Slurm delivers a signal sent to the step (``scancel --signal``,
``sbatch --signal=USR1@T``, a signal ``srun`` relays) to every process of the step, the
workers included (proctrack/cgroup and proctrack/linuxproc track the whole process tree),
so forwarding SIGUSR1/SIGUSR2 again would run each worker's handler twice; there they are
not forwarded. (proctrack/pgid signals only the task's process group, which the workers
are not in; Slurm's documentation advises against it.)

While no workers run (connecting to the store, rendezvous, the exit barrier) the agent
waits inside ``interruptible()``: there a stopping signal raises LaunchInterrupted in
the main thread at once, whatever call it is blocked in (Python retries a system call
a signal interrupted unless the handler raises, so a flag alone would wait out the call);
inside threading's or concurrent.futures' code (a thread's start, a pool's submit), which
abandoned half-way leaves a thread they no longer know, it is raised as that call returns.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType

from ..errors import LaunchInterrupted
from ..workerenv import in_slurm_step

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the fast lane's path)

if TYPE_CHECKING:
    from typing import Protocol

    class SignalTarget(Protocol):
        """What a relay forwards to (``process.WorkerProcess``)."""

        def signal_group(self, sig: int) -> None: ...


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
STOPPING = frozenset((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT))


def parse_signals(text: str | None) -> tuple[signal.Signals, ...]:
    """torchrun's ``--signals-to-handle SIGTERM,SIGUSR1,...``: any signal the launcher can
    catch, with or without ``SIG``. Raises ValueError naming a bad entry."""
    out = []
    for raw in (text or "").split(","):
        name = raw.strip().upper()
        if not name:
            continue
        name = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal.Signals, name, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP) or name.startswith("SIG_"):
            raise ValueError(f"--signals-to-handle {raw.strip()!r} is not a signal the launcher can catch")
        out.append(sig)
    return tuple(out)


class SignalRelay:
    """Installs handlers (main thread only) until ``restore()``. ``targets()`` returns the
    live WorkerProcess objects to forward to. ``wakeup_fd`` becomes readable on every
    signal so an event loop in select() notices at once.

    ``stop_signal`` is the first stopping signal received (its number decides the exit
    code, 128+N); ``pending`` is a stopping signal nobody has acted on yet (a worker
    group acts on it by stopping its workers, then clears it with ``acted()``).

    SIGUSR1/SIGUSR2 are not forwarded in a Slurm step task (``in_slurm_step``: Slurm
    already delivered them to the workers); ``forward_all`` forwards them regardless.
    """

    def __init__(
        self,
        targets: Callable[[], Iterable[SignalTarget]],
        forward_all: bool | None = None,
        also_stop: Iterable[int] = (),
    ) -> None:
        self.targets = targets
        if forward_all is None:
            forward_all = not in_slurm_step()
        self.forward_all = forward_all
        self.stop_signal: int | None = None
        self.pending: int | None = None
        self.sigints = 0
        self._raising = False
        self.wakeup_fd, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self.wakeup_fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._w)
        # --signals-to-handle beyond FORWARDED: as in torchrun, each stops the job and is
        # passed to the workers
        extra = frozenset(also_stop) - frozenset(FORWARDED)
        self._stopping = STOPPING | extra
        self._old: dict[int, signal._HANDLER] | None = {
            s: signal.signal(s, self._handle) for s in (*FORWARDED, *sorted(extra))
        }

    @property
    def kill_now(self) -> bool:
        return self.sigints >= 2

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.sigints += 1
        if signum in self._stopping:
            if self.stop_signal is None:
                self.stop_signal = signum
            self.pending = signum
        sig = signal.SIGKILL if self.kill_now else signum
        if signum in self._stopping or self.forward_all:
            for w in self.targets():
                w.signal_group(sig)
        if self._raising and signum in self._stopping:
            self._raising = False  # once: the code that handles it must not be interrupted
            unfinished = _in_threading(_frame)
            if unfinished is not None:  # raised once that call has returned
                _raise_at_return(unfinished, self._interrupted())
                return
            raise self._interrupted()

    def _interrupted(self) -> LaunchInterrupted:
        assert self.stop_signal is not None  # set by the first stopping signal, before pending
        return LaunchInterrupted(self.stop_signal)

    def acted(self) -> None:
        """The pending stopping signal has been handled (the workers were stopped)."""
        self.pending = None

    def interruptible(self) -> Interruptible:
        """Run the block so that a stopping signal raises LaunchInterrupted (128 + the
        first stopping signal) at once, wherever the main thread is in it; a signal still
        pending on entry raises at entry. Only for code that may be abandoned at any
        point (a store call so interrupted closes its connection). Main thread only."""
        return Interruptible(self)

    def drain(self) -> None:
        try:
            while os.read(self.wakeup_fd, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self) -> None:
        """Put back the handlers found at construction. Idempotent."""
        if self._old is None:
            return
        for s, old in self._old.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self.wakeup_fd)
        os.close(self._w)
        self._old = None


class Interruptible:
    """``SignalRelay.interruptible``'s context manager (a class: ``contextlib``, ~0.5 ms,
    is not loaded before the fast lane's first spawn)."""

    __slots__ = ("relay",)

    def __init__(self, relay: SignalRelay) -> None:
        self.relay = relay

    def __enter__(self) -> None:
        if self.relay.pending is not None:
            raise self.relay._interrupted()
        self.relay._raising = True

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.relay._raising = False


def _in_threading(frame: FrameType | None) -> FrameType | None:
    """The outermost frame of threading's or concurrent.futures' code on the main
    thread's stack, if any: such a call abandoned half-way (``Thread.start`` between
    starting the thread and recording it; a pool's ``submit`` between the two) leaves a
    running thread the module no longer knows (a KeyError from ``Thread.start``, a
    thread nobody joins). None when neither is loaded."""
    threading = sys.modules.get("threading")
    if threading is None:
        return None
    futures = sys.modules.get("concurrent.futures")
    pool = os.path.dirname(futures.__file__) + os.sep if futures and futures.__file__ else None
    outermost = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name == threading.__file__ or (pool and name.startswith(pool)):
            outermost = frame
        frame = frame.f_back
    return outermost


def _raise_at_return(frame: FrameType, exc: BaseException) -> None:
    """Raise ``exc`` in the main thread as ``frame`` returns (from the profile hook on
    its return event, which Python propagates to the frame's caller), then put back
    the profile function found."""
    previous = sys.getprofile()

    def hook(f: FrameType, event: str, arg: object) -> None:
        if previous is not None:
            previous(f, event, arg)  # type: ignore[arg-type]
        if f is frame and event == "return":
            sys.setprofile(previous)
            raise exc

    sys.setprofile(hook)
