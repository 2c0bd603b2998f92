"""Signals sent to the launcher are forwarded to every worker's process group.

Workers live in their own sessions, so a terminal's Ctrl-C reaches only the launcher;
relaying it keeps mpirun/torchrun's behaviour (the workers see the signal). SIGINT,
SIGTERM, SIGHUP and SIGQUIT also mean "stop the job, no restart"; a second SIGINT
escalates to SIGKILL at once. SIGUSR1/SIGUSR2 are only forwarded.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Iterable

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
STOPPING = frozenset((signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT))


class SignalRelay:
    """Installs handlers (main thread only) until ``restore()``. ``targets()`` returns the
    live WorkerProcess objects to forward to. ``wakeup_fd`` becomes readable on every
    signal so an event loop in select() notices at once."""

    def __init__(self, targets: Callable[[], Iterable]):
        self.targets = targets
        self.stop_signal: int | None = None
        self.sigints = 0
        self.wakeup_fd, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self.wakeup_fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._w)
        self._old = {s: signal.signal(s, self._handle) for s in FORWARDED}

    @property
    def kill_now(self) -> bool:
        return self.sigints >= 2

    def _handle(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT:
            self.sigints += 1
        if signum in STOPPING and self.stop_signal is None:
            self.stop_signal = signum
        sig = signal.SIGKILL if self.kill_now else signum
        for w in self.targets():
            w.signal_group(sig)

    def drain(self) -> None:
        try:
            while os.read(self.wakeup_fd, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self.wakeup_fd)
        os.close(self._w)
