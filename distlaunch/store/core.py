"""The store's key-value core, without sockets: the keys and values, counters,
compare-and-set, and the requests blocked on keys that do not exist yet (a leaf module:
standard library and protocol.py's limits only).

The event loop (server.py) and the per-connection protocol (session.py) sit on top: a
session decodes a request into one call here and encodes the result; a blocked request is
a ``Waiter`` that the core hands back through ``on_ready`` when its last missing key is
written, or through ``on_timeout`` when ``expire`` passes its deadline. Single-threaded
(the server's loop thread), and nothing here blocks. Semantics follow torch's c10d
``TCPStore`` (docs/store.md).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator

from .protocol import MAX_VALUE_BYTES

_INT64 = 1 << 64


def wrap_int64(n: int) -> int:
    """``n`` wrapped to a signed 64-bit integer, as C++ ``int64_t`` arithmetic in torch's
    TCPStore ``add`` does."""
    return (n + (1 << 63)) % _INT64 - (1 << 63)


class Waiter:
    """A blocked request (GET, WAIT, MULTI_GET) of ``owner``. ``op`` is opaque to the core
    (the session's request type). ``registered``: the keys it is parked on, the ones
    missing so far (its missing-key count is ``len(registered)``): a write touches only
    the waiters of its own key, and a waiter is looked at as a whole (its other keys)
    only once that set is empty, so the work a write causes never depends on how many
    keys its waiters wait for. ``done``: answered, timed out or retired."""

    __slots__ = ("owner", "op", "keys", "registered", "done")

    def __init__(self, owner: object, op: int, keys: list[bytes]) -> None:
        self.owner = owner
        self.op = op
        self.keys = keys
        self.registered: set[bytes] = set()
        self.done = False


def _ignore(w: Waiter) -> None:
    pass


class KeyValueCore:
    """The distlaunch key space: ``data`` maps keys to values (bytes); waiters are indexed
    by key. ``on_ready(w)`` is called, once, when every key of ``w`` exists (from inside
    the write that stored the last one; ``w`` is already retired); ``on_timeout(w)`` when
    ``expire`` finds ``w``'s deadline passed (``w`` retired; ``missing(w.keys)`` says
    which keys it still lacked). ``max_value``: the largest value ``append`` may build,
    in bytes. Deadlines are ``time.monotonic()`` seconds; nothing reads a clock here."""

    def __init__(
        self,
        on_ready: Callable[[Waiter], object] = _ignore,
        on_timeout: Callable[[Waiter], object] = _ignore,
        max_value: int = MAX_VALUE_BYTES,
    ) -> None:
        self.data: dict[bytes, bytes] = {}  # never rebound: the session's fast path keeps it
        self.waiters: dict[bytes, dict[Waiter, None]] = {}  # key -> its waiters, in order
        self._heap: list[tuple[float, int, Waiter]] = []  # (deadline, seq, waiter)
        self._seq = 0
        self._on_ready = on_ready
        self._on_timeout = on_timeout
        self.max_value = max_value

    # --- writes ------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` and wake the waiters it completes."""
        self.data[key] = value
        if key in self.waiters:
            self._wake(key)

    def multi_set(self, pairs: Iterable[tuple[bytes, bytes]]) -> None:
        """``put`` each pair in order."""
        for k, v in pairs:
            self.put(k, v)

    def add(self, key: bytes, amount: int) -> int:
        """Add ``amount`` to the integer stored under ``key`` (0 when missing), with int64
        wrap-around; store and return the sum. Raises ValueError (nothing stored) when the
        stored value is not an integer."""
        old = self.data.get(key)
        new = wrap_int64((0 if old is None else int(old)) + amount)
        self.put(key, str(new).encode("ascii"))
        return new

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """Store ``desired`` when the value is ``expected`` (a missing key matches only
        ``b""``); return the value now stored, or ``expected`` when the key is missing and
        ``expected`` is not empty (torch TCPStore's quirk: nothing is stored then)."""
        cur = self.data.get(key)
        if cur is None:
            if expected == b"":
                self.put(key, desired)
                return desired
            return expected
        if cur == expected:
            self.put(key, desired)
            return desired
        return cur

    def append(self, key: bytes, value: bytes) -> bool:
        """Append ``value`` to the value under ``key`` (created when missing). False, and
        nothing stored, when the result would exceed ``max_value`` bytes."""
        old = self.data.get(key, b"")
        if len(old) + len(value) > self.max_value:
            return False
        self.put(key, old + value)
        return True

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; whether it existed. Its waiters stay parked (they wait for the
        key to be written again)."""
        return self.data.pop(key, None) is not None

    # --- reads -------------------------------------------------------------------------------

    def check(self, keys: Iterable[bytes]) -> bool:
        """Whether every key exists."""
        data = self.data
        return all(k in data for k in keys)

    def missing(self, keys: Iterable[bytes]) -> Iterator[bytes]:
        """The keys that do not exist, in order (lazily)."""
        data = self.data
        return (k for k in keys if k not in data)

    # --- waiters and deadlines -------------------------------------------------------------------

    def block(self, owner: object, op: int, keys: list[bytes], deadline: float = math.inf) -> Waiter:
        """Park a request of ``owner`` on its missing keys until they all exist
        (``on_ready``) or ``deadline`` passes (``on_timeout`` from ``expire``; ``inf``: never).
        The caller has checked that a key is missing."""
        w = Waiter(owner, op, keys)
        self._register(w)
        if not math.isinf(deadline):
            self._seq += 1
            heapq.heappush(self._heap, (deadline, self._seq, w))
        return w

    def retire(self, w: Waiter) -> None:
        """Forget ``w`` (answered, timed out, or its connection closed)."""
        w.done = True
        waiters = self.waiters
        for k in w.registered:
            lst = waiters.get(k)
            if lst is not None:
                lst.pop(w, None)
                if not lst:
                    del waiters[k]
        w.registered.clear()

    def next_deadline(self) -> float:
        """The earliest deadline of a parked waiter (``inf`` when none is pending)."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def expire(self, now: float) -> None:
        """Time out (``on_timeout``) every waiter whose deadline is ``now`` or earlier."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            w = heapq.heappop(heap)[2]
            if not w.done:
                self.retire(w)
                self._on_timeout(w)

    def clear_waiters(self) -> None:
        """Drop every waiter and deadline without answering (the server is shutting down)."""
        self.waiters.clear()
        self._heap.clear()

    def _register(self, w: Waiter) -> bool:
        """Park ``w`` on each of its keys that does not exist; False when none is missing."""
        data, waiters = self.data, self.waiters
        for k in w.keys:
            if k not in data and k not in w.registered:
                w.registered.add(k)
                waiters.setdefault(k, {})[w] = None
        return bool(w.registered)

    def _wake(self, key: bytes) -> None:
        lst = self.waiters.pop(key, None)
        if not lst:
            return
        for w in lst:
            registered = w.registered
            registered.discard(key)
            # others still missing, or (once) a key it counted was deleted since: park again
            if w.done or registered or self._register(w):
                continue
            self.retire(w)
            self._on_ready(w)
