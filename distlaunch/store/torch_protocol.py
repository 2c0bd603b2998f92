"""torch's ``TCPStore`` wire protocol, server side, for torch's own clients (a leaf module:
standard library, errors and core.py's int64 arithmetic only).

The store server speaks it on its distlaunch port when started with ``torch_clients=True``
(docs/security.md, "torch's TCPStore clients on the store port"), so that
``init_process_group(init_method="env://")`` with ``MASTER_PORT`` = that port and
``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a ``TCPStore`` client, as under
torchrun) finds a working store there. Those clients carry
no secret: they get a key space of their own (``TorchKeySpace``), never the distlaunch keys.

The protocol, as torch 2.13 speaks it (torch/csrc/distributed/c10d/TCPStore.cpp: the
client; TCPStoreLibUvBackend.cpp and TCPStoreBackend.cpp: the libuv and classic servers):

* No framing. A query is one byte (``QueryType``) followed by its arguments, all
  little-endian (the client writes native integers; every platform torch ships is
  little-endian): u32, i64, strings and byte strings as a u64 length + the bytes, key
  lists as a u64 count + that many strings.
* The client's first query is ``VALIDATE`` + u32 0x3C85F7CE, then ``PING`` + u32 nonce
  (answered with the same u32); that is how the server tells a torch client from a
  distlaunch one (``VALIDATE_PREFIX``).
* ``SET``, ``APPEND``, ``MULTI_SET``, ``QUEUE_PUSH`` are not answered. ``GET`` and
  ``MULTI_GET`` answer with byte strings (a missing key gives an empty one, as libuv's
  server; the client always waits for the keys first). ``ADD``, ``DELETE_KEY`` (0 or 1),
  ``GETNUMKEYS``, ``QUEUE_LEN`` answer an i64; ``CHECK`` one byte (0 READY, 1 NOT_READY);
  ``COMPARE_SET`` the byte string now stored (torch's quirk: ``expected`` when the key is
  missing and ``expected`` is not empty).
* ``WAIT`` (and ``BARRIER``) answer one byte, 0 STOP_WAITING, once every key exists. The
  server has no deadline: the client waits with its own timeout, then sends
  ``CANCEL_WAIT``, answered 1 WAIT_CANCELED (after a STOP_WAITING already on its way, if
  the keys arrived meanwhile). So a connection's later queries are handled while a wait
  is pending.
* ``QUEUE_POP`` answers an i64 queue length, then the popped byte string if it was not
  empty; ``LIST_KEYS`` an i64 count and the keys. The queue queries exist on the libuv
  server only (torch's client refuses them with ``use_libuv=False``); served here.
* Keys carry the client's ``/`` prefix (``init/`` is the client's worker counter).

Semantics and limits follow the libuv server (torch's default): keys up to 8 KiB, values
up to 8 MiB, 128 Ki keys per query; a query breaking them, an unknown query type, an
``ADD`` on a value ``std::stoll`` cannot read, or anything but ``VALIDATE`` first closes
that one connection, as torch does. On top (torch has no limits there): every byte held
for the torch key space (stored keys, values, queues, pending waits, partly received
queries, replies not sent yet) counts against one budget, charged at what Python holds in
memory for it (object headers included, not just the bytes on the wire); a query that would
exceed it closes its connection (GET, MULTI_GET and LIST_KEYS are refused before their reply
is built). MULTI_GET and LIST_KEYS replies are built a piece at a time (``Chunked``), so
one of them (hundreds of MB, millions of keys) never holds the server's loop for long.
"""

from __future__ import annotations

import re
import struct
from collections import deque
from collections.abc import Callable
from itertools import repeat
from typing import Any

from ..errors import StoreProtocolError
from .core import wrap_int64

MAGIC = 0x3C85F7CE
VALIDATE_PREFIX = b"\x00" + struct.pack("<I", MAGIC)  # the 5 bytes a torch client sends first

