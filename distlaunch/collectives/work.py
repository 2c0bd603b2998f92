"""``Work`` handles of asynchronous operations, and the executor that runs a group's
async collectives in order.

A Work completes exactly once, with a result or an error; ``wait`` blocks, the other
queries do not. :class:`RequestWork` completes with one transport request
(point-to-point operations); :class:`Executor` completes the Works of a group's
``async_op=True`` collectives on one helper thread (the torch backend's groups use it
too, with their torch Works).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import progress
from .context import to_seconds
from .errors import CollectiveError, CollectiveTimeoutError, PeerLostError
from .transport import Request


def _progressed() -> bool:
    """A point-to-point request completed: progress for --hang-timeout (one word in the
    rank's record; a no-op outside distlaunch). True, for the caller's return."""
    progress.heartbeat()
    return True


class Work:
    """Handle of an operation started with ``async_op=True`` / ``isend`` / ``irecv``
    (as ``torch.distributed.Work``).

    ``wait(timeout=None)`` blocks until the operation finished (``timeout``: seconds or
    timedelta, default the group timeout) and returns True; it re-raises the operation's
    CollectiveError, or raises CollectiveTimeoutError if it is still running after
    ``timeout`` (the operation itself keeps its own deadline). ``is_completed()`` never
    blocks.
    """

    def __init__(self, name: str, timeout: float | None):
        self._name = name
        self._timeout = timeout
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._result: Any = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Complete the Work (called once, by whoever runs the operation)."""
        self._result, self._error = result, error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        t = self._timeout if timeout is None else to_seconds(timeout)
        if not self._event.wait(t):
            raise CollectiveTimeoutError(f"{self._name} did not complete within {t:g} s")
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> Any:
        """Wait, then return the operation's result (the source rank for irecv)."""
        self.wait()
        return self._result

    def cancel(self) -> None:
        """Withdraw the operation if it has not started (only point-to-point receives can)."""


class RequestWork(Work):
    """Work of one point-to-point request; completes with the transport request.

    ``on_done(req, timed_out)``: on a timeout, the message of the CollectiveTimeoutError;
    otherwise the result, or raises the operation's CollectiveError. ``spin``: busy-poll
    the shared-memory links before sleeping (False when the caller just did).
    """

    def __init__(
        self,
        name: str,
        timeout: float,
        req: Request,
        transport: Any,
        on_done: Callable[[Request, bool], Any],
        spin: bool = True,
    ):
        super().__init__(name, timeout)
        self._spin = spin
        self._req = req
        self._transport = transport
        self._on_done = on_done
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        req = self._req
        if not req.done and req.local is not None:
            req.local.progress()
        return req.done

    def _wait_req(self, t: float | None) -> bool:
        """Wait for the request: on the shared-memory links driving it (PeerLostError
        when its peer's process is gone), else on its event."""
        req = self._req
        if req.local is None or req.done:
            return req.wait(t) and _progressed()
        deadline = time.monotonic() + (t if t is not None else 1e9)
        try:
            return req.local.wait(lambda: req.done, deadline, (req.peer,), self._spin) and _progressed()
        except PeerLostError as e:
            if not req.is_send:
                self._transport.cancel(req)
            req.complete(e)
            return True

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        t = self._timeout if timeout is None else to_seconds(timeout)
        with self._lock:
            if not self._event.is_set():
                if not self._wait_req(t):
                    raise CollectiveTimeoutError(self._on_done(self._req, True))
                try:
                    self.finish(self._on_done(self._req, False))
                except CollectiveError as e:
                    self.finish(error=e)
        if self._error is not None:
            raise self._error
        return True

    def cancel(self) -> None:
        if not self._req.done and not self._req.is_send:
            self._transport.cancel(self._req)


class Executor:
    """Runs a group's async operations in submission order on one daemon thread
    (started on first use). Used by the runtime's groups and the torch backend's.

    A job is ``fn`` and the Work its outcome completes: ``work.finish(fn())``, or
    ``work.finish(error=e)`` with whatever ``fn`` raised. Only one thread submits to an
    executor (the group's caller: program order is the operations' order).
    """

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # jobs submitted and not finished (only the submitting thread reads it unlocked)
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def idle(self) -> bool:
        """Nothing queued or running: the caller may run an operation in its own thread.
        Read without the lock: only the submitting thread raises ``pending``, so a 0 it
        reads cannot become stale."""
        return not self.pending and not self._closed

    def submit(self, fn: Callable[[], Any], work: Any, inline: bool = False) -> bool:
        """Queue ``fn`` (its outcome completes ``work``, a :class:`Work` or anything with
        its ``finish``) and return True; with ``inline``, when nothing is pending (the
        thread finished meanwhile), queue nothing and return False: the caller runs
        ``fn`` itself. Raises CollectiveError after :meth:`close`."""
        with self._cv:
            if self._closed:
                raise CollectiveError(f"{self._name} was shut down")
            if inline and self.pending == 0:
                return False
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((fn, work))
        return True

    def stop(self) -> None:
        """Let the thread exit once the queued jobs ran, and wait for it (up to 5 s) so
        that no thread of ours still holds user buffers (e.g. torch tensors) when the
        interpreter shuts down. A later submit starts a new thread."""
        with self._cv:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def close(self) -> None:
        """As :meth:`stop`, and refuse later submits (CollectiveError)."""
        with self._cv:
            self._closed = True
        self.stop()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, work = job
            try:
                work.finish(fn())
            except BaseException as e:  # delivered to whoever waits on the Work
                work.finish(error=e)
            del job, fn, work  # do not keep the last operation's buffers alive
            with self._cv:
                self.pending -= 1
                self._cv.notify_all()

    def drain(self) -> None:
        """Block until every submitted job finished (each has its own deadline)."""
        with self._cv:
            self._cv.wait_for(lambda: self.pending == 0)
