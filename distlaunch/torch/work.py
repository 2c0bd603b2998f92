"""torch ``Work`` handles of the backend's operations (see the package docstring)."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.futures import Future

from ..collectives.errors import CollectiveTimeoutError
from .errors import DistlaunchTimeoutError, _as_torch_error

# torch's stubs give Work's methods pybind signatures that a Python override taking
# torch's C++ signature cannot match; the trampoline only ever calls the C++ signature,
# so the base is typed loosely
_TorchWork: Any = dist._Work


class DistlaunchWork(_TorchWork):
    """torch ``Work`` of one operation: ``wait(timeout=None)`` blocks until it finished
    (a timedelta > 0 bounds the wait: DistlaunchTimeoutError; the operation keeps its own
    deadline, the group timeout) and re-raises its error; ``get_future()`` is a
    ``torch.futures.Future`` completed with the output tensors (or, on failure, a
    RuntimeError carrying the backend error's class name and message, as torch's own
    backends' futures raise: a future's error must reach C++ readers such as DDP's);
    ``is_completed()`` never blocks; ``_source_rank()`` is the sender's group rank of a
    receive."""

    def __init__(self, name: str, group: str, outputs: list) -> None:
        super().__init__()
        self._name = name  # with group: formatted only for errors (this is per call)
        self._group = group
        self._outputs = outputs
        self._done = False
        # completed by another thread (an operation run in the calling thread is a
        # _DoneWork, complete when created: no event, no lock)
        self._event = threading.Event()
        self._lock: Any = threading.Lock()
        self._error: BaseException | None = None
        self._future: Future | None = None
        self._source = -1

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            self._done = True
            fut = self._future
        self._event.set()
        if fut is not None:
            _complete(fut, self._outputs, error)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Complete the Work (the executor's call; ``result`` is ignored: a Work's
        value is its output tensors), ``error`` as torch sees it."""
        self._finish(None if error is None else _as_torch_error(error))

    def _wait_done(self, timeout: float | None) -> None:
        if not self._done and not self._event.wait(timeout):
            raise DistlaunchTimeoutError(
                f"distlaunch: {self._name} on {self._group} did not complete within {timeout:g} s"
            )

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if not self._done:
            self._wait_done(_seconds(timeout))
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done:
                    _complete(self._future, self._outputs, self._error)
            fut = self._future
        # A C++ reader (DDP's reducer) takes set_exception's error for a plain result
        # object (it looked for tensors in it and crashed): a chained future whose
        # callback re-raises carries a C++ error, which its wait() throws (as a
        # RuntimeError with the backend's message, as gloo's futures raise)
        return fut.then(_value)

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _DoneWork(DistlaunchWork):
    """Work of an operation that ran in the calling thread: complete when created (no
    event or lock; built per call, so kept to the least torch's Work needs)."""

    _done = True
    _lock: Any = contextlib.nullcontext()
    _error: BaseException | None = None
    _future: Future | None = None
    _source = -1

    def __init__(self, outputs: list, error: BaseException | None = None) -> None:
        _TorchWork.__init__(self)
        self._outputs = outputs
        if error is not None:
            self._error = error


def _value(fut: Future) -> Any:
    return fut.value()  # raises the error set_exception stored


def _complete(fut: Future, outputs: list, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(outputs)
    else:
        fut.set_exception(error)


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """None (no bound) for None or a zero timedelta (torch's kNoTimeout)."""
    if timeout is None:
        return None
    t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return t if t > 0 else None


class _P2PWork(DistlaunchWork):
    """Work of a send or receive: completes with the runtime's point-to-point request
    (``then`` runs after a successful receive, e.g. copying into a non-contiguous tensor)."""

    def __init__(
        self, name: str, group: str, outputs: list, req: Any, then: Callable[[], None] | None = None
    ) -> None:
        super().__init__(name, group, outputs)
        self._req = req
        self._then = then
        self._wait_lock = threading.Lock()

    def _wait_done(self, timeout: float | None) -> None:
        with self._wait_lock:
            if self._done:
                return
            try:
                if timeout is None:
                    result = self._req.result()  # bounded by the group timeout
                else:
                    self._req.wait(timeout)
                    result = self._req.result()
                if isinstance(result, int):
                    self._source = result
                if self._then is not None:
                    self._then()
            except CollectiveTimeoutError as e:
                if timeout is not None and not self._req.is_completed():
                    raise _as_torch_error(e) from None  # only this wait gave up
                self._req.cancel()  # a receive past the group timeout is withdrawn
                self._finish(_as_torch_error(e))
            except BaseException as e:
                self._finish(_as_torch_error(e))
            else:
                self._finish()

    def is_completed(self) -> bool:
        return self._done or self._req.is_completed()

    def get_future(self) -> Future:
        with self._lock:
            start = self._future is None and not self._done
        fut = super().get_future()
        if start:  # nobody may ever call wait(): complete the future from a helper thread
            threading.Thread(target=self._wait_quietly, name="distlaunch-p2p-future", daemon=True).start()
        return fut

    def _wait_quietly(self) -> None:
        try:
            self._wait_done(None)
        except BaseException:
            pass  # delivered through the future


def _run_now(fn: Callable[[], Any], outputs: list) -> DistlaunchWork:
    """Run ``fn`` in the calling thread; its completed Work (failed with fn's error)."""
    try:
        fn()
    except BaseException as e:  # delivered by wait() / the future, as for queued ones
        return _DoneWork(outputs, _as_torch_error(e))
    return _DoneWork(outputs)
