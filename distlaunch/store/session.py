"""The store server's connections, one protocol at a time: a connection's state
(``Conn``) and what is done with the bytes it sends (``Sessions``): the authentication
handshake, the framing and decoding of requests into calls on the key-value core
(core.py), and, with torch clients on, telling torch's ``TCPStore`` clients apart by
their first bytes and serving them (torch_protocol.py).

No socket is read or written here except to refuse a failed handshake: replies go out
through the event loop (server.py, the ``Loop`` below), which also owns the
connection's lifetime (accept, deadlines, close).

Pipelining: a connection's frames are handled one at a time, in order. While its request
is blocked or its reply is not fully sent, later frames are read (so a peer that goes away
is noticed) and kept, not handled; more than one maximum frame kept that way closes the
connection, so a connection's buffered input never exceeds one frame plus one ``recv``.

torch clients: a new connection is not greeted at once. Its first bytes tell the
protocols apart, once per connection: torch's VALIDATE query makes it a torch connection
(its own key space), anything else a distlaunch one, greeted then (the loop greets one
silent for ``SNIFF_GRACE`` seconds). Authenticated connections then run the code path
they run without torch clients.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Protocol

from ..errors import StoreError
from . import protocol as P
from .core import KeyValueCore, Waiter
from .protocol import HEADER, HEADER_SIZE, MAX_FRAME_BYTES, Reader
from .torch_protocol import VALIDATE_PREFIX, Chunked, TorchConn, TorchKeySpace, TorchLimitError

_MAX_QUEUED = HEADER_SIZE + P.MAX_FRAME_BYTES  # input kept behind a pending request

_U16, _U32, _F64 = P.U16, P.U32, P.F64
_VALUE_HDR = struct.Struct("!IBI")
_MAX_KEY = P.MAX_KEY_BYTES
_SET, _SET_NOREPLY, _GET = P.SET, P.SET_NOREPLY, P.GET
_MAX_VALUE = P.MAX_VALUE_BYTES
_R_OK = P.frame(P.OK)
_R_TRUE = P.frame(P.BOOL, b"\x01")
_R_FALSE = P.frame(P.BOOL, b"\x00")
_R_AUTH_FAIL = P.frame(P.AUTH_FAIL)
# C->S, optional, before AUTH: MAGIC(8). Sent on connect by a client that does not wait for
# HELLO, so a server with torch clients greets it without waiting out SNIFF_GRACE.
CLIENT_HELLO = P.CLIENT_HELLO
DL, SNIFF, TORCH = 0, 1, 2  # Conn.mode: distlaunch, not yet known, torch client
# Work one torch connection may do per loop turn before the rest waits for the next turn
# (authenticated requests are served in between): seconds of queries, and Chunked pieces.
_TORCH_SLICE = 0.005


def _value_reply(v: bytes) -> bytes:
    """A VALUE frame carrying ``v``."""
    return _VALUE_HDR.pack(len(v) + 4, P.VALUE, len(v)) + v


class Conn:
    """One connection's state: its socket, input not handled yet, replies not sent yet,
    handshake, protocol (``mode``), and its blocked request or torch state."""

    __slots__ = (
        "sock",
        "fd",
        "inbuf",
        "out",
        "outpos",
        "outq",
        "authed",
        "nonce",
        "waiter",
        "closed",
        "events",
        "peer",
        "mode",
        "torch",
        "gen",
    )

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.inbuf = bytearray()
        self.out: bytes | None = None  # the reply being sent (no frame is handled until it is)
        self.outpos = 0
        self.outq: list[bytes] = []  # replies queued behind ``out`` (in order; normally empty)
        self.authed = False
        self.nonce = os.urandom(P.NONCE_BYTES)
        self.waiter: Waiter | None = None  # the blocked request, if any (answered in order)
        self.closed = False
        self.events = select.POLLIN
        self.peer = peer
        self.mode = DL
        self.torch: TorchConn | None = None
        self.gen: Chunked | None = None  # a torch reply being built a piece per loop turn


class Loop(Protocol):
    """What the sessions ask of the event loop (server.py's ``StoreServer``)."""

    stats: dict[str, int]

    def conn_send(self, c: Conn, data: bytes) -> None:
        """Send ``data`` after what ``c`` is already sending (may close ``c``)."""

    def conn_close(self, c: Conn, count: bool = True) -> None: ...

    def conn_events(self, c: Conn, events: int) -> None: ...

    def conn_resume(self, c: Conn) -> None:
        """Handle ``c``'s kept input after this loop turn's events."""

    def conn_later(self, c: Conn) -> None:
        """Go on with ``c``'s torch work on the next loop turn."""

    def conn_authenticated(self, c: Conn) -> None:
        """``c`` passed the handshake (its auth deadline is gone)."""

    def conn_sniffed(self, c: Conn) -> None:
        """``c``'s protocol is known (its greeting deadline is gone)."""

    def conn_admit_torch(self, c: Conn) -> bool:
        """``c`` turned out a torch client: count it; False when over the limit."""

    def conn_active(self, c: Conn) -> None:
        """torch connection ``c`` sent something (for idle eviction)."""


class _Drop(Exception):
    pass


class Sessions:
    """The protocol side of every connection of one server: ``received(c, data)`` takes
    the bytes a connection sent and answers what they complete, through ``loop``; the
    distlaunch key space is ``core``, torch's (``torch_clients``) is ``torch``. Counts
    into ``loop.stats``. Single-threaded: the loop's thread only."""

    def __init__(self, loop: Loop, secret: bytes, torch_clients: bool, torch_max_bytes: int) -> None:
        self.loop = loop
        self.stats = loop.stats
        self._secret = secret
        self.core = KeyValueCore(self._ready, self._timed_out, P.MAX_VALUE_BYTES)
        self.torch = TorchKeySpace(self._torch_send, torch_max_bytes) if torch_clients else None
        self._send = loop.conn_send
        self._close = loop.conn_close
        self._handlers: dict[int, Callable[[Conn, Reader], bytes | None]] = {
            P.SET: self._h_set,
            P.GET: self._h_get,
            P.ADD: self._h_add,
            P.COMPARE_SET: self._h_compare_set,
            P.CHECK: self._h_check,
            P.WAIT: self._h_wait,
            P.DELETE_KEY: self._h_delete,
            P.NUM_KEYS: self._h_num_keys,
            P.APPEND: self._h_append,
            P.MULTI_GET: self._h_multi_get,
            P.MULTI_SET: self._h_multi_set,
            P.PING: self._h_ping,
            P.SET_NOREPLY: self._h_set_noreply,
        }

    def _drop(self, c: Conn, stat: str) -> None:
        self.stats[stat] += 1
        self._close(c)

    def greet(self, c: Conn) -> None:
        """Send ``c`` the HELLO that starts the handshake (it speaks distlaunch's protocol)."""
        c.mode = DL
        self._send(c, P.frame(P.HELLO, P.MAGIC + c.nonce))

    def forget(self, c: Conn) -> None:
        """``c`` is closed: retire its blocked request, release its torch state."""
        if c.torch is not None and self.torch is not None:
            self.torch.drop(c.torch)
            c.gen = None
        w = c.waiter
        if w is not None:
            self.core.retire(w)
            c.waiter = None

    # --- input -------------------------------------------------------------------------------

    def received(self, c: Conn, data: bytes) -> None:
        """Bytes ``c`` sent (non-empty)."""
        if c.mode:  # a torch client, or a connection whose protocol is not known yet
            self._on_other(c, data)
            return
        if c.waiter is not None or c.out is not None:
            # Busy: keep the frames, in order, for when the request is answered.
            c.inbuf += data
            if len(c.inbuf) > _MAX_QUEUED:  # more than any one frame: not pipelining
                self._drop(c, "protocol_errors")
            return
        if c.inbuf:
            c.inbuf += data
            self.process(c, c.inbuf, True)
        else:
            self.process(c, data, False)

    def resume(self, c: Conn) -> None:
        """Handle ``c``'s kept input, now that it is neither blocked nor sending."""
        if c.mode == TORCH:
            self._torch_run(c)
        else:
            self.process(c, c.inbuf, True)

    def process(self, c: Conn, buf: bytes | bytearray, in_place: bool) -> None:
        """Handle the complete frames in ``buf`` one after another, stopping at one that
        blocks or whose reply is not fully sent (replies stay in request order; later
        frames wait until it is answered); keep the rest. ``in_place``: ``buf`` is
        ``c.inbuf`` (trimmed in place), else bytes just received."""
        pos = 0
        n = len(buf)
        data = self.core.data
        put = self.core.put
        try:
            while n - pos >= HEADER_SIZE:
                length, mtype = HEADER.unpack_from(buf, pos)
                if not c.authed:
                    # Before authentication only exact AUTH (and CLIENT_HELLO) frames.
                    if mtype != P.AUTH or length != P.NONCE_BYTES + P.MAC_BYTES:
                        if mtype != CLIENT_HELLO or length != len(P.MAGIC):
                            raise _Drop("auth")
                elif length > MAX_FRAME_BYTES:
                    raise _Drop("protocol")
                end = pos + HEADER_SIZE + length
                if end > n:
                    break
                if not c.authed:
                    if mtype == CLIENT_HELLO:  # already greeted (at accept, or on its first bytes)
                        if buf[pos + HEADER_SIZE : end] != P.MAGIC:
                            raise _Drop("auth")
                        pos = end
                        continue
                    self._auth(c, buf, pos + HEADER_SIZE)
                    if c.closed:
                        return
                else:
                    self.stats["requests"] += 1
                    reply: bytes | None = b""
                    p = pos + HEADER_SIZE
                    # Inline fast path for the hot requests (set, get of an existing key);
                    # checks as strict as Reader's. Anything else takes the general path.
                    if (mtype == _SET_NOREPLY or mtype == _SET or mtype == _GET) and length >= 2:
                        (klen,) = _U16.unpack_from(buf, p)
                        kend = p + 2 + klen
                        if not 0 < klen <= _MAX_KEY:
                            reply = None
                        elif mtype == _GET:
                            v: bytes | None = None
                            if kend + 8 == end and _F64.unpack_from(buf, kend)[0] >= 0.0:
                                v = data.get(bytes(buf[p + 2 : kend]))
                            reply = None if v is None else _value_reply(v)
                        elif (
                            kend + 4 <= end
                            and kend + 4 + _U32.unpack_from(buf, kend)[0] == end
                            and end - kend - 4 <= _MAX_VALUE
                        ):
                            put(bytes(buf[p + 2 : kend]), bytes(buf[kend + 4 : end]))
                            if mtype == _SET:
                                reply = _R_OK
                        else:
                            reply = None
                    else:
                        reply = None
                    if reply is None:
                        handler = self._handlers.get(mtype)
                        if handler is None:
                            raise _Drop("protocol")
                        reply = handler(c, Reader(buf, p, end))
                    if reply:  # None: blocked; b"": nothing to answer (SET_NOREPLY)
                        self._send(c, reply)
                        if c.closed:
                            return
                pos = end
                if c.waiter is not None or c.out is not None:
                    break
        except _Drop as d:
            self._drop(c, "auth_failures" if d.args[0] == "auth" else "protocol_errors")
            return
        except P.StoreProtocolError:
            self._drop(c, "protocol_errors")
            return
        if in_place:  # buf is c.inbuf
            if pos:
                del c.inbuf[:pos]
        elif pos < n:
            c.inbuf = bytearray(memoryview(buf)[pos:])

    def _auth(self, c: Conn, buf: bytes | bytearray, p: int) -> None:
        client_nonce = bytes(buf[p : p + P.NONCE_BYTES])
        proof = bytes(buf[p + P.NONCE_BYTES : p + P.NONCE_BYTES + P.MAC_BYTES])
        expected = P.mac(self._secret, P.AUTH_LABEL_CLIENT, c.nonce, client_nonce)
        if not P.macs_equal(proof, expected):
            self.stats["auth_failures"] += 1
            # Tell the client why (so it can raise StoreAuthError), then drop it. Nothing
            # it sent after the AUTH frame is read.
            try:
                c.sock.send(_R_AUTH_FAIL)
            except OSError:
                pass
            self._close(c)
            return
        c.authed = True
        self.loop.conn_authenticated(c)
        self._send(c, P.frame(P.AUTH_OK, P.mac(self._secret, P.AUTH_LABEL_SERVER, c.nonce, client_nonce)))

    # --- blocked requests --------------------------------------------------------------------

    def _block(self, c: Conn, op: int, keys: list[bytes], timeout: float) -> None:
        c.waiter = self.core.block(c, op, keys, time.monotonic() + timeout)

    def _answer(self, c: Conn, reply: bytes) -> None:
        """Answer the connection's blocked request."""
        c.waiter = None
        self._send(c, reply)
        if not c.closed and c.out is None and c.inbuf:
            self.loop.conn_resume(c)  # its queued frames, after this loop turn's events

    def _ready(self, w: Waiter) -> None:
        """The core's ``on_ready``: every key of ``w`` exists."""
        c = w.owner
        assert isinstance(c, Conn)
        data = self.core.data
        if w.op == P.GET:
            reply = _value_reply(data[w.keys[0]])
        elif w.op == P.MULTI_GET:
            reply = self._values_reply([data[k] for k in w.keys])
        else:
            reply = _R_OK
        self._answer(c, reply)

    def _timed_out(self, w: Waiter) -> None:
        """The core's ``on_timeout``: TIMEOUT naming the first keys still missing."""
        c = w.owner
        assert isinstance(c, Conn)
        missing = list(itertools.islice(self.core.missing(w.keys), P.TIMEOUT_KEYS))
        self._answer(c, P.frame(P.TIMEOUT, P.enc_keys(missing)))

    @staticmethod
    def _values_reply(values: list[bytes]) -> bytes:
        body = P.U32.pack(len(values)) + b"".join(P.U32.pack(len(v)) + v for v in values)
        if len(body) > MAX_FRAME_BYTES:
            return P.frame(P.ERROR, b"multi_get reply would exceed the frame size limit")
        return P.frame(P.VALUES, body)

    # --- request handlers: return the reply frame, or None when the request blocks -----------

    def _h_set(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        v = r.value()
        r.done()
        self.core.put(k, v)
        return _R_OK

    def _h_set_noreply(self, c: Conn, r: Reader) -> bytes | None:
        self._h_set(c, r)
        return b""

    def _h_get(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        t = r.timeout()
        r.done()
        v = self.core.data.get(k)
        if v is not None:
            return _value_reply(v)
        self._block(c, P.GET, [k], t)
        return None

    def _h_add(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        amount = r.i64()
        r.done()
        try:
            new = self.core.add(k, amount)
        except ValueError:
            return P.frame(P.ERROR, b"add: the value stored under the key is not an integer")
        return P.frame(P.INT, P.I64.pack(new))

    def _h_compare_set(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        expected = r.value()
        desired = r.value()
        r.done()
        return P.frame(P.VALUE, P.enc_value(self.core.compare_set(k, expected, desired)))

    def _h_check(self, c: Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        r.done()
        return _R_TRUE if self.core.check(keys) else _R_FALSE

    def _h_wait(self, c: Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        t = r.timeout()
        r.done()
        if self.core.check(keys):
            return _R_OK
        self._block(c, P.WAIT, keys, t)
        return None

    def _h_delete(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        r.done()
        return _R_TRUE if self.core.delete(k) else _R_FALSE

    def _h_num_keys(self, c: Conn, r: Reader) -> bytes | None:
        r.done()
        return P.frame(P.INT, P.I64.pack(len(self.core.data)))

    def _h_append(self, c: Conn, r: Reader) -> bytes | None:
        k = r.key()
        v = r.value()
        r.done()
        if not self.core.append(k, v):
            return P.frame(P.ERROR, f"append: the value would exceed {P.MAX_VALUE_BYTES} bytes".encode())
        return _R_OK

    def _h_multi_get(self, c: Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        t = r.timeout()
        r.done()
        if self.core.check(keys):
            data = self.core.data
            return self._values_reply([data[k] for k in keys])
        self._block(c, P.MULTI_GET, keys, t)
        return None

    def _h_multi_set(self, c: Conn, r: Reader) -> bytes | None:
        n = r.count()
        pairs = [(r.key(), r.value()) for _ in range(n)]
        r.done()
        self.core.multi_set(pairs)
        return _R_OK

    def _h_ping(self, c: Conn, r: Reader) -> bytes | None:
        r.done()
        return _R_OK

    # --- torch clients (torch_clients=True) -------------------------------------------------

    def _on_other(self, c: Conn, data: bytes) -> None:
        """Bytes from a torch client, or the first bytes of a connection not greeted yet."""
        if c.mode == TORCH:
            c.inbuf += data
            self.loop.conn_active(c)
            if c.out is None and c.gen is None:
                self._torch_run(c)
            else:  # still sending: keep the input (charged, so bounded by the budget)
                self.torch_account(c)
            return
        buf = bytes(c.inbuf) + data if c.inbuf else data
        head = buf[: len(VALIDATE_PREFIX)]
        if head == VALIDATE_PREFIX[: len(head)]:
            if len(head) < len(VALIDATE_PREFIX):
                c.inbuf = bytearray(buf)  # too short to tell yet
                return
            if not self.loop.conn_admit_torch(c):
                return
            c.mode = TORCH
            c.torch = TorchConn(c)
            c.inbuf = bytearray(buf)
            self._torch_run(c)
            return
        # Not torch: a distlaunch client (or garbage, which the auth check drops).
        self.loop.conn_sniffed(c)
        c.inbuf = bytearray()
        self.greet(c)
        if c.closed:
            return
        if c.out is not None:
            c.inbuf += buf
        else:
            self.process(c, buf, False)

    def _torch_run(self, c: Conn) -> None:
        """Handle a torch client's complete queries in order, stopping while a reply is
        only partly sent or built, and after _TORCH_SLICE seconds (the rest goes on next
        turn); a query breaking the protocol or the budget closes it."""
        st = c.torch
        space = self.torch
        assert st is not None and space is not None
        t0 = time.monotonic()
        try:
            while c.out is None and c.gen is None and not c.closed:
                q = st.parse(c.inbuf)
                space.account(st, len(c.inbuf))  # the parsed query's input is its args now
                if q is None:
                    break
                self.stats["requests"] += 1
                reply = space.handle(st, *q)
                if isinstance(reply, Chunked):
                    c.gen = reply
                    self._pump(c)
                elif reply:
                    self._send(c, reply)
                    if c.out is not None and not c.closed:  # what the kernel did not take
                        space.account(st, self._torch_held(c))
                if c.inbuf and c.gen is None and time.monotonic() - t0 > _TORCH_SLICE:
                    self.loop.conn_later(c)
                    break
        except TorchLimitError:
            self._drop(c, "torch_limit_drops")
        except StoreError:  # StoreProtocolError, and stoll's failures
            self._drop(c, "protocol_errors")

    def _pump(self, c: Conn) -> None:
        """Build and send the next piece of ``c``'s chunked reply (``c.out`` is None);
        once the reply is whole, what queued behind it goes on."""
        gen = c.gen
        assert gen is not None
        piece = gen.next()
        if gen.left <= 0:
            c.gen = None
        if piece:
            self._send(c, piece)
            if c.closed:
                return
        if c.gen is not None:
            if c.out is None:  # the kernel took it all: the next piece on the next turn
                self.loop.conn_later(c)
        elif c.out is None:
            if c.outq:  # a wait's STOP_WAITING that came while the reply was being built
                c.out = c.outq.pop(0)
                self.loop.conn_events(c, select.POLLIN | select.POLLOUT)
            elif c.inbuf:
                self.loop.conn_later(c)
        self.torch_account(c)

    def torch_continue(self, c: Conn) -> None:
        """A torch connection's work left over from the last loop turn."""
        if c.out is not None:
            return  # the loop goes on when the peer reads
        if c.gen is not None:
            self._pump(c)
        elif c.inbuf:
            self._torch_run(c)

    @staticmethod
    def _torch_held(c: Conn) -> int:
        """Bytes held for a torch connection outside the key space: its input not parsed
        yet and its replies not sent or not built yet (charged to the budget)."""
        unsent = len(c.out) - c.outpos if c.out is not None else 0
        left = c.gen.left if c.gen is not None else 0
        return len(c.inbuf) + unsent + sum(map(len, c.outq)) + left

    def torch_account(self, c: Conn) -> None:
        """Charge torch connection ``c`` for what it holds now; closes it past the budget."""
        assert c.torch is not None and self.torch is not None
        try:
            self.torch.account(c.torch, self._torch_held(c))
        except TorchLimitError:
            self._drop(c, "torch_limit_drops")

    def _torch_send(self, st: TorchConn, data: bytes) -> None:
        """A wait's STOP_WAITING, completed by another connection's write."""
        c = st.owner
        assert isinstance(c, Conn)
        if c.gen is not None:  # after the reply being built, never inside it
            c.outq.append(data)
        elif not c.closed:
            self._send(c, data)