# QueryType, in TCPStoreBackend.hpp's order
(
    VALIDATE,
    SET,
    COMPARE_SET,
    GET,
    ADD,
    CHECK,
    WAIT,
    GETNUMKEYS,
    DELETE_KEY,
    APPEND,
    MULTI_GET,
    MULTI_SET,
    CANCEL_WAIT,
    PING,
    QUEUE_PUSH,
    QUEUE_POP,
    QUEUE_LEN,
    LIST_KEYS,
    BARRIER,
) = range(19)

READY, NOT_READY = b"\x00", b"\x01"  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"  # WaitResponseType

# The libuv server's limits (MAX_STRING_LEN, MAX_PAYLOAD_LEN, MAX_KEY_COUNT).
MAX_KEY_BYTES = 8 * 1024
MAX_VALUE_BYTES = 8 * 1024 * 1024
MAX_KEYS_PER_QUERY = 128 * 1024
# Bytes charged on top of the key and value lengths, sized from tracemalloc on CPython 3.11
# (tests/test_store_torch_protocol.py checks the server's RSS stays within 2x the budget):
ENTRY_OVERHEAD = 128  # a stored key or queued value: two bytes objects + a dict/deque slot
WAIT_OVERHEAD = 160  # a key a wait is registered on: the key object, set and dict entries
BLOB_OVERHEAD = 48  # a key or value of a query being parsed: a bytes object + its list slot
CHUNK_ITEMS = 4096  # keys or values per piece of a Chunked reply (about 1 ms of work)
CHUNK_BYTES = 1 << 20  # ... or bytes, whichever comes first
DEFAULT_BUDGET = 256 * 1024 * 1024

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_STOLL = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")

# argument kinds
_K_U32, _K_I64, _K_KEY, _K_VALUE, _K_KEYS, _K_PAIRS = range(6)
_SPECS: dict[int, tuple[int, ...]] = {
    VALIDATE: (_K_U32,),
    SET: (_K_KEY, _K_VALUE),
    COMPARE_SET: (_K_KEY, _K_VALUE, _K_VALUE),
    GET: (_K_KEY,),
    ADD: (_K_KEY, _K_I64),
    CHECK: (_K_KEYS,),
    WAIT: (_K_KEYS,),
    GETNUMKEYS: (),
    DELETE_KEY: (_K_KEY,),
    APPEND: (_K_KEY, _K_VALUE),
    MULTI_GET: (_K_KEYS,),
    MULTI_SET: (_K_PAIRS,),
    CANCEL_WAIT: (),
    PING: (_K_U32,),
    QUEUE_PUSH: (_K_KEY, _K_VALUE),
    QUEUE_POP: (_K_KEY,),
    QUEUE_LEN: (_K_KEY,),
    LIST_KEYS: (),
    BARRIER: (_K_KEY, _K_I64),
}


class TorchLimitError(StoreProtocolError):
    """The torch key space's byte budget would be exceeded (the connection is closed)."""


def _blob(v: bytes) -> bytes:
    return _U64.pack(len(v)) + v


class Chunked:
    """A reply made of ``head`` then each of ``items`` as a byte string, built a piece at
    a time by ``next()`` (at most CHUNK_ITEMS items or about CHUNK_BYTES bytes per piece)
    so that one huge MULTI_GET or LIST_KEYS costs the server's loop about a millisecond a
    turn. ``left``: bytes not built yet (charged to the budget until sent). The items are
    a snapshot taken when the query was handled: the reply is what torch's server would
    have answered at that moment, whatever is written meanwhile."""

    __slots__ = ("head", "items", "pos", "left")

    def __init__(self, head: bytes, items: list[bytes], size: int) -> None:
        self.head = head
        self.items = items
        self.pos = 0
        self.left = size

    def next(self) -> bytes:
        """The next piece (b"" once ``left`` is 0)."""
        items, i = self.items, self.pos
        end = min(len(items), i + CHUNK_ITEMS)
        parts = [self.head]
        self.head = b""
        n = 0
        pack = _U64.pack
        while i < end and n < CHUNK_BYTES:
            v = items[i]
            parts.append(pack(len(v)))
            parts.append(v)
            n += 8 + len(v)
            i += 1
        self.pos = i
        piece = b"".join(parts)
        self.left -= len(piece)
        return piece


