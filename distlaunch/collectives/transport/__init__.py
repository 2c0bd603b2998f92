"""The transport interface: asynchronous, matched sends and receives of byte buffers
between global ranks.

A transport delivers each message (a :class:`~distlaunch.collectives.wire.Header` plus payload) to the peer,
in order per (sender, receiver) pair. Receives are *posted* with a match key
``(kind, group, seq)`` and a source rank (``None``: any source, point-to-point only);
an arriving message goes straight into the buffer of the first matching posted
receive, or is kept as an "unexpected" message (one copy) until a receive is posted.

TCP (:mod:`.tcp`) is the one implementation; the TCP algorithms (:mod:`.algorithms`)
use it through :class:`~distlaunch.collectives.context.OpContext`. Shared memory is not a Transport: it is a
phase-synchronised segment per group (:mod:`.shm`) with its own algorithms, and the
choice between them is made per group by a :class:`~distlaunch.collectives.algorithms.backend.Backend`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import Any

from ..wire import Header

# check(header) -> None if the message is acceptable, else the exception to fail with
Check = Callable[[Header], BaseException | None]


_EVENTS = threading.Lock()  # creates a Request's event, or completes it, atomically


class Request:
    """One posted send or receive. Completed (``done``) by the transport, successfully or
    with ``error``. For receives, ``header`` is the matched message's header (its
    ``src`` names the sender when the receive was for any source). ``local``: the
    shared-memory links (:mod:`.shm_p2p`) whose progress completes it, when its peer is
    on this node (its waits then drive that progress)."""

    __slots__ = (
        "is_send",
        "peer",
        "key",
        "buf",
        "check",
        "header",
        "error",
        "_done",
        "_event",
        "owner",
        "grank",
        "local",
    )

    # called after every completion (the shared-memory links wake their waiter with it)
    notify: Callable[[], None] | None = None

    def __init__(
        self,
        is_send: bool,
        peer: int | None,
        key: tuple,
        buf: memoryview | None,
        check: Check | None = None,
        owner: Any = None,
    ):
        self.is_send = is_send
        self.peer = peer  # global rank, or None for an any-source receive
        self.key = key  # (kind, group, seq)
        self.buf = buf  # memoryview of bytes (receives of any size: None until matched)
        self.check = check
        self.header: Header | None = None
        self.error: BaseException | None = None
        self._done = False
        self._event: threading.Event | None = None  # made by the first blocking wait
        self.owner = owner  # e.g. the group id, for failing a whole group
        self.grank = -1  # the peer's group rank (set by OpContext, for its messages)
        self.local: Any = None

    @property
    def done(self) -> bool:
        return self._done

    def complete(self, error: BaseException | None = None) -> None:
        with _EVENTS:
            if self._done:
                return
            self.error = error
            self._done = True
            ev = self._event
        if ev is not None:
            ev.set()
        notify = Request.notify
        if notify is not None:
            notify()

    def wait(self, timeout: float | None) -> bool:
        """Block up to ``timeout`` seconds (None: forever); True when completed
        (successfully or not: check ``error``)."""
        if self._done:
            return True
        with _EVENTS:
            if self._done:
                return True
            ev = self._event
            if ev is None:
                ev = self._event = threading.Event()
        return ev.wait(timeout)


class Transport(abc.ABC):
    """Point-to-point message passing between the ranks of one job (global ranks)."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def isend(
        self, peer: int, header: Header, payload: memoryview, deadline: float, owner: Any = None
    ) -> Request:
        """Queue ``header`` + ``payload`` for ``peer``. ``payload`` must stay unchanged
        until the request completes (no copy is made). May block up to ``deadline``
        (``time.monotonic()`` seconds) to establish the connection."""

    @abc.abstractmethod
    def irecv(
        self,
        peer: int | None,
        key: tuple,
        buf: memoryview | None,
        check: Check | None = None,
        owner: Any = None,
    ) -> Request:
        """Post a receive of the next message from ``peer`` (None: any source) matching
        ``key`` into ``buf``. A message whose payload length differs from ``len(buf)``
        or that ``check`` rejects fails the request (the payload is discarded).
        ``buf=None`` receives a message of any length: the completed request's ``buf``
        is then a new memoryview of the payload."""

    @abc.abstractmethod
    def lost(self, peer: int) -> str | None:
        """Why ``peer`` is known to be lost, or None."""

    @abc.abstractmethod
    def take_leftovers(self, key: tuple) -> list:
        """Remove and return the headers of unmatched messages with ``key``."""

    @abc.abstractmethod
    def cancel(self, req: Request) -> None:
        """Withdraw a posted receive that has not started to match."""

    @abc.abstractmethod
    def fail_owner(self, owner: Any, error: BaseException) -> None:
        """Fail every pending request of ``owner`` with ``error`` (group abort)."""

    @abc.abstractmethod
    def send_control(self, peer: int, header: Header, payload: bytes, deadline: float) -> bool:
        """Best-effort small control message (abort, status); False if undeliverable."""

    @abc.abstractmethod
    def query_status(self, peers: list, group: int, deadline: float) -> dict:
        """Ask ``peers`` for their progress in ``group``; returns {peer: (seq, op) or None
        when unreachable}. Used to name the ranks that did not arrive after a timeout."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every connection and stop background work."""