def _entry_cost(k: bytes, old: bytes | None, v: bytes) -> int:
    """Bytes that storing ``v`` under ``k`` adds to the budget (``old``: the value stored
    there now, None when ``k`` is new; negative when the value shrinks)."""
    return len(v) - len(old) if old is not None else len(k) + len(v) + ENTRY_OVERHEAD


def _stoll(v: bytes) -> int:
    """The integer C++'s ``std::stoll`` reads from ``v`` (leading blanks, a sign, digits;
    the rest ignored). Raises StoreProtocolError where stoll throws."""
    m = _STOLL.match(v)
    if m is None:
        raise StoreProtocolError("add/barrier: the stored value is not an integer")
    n = int(m.group(1))
    if not -(1 << 63) <= n < (1 << 63):
        raise StoreProtocolError("add/barrier: the stored value is out of int64 range")
    return n


class TorchConn:
    """One torch client's state: the query being parsed, its pending wait, and what it is
    charged. ``owner`` is the server's connection object (handed back to ``send``)."""

    __slots__ = (
        "owner",
        "validated",
        "qtype",
        "spec",
        "idx",
        "args",
        "count",
        "scanned",
        "scan",
        "held",
        "charged",
        "wait_keys",
        "awaited",
    )

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.validated = False
        self.qtype = -1  # -1: between queries
        self.spec: tuple[int, ...] = ()
        self.idx = 0
        self.args: list[Any] = []
        self.count = -1  # for key lists: -1 until the count is read
        self.scanned = 0  # a key list's items (keys and values) complete in the buffer
        self.scan = 0  # ... and their bytes, from the list's start
        self.held = 0  # memory held by the partly parsed query (taken off the buffer)
        self.charged = 0  # input and unsent reply bytes charged to the budget
        self.wait_keys: set[bytes] = set()  # the pending wait's keys not stored yet
        self.awaited = 0  # keys still to fire before STOP_WAITING

    def parse(self, buf: bytearray) -> tuple[int, list[Any]] | None:
        """Take the next complete query off the front of ``buf``: ``(qtype, args)``, or
        None when more bytes are needed (progress is kept here, so every byte is looked at
        once however the query is split; a key list's items stay in ``buf`` until the
        last one is in). Raises StoreProtocolError."""
        pos = 0
        n = len(buf)
        objs = 0  # keys and values parsed by this call (BLOB_OVERHEAD each while held)
        try:
            if self.qtype < 0:
                if n == 0:
                    return None
                q = buf[0]
                spec = _SPECS.get(q)
                if spec is None:
                    raise StoreProtocolError(f"unknown torch query type {q}")
                if self.validated == (q == VALIDATE):
                    raise StoreProtocolError("a torch client must send VALIDATE first, and only once")
                self.qtype, self.spec, self.idx, self.args = q, spec, 0, []
                pos = 1
            spec = self.spec
            while self.idx < len(spec):
                kind = spec[self.idx]
                if kind == _K_U32 or kind == _K_I64:
                    s = _U32 if kind == _K_U32 else _I64
                    if n - pos < s.size:
                        return None
                    self.args.append(s.unpack_from(buf, pos)[0])
                    pos += s.size
                elif kind == _K_KEY or kind == _K_VALUE:
                    got = self._blob(buf, pos, n, kind == _K_KEY)
                    if got is None:
                        return None
                    v, pos = got
                    self.args.append(v)
                    objs += 1
                else:
                    if self.count < 0:
                        if n - pos < 8:
                            return None
                        (c,) = _U64.unpack_from(buf, pos)
                        if c > MAX_KEYS_PER_QUERY:
                            raise StoreProtocolError(
                                f"{c} keys in one torch query exceeds {MAX_KEYS_PER_QUERY}"
                            )
                        pos += 8
                        self.count, self.scanned, self.scan = c, 0, 0
                    # The items stay in ``buf`` (their lengths checked, each byte once)
                    # until the last one is in: a partial list holds its wire bytes and
                    # no Python objects (one per tiny key would be 5x the bytes).
                    want = self.count if kind == _K_KEYS else 2 * self.count  # pairs: k, v...
                    base = pos
                    p, k = base + self.scan, self.scanned
                    while k < want and n - p >= 8:
                        (size,) = _U64.unpack_from(buf, p)
                        is_key = kind == _K_KEYS or not k & 1
                        limit = MAX_KEY_BYTES if is_key else MAX_VALUE_BYTES
                        if size > limit:
                            what = "key" if is_key else "value"
                            raise StoreProtocolError(f"torch {what} of {size} bytes exceeds {limit}")
                        if p + 8 + size > n:
                            break
                        p += 8 + size
                        k += 1
                    self.scanned, self.scan = k, p - base
                    if k < want:
                        return None  # (only what precedes the list is taken off ``buf``)
                    raw = bytes(buf[base:p])
                    items = []
                    r = 0
                    for _ in range(want):
                        (size,) = _U64.unpack_from(raw, r)
                        items.append(raw[r + 8 : r + 8 + size])
                        r += 8 + size
                    pos = p
                    self.args.append(items)  # pairs kept flat (k, v, k, v...): no tuples
                    self.count = -1
                self.idx += 1
            q, args = self.qtype, self.args
            self.qtype, self.args, self.held = -1, [], 0
            if q == VALIDATE:
                if args[0] != MAGIC:
                    raise StoreProtocolError(f"bad torch VALIDATE magic {args[0]:#x}")
                self.validated = True
            return q, args
        finally:
            if pos:
                del buf[:pos]
                if self.qtype >= 0:  # still partial: what it holds in memory, not on the wire
                    self.held += pos + objs * BLOB_OVERHEAD

    @staticmethod
    def _blob(buf: bytearray, pos: int, n: int, is_key: bool) -> tuple[bytes, int] | None:
        if n - pos < 8:
            return None
        (size,) = _U64.unpack_from(buf, pos)
        limit = MAX_KEY_BYTES if is_key else MAX_VALUE_BYTES
        if size > limit:
            raise StoreProtocolError(f"torch {'key' if is_key else 'value'} of {size} bytes exceeds {limit}")
        end = pos + 8 + size
        if end > n:
            return None
        return bytes(buf[pos + 8 : end]), end


class TorchKeySpace:
    """The key space torch clients see, with the libuv server's semantics. ``send(conn,
    data)`` delivers a reply that is not the answer to the query being handled (a wait
    that a write completes). Single-threaded: the store server's loop thread only.

    ``budget`` caps the bytes held for torch clients (stored entries, queues, pending
    waits, partly received queries, unsent replies; ``*_OVERHEAD`` per entry for what Python
    holds besides the bytes); ``handle`` and ``account`` raise TorchLimitError past it,
    and the caller closes that connection."""

    def __init__(self, send: Callable[[TorchConn, bytes], None], budget: int = DEFAULT_BUDGET) -> None:
        self.send = send
        self.budget = budget
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        # key -> the connection waiting on it, or several in registration order (a dict:
        # O(1) removal); one waiter is kept bare (a dict per key of a 128 Ki-key WAIT
        # cost 0.3 s to build and as much to cancel)
        self.waiting: dict[bytes, TorchConn | dict[TorchConn, None]] = {}
        self.used = 0  # bytes charged: entries + waits + input in flight
        self.key_bytes = 0  # sum of len(key) over ``data`` (LIST_KEYS' reply size in O(1))

    # --- accounting -----------------------------------------------------------------------

    def _charge(self, n: int) -> None:
        if n > 0 and self.used + n > self.budget:
            raise TorchLimitError(f"torch key space budget of {self.budget} bytes exceeded")
        self.used += n

    def account(self, st: TorchConn, buffered: int) -> None:
        """Charge ``st`` for ``buffered`` bytes (its input not parsed yet and its replies
        not sent yet) plus its partly parsed query; less than before releases the
        difference. Raises TorchLimitError past the budget."""
        now = buffered + st.held
        self._charge(now - st.charged)
        st.charged = now

    def drop(self, st: TorchConn) -> None:
        """Forget a closed connection: its pending wait and its input charge."""
        self._cancel(st)
        self.used -= st.charged
        st.charged = 0

    def _room(self, n: int) -> None:
        """Refuse a reply of ``n`` bytes that the budget could not hold if unsent (checked
        before it is built: a MULTI_GET of one large key repeated would be gigabytes)."""
        if self.used + n > self.budget:
            raise TorchLimitError(f"a torch reply of {n} bytes exceeds the {self.budget}-byte budget")

    def _store(self, k: bytes, v: bytes) -> None:
        old = self.data.get(k)
        self._charge(_entry_cost(k, old, v))
        if old is None:
            self.key_bytes += len(k)
        self.data[k] = v

    # --- waits ----------------------------------------------------------------------------

    def _register(self, st: TorchConn, keys: list[bytes]) -> None:
        self._cancel(st)  # one pending wait per connection (torch's client never has two)
        # A key listed twice is awaited once: libuv's server registers it twice and the
        # key's one write fires both, so the outcome is the same, at O(distinct keys).
        keys = list(dict.fromkeys(keys))
        self._charge(sum(map(len, keys)) + WAIT_OVERHEAD * len(keys))
        waiting = self.waiting
        for k in keys:
            cur = waiting.get(k)
            if cur is None:  # the usual case: one waiter, no dict of its own
                waiting[k] = st
            elif isinstance(cur, dict):
                cur[st] = None
            else:
                waiting[k] = {cur: None, st: None}
        st.wait_keys = set(keys)
        st.awaited = len(keys)

    def _cancel(self, st: TorchConn) -> None:
        waiting = self.waiting
        for k in st.wait_keys:
            cur = waiting[k]
            if isinstance(cur, dict):
                del cur[st]
                if not cur:
                    del waiting[k]
            else:
                del waiting[k]
        self.used -= sum(map(len, st.wait_keys)) + WAIT_OVERHEAD * len(st.wait_keys)
        st.wait_keys = set()
        st.awaited = 0

    def _fire(self, st: TorchConn, k: bytes) -> bool:
        """``st``'s registration on ``k`` fired (already removed from ``waiting``)."""
        st.wait_keys.discard(k)
        self.used -= len(k) + WAIT_OVERHEAD
        st.awaited -= 1
        if st.awaited == 0:
            self.send(st, STOP_WAITING)
            return True
        return False

    def _wake(self, k: bytes) -> None:
        cur = self.waiting.pop(k, None)
        if isinstance(cur, dict):
            for st in cur:
                self._fire(st, k)
        elif cur is not None:
            self._fire(cur, k)

    def _wake_one(self, k: bytes) -> None:
        """A queue push: fire ``k``'s registrations in order until one wait completes
        (libuv's wakeupOneWaitingClient)."""
        d = self.waiting.get(k)
        if d is None:
            return
        if not isinstance(d, dict):
            del self.waiting[k]
            self._fire(d, k)
            return
        while d:
            st = next(iter(d))
            del d[st]
            if self._fire(st, k):
                break
        if not d:
            del self.waiting[k]

    def _multi_set(self, flat: list[bytes]) -> None:
        """Store the pairs of ``flat`` (k, v, k, v...) as SETs one after another would, in
        bulk (128 Ki pairs one at a time held the loop ~0.1 s); all or nothing against
        the budget."""
        it = iter(flat)
        pairs = dict(zip(it, it))  # a key set twice keeps its last value, as in order
        data = self.data
        olds = list(map(data.get, pairs))
        self._charge(sum(map(_entry_cost, pairs, olds, pairs.values())))  # _store's rule, summed
        data.update(pairs)
        self.key_bytes += sum(len(k) for k, old in zip(pairs, olds) if old is None)
        if self.waiting:
            for k in [k for k in pairs if k in self.waiting]:  # (in the query's order)
                self._wake(k)

    def _present(self, k: bytes) -> bool:
        return k in self.data or bool(self.queues.get(k))

    # --- queries --------------------------------------------------------------------------

    def handle(self, st: TorchConn, q: int, a: list[Any]) -> bytes | Chunked:
        """Apply one parsed query; return its reply (b"" when it has none, or when it
        waits; a Chunked for MULTI_GET and LIST_KEYS). Raises StoreProtocolError (the
        connection is to be closed), TorchLimitError when the budget could not hold the
        query's effect or its reply."""
        if q == GET:
            value = self.data.get(a[0], b"")
            self._room(8 + len(value))
            return _blob(value)
        if q == SET:
            self._store(a[0], a[1])
            self._wake(a[0])
            return b""
        if q == WAIT:
            keys: list[bytes] = a[0]
            if all(self._present(k) for k in keys):
                return STOP_WAITING
            self._register(st, [k for k in keys if k not in self.data])
            return b""
        if q == ADD:
            k = a[0]
            old = self.data.get(k)
            new = (_stoll(old) if old is not None else 0) + a[1]
            new = wrap_int64(new)  # C++ int64 arithmetic wraps
            self._store(k, str(new).encode())
            self._wake(k)
            return _I64.pack(new)
        if q == CHECK:
            return READY if all(self._present(k) for k in a[0]) else NOT_READY
        if q == COMPARE_SET:
            k, expected, desired = a
            cur = self.data.get(k)
            if cur is None:
                if expected:  # torch's quirk: nothing stored, ``expected`` returned
                    cur = expected
                else:
                    self._store(k, desired)
                    cur = desired
            elif cur == expected:
                self._store(k, desired)
                cur = desired
            self._wake(k)
            return _blob(cur)
        if q == GETNUMKEYS:
            return _I64.pack(len(self.data))
        if q == DELETE_KEY:
            v = self.data.pop(a[0], None)
            if v is not None:
                self.used -= len(a[0]) + len(v) + ENTRY_OVERHEAD
                self.key_bytes -= len(a[0])
            return _I64.pack(v is not None)
        if q == APPEND:
            k, v = a
            self._store(k, self.data.get(k, b"") + v)
            self._wake(k)
            return b""
        if q == MULTI_GET:
            values = list(map(self.data.get, a[0], repeat(b"")))
            size = 8 * len(values) + sum(map(len, values))
            self._room(size)
            return Chunked(b"", values, size) if values else b""
        if q == MULTI_SET:
            self._multi_set(a[0])
            return b""
        if q == CANCEL_WAIT:
            self._cancel(st)
            return WAIT_CANCELED
        if q == PING:
            return _U32.pack(a[0])
        if q == QUEUE_PUSH:
            k, v = a
            self._charge(len(k) + len(v) + ENTRY_OVERHEAD)
            self.queues.setdefault(k, deque()).append(v)
            self._wake_one(k)
            return b""
        if q == QUEUE_POP:
            k = a[0]
            queue = self.queues.get(k)
            if not queue:
                return _I64.pack(0)
            reply = _I64.pack(len(queue))
            v = queue.popleft()
            self.used -= len(k) + len(v) + ENTRY_OVERHEAD
            if not queue:
                del self.queues[k]
            return reply + _blob(v)
        if q == QUEUE_LEN:
            queue = self.queues.get(a[0])
            return _I64.pack(len(queue) if queue else 0)
        if q == LIST_KEYS:
            size = 8 + 8 * len(self.data) + self.key_bytes
            self._room(size)
            return Chunked(_I64.pack(len(self.data)), list(self.data), size)
        if q == BARRIER:
            k, world = a
            old = self.data.get(k)
            count = (_stoll(old) + 1) if old is not None else 1
            self._store(k, str(count).encode())
            if count >= world:
                self._wake(k)
                return STOP_WAITING
            self._register(st, [k])
            return b""
        return b""  # VALIDATE: no reply
