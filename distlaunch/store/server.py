"""The store server: one background thread running an epoll (poll elsewhere) event loop
over non-blocking sockets.

Why one thread and no asyncio: the work per request is a dict operation, so one loop is
as fast as Python gets, there is no locking, and ``import asyncio`` would cost workers
tens of milliseconds of start-up. Blocked ``get``/``wait``/``multi_get`` calls are parked
on per-key waiter lists (woken by the write that creates the key, no polling) and on a
deadline heap (the server answers TIMEOUT at the deadline, so the connection never gets
out of step). Each connection has its own input buffer; a frame that breaks the protocol
drops that connection only.

Pipelining: a connection's frames are handled one at a time, in order. While its request
is blocked or its reply is not fully sent, later frames are read (so a peer that goes away
is noticed) and kept, not handled; more than one maximum frame kept that way closes the
connection, so a connection's buffered input never exceeds one frame plus one ``recv``.
Replies are sent in order; one that is only partly sent holds those behind it.

Unauthenticated connections are kept in accept order (which is also auth-deadline
order); past ``max_unauthenticated``, or when accept runs out of descriptors, the oldest
one is closed, so idle sockets cannot lock out a client that authenticates promptly.

torch clients (``torch_clients=True``): a new connection is not greeted at once. Its first
bytes tell the protocols apart, once per connection: torch's VALIDATE query makes it a
torch connection (torch_protocol.py, its own key space), anything else a distlaunch one,
greeted then; a connection silent for ``SNIFF_GRACE`` seconds is greeted too (a client
that waits for HELLO before sending anything). Authenticated connections then run the
code path they run without torch clients.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import StoreError
from . import protocol as P
from .protocol import HEADER, HEADER_SIZE, MAX_FRAME_BYTES, Reader
from .torch_protocol import VALIDATE_PREFIX, Chunked, TorchConn, TorchKeySpace, TorchLimitError

__all__ = ["StoreServer", "serve_forever"]

_IN = select.POLLIN
_OUT = select.POLLOUT
_BAD = select.POLLERR | select.POLLHUP | getattr(select, "POLLNVAL", 0)
_MAX_QUEUED = HEADER_SIZE + P.MAX_FRAME_BYTES  # input kept behind a pending request
_ACCEPT_BATCH = 64  # accepts per loop turn, so a connect flood cannot starve handshakes
_RECV = 65536  # below glibc's mmap threshold: a bigger recv buffer costs 3 syscalls per call
_INT64 = 1 << 64

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
SNIFF_GRACE = 0.1  # seconds a torch-enabled server waits for a new connection's first bytes
_DL, _SNIFF, _TORCH = 0, 1, 2  # _Conn.mode: distlaunch, not yet known, torch client
# Work one torch connection may do per loop turn before the rest waits for the next turn
# (authenticated requests are served in between): seconds of queries, and Chunked pieces.
_TORCH_SLICE = 0.005


class _Poller:
    """epoll where available, else poll; one interface (timeouts in seconds, None = forever)."""

    def __init__(self) -> None:
        self._p: select.epoll | select.poll
        self._epoll: select.epoll | None = None  # to close (a poll object has no close)
        if hasattr(select, "epoll"):
            self._p = self._epoll = select.epoll()
            self._ms = False
        else:  # pragma: no cover - non-Linux
            self._p = select.poll()
            self._ms = True
        self.register = self._p.register
        self.modify = self._p.modify
        self.unregister = self._p.unregister

    def poll(self, timeout: float | None) -> list[tuple[int, int]]:
        if self._ms:  # pragma: no cover
            return self._p.poll(None if timeout is None else timeout * 1000.0)
        return self._p.poll(-1 if timeout is None else timeout)

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


class _Conn:
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
        self.waiter: _Waiter | None = None  # the blocked request, if any (answered in order)
        self.closed = False
        self.events = _IN
        self.peer = peer
        self.mode = _DL
        self.torch: TorchConn | None = None
        self.gen: Chunked | None = None  # a torch reply being built a piece per loop turn


class _Waiter:
    """A blocked GET / WAIT / MULTI_GET. ``registered``: the keys it is parked on, the
    ones missing so far: a write touches only the waiters of its own key, and a waiter is
    looked at as a whole (its other keys) only once that set is empty, so the work a
    write causes never depends on how many keys its waiters wait for."""

    __slots__ = ("conn", "op", "keys", "registered", "done")

    def __init__(self, conn: _Conn, op: int, keys: list[bytes]) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.registered: set[bytes] = set()
        self.done = False


def _raise_nofile_limit() -> int | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit so thousands of clients fit; return
    the soft limit now in force (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    targets = [hard] if hard != resource.RLIM_INFINITY else []
    targets.append(1 << 20)  # Linux's usual nr_open, when the hard limit is "unlimited"
    for target in targets:
        if soft != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def fd_reserve(limit: int) -> int:
    """Descriptors of a ``limit`` that torch clients may never take: an eighth, at least
    64, at most half (for distlaunch's own connections and the rest of the process)."""
    return min(limit // 2, max(64, limit // 8))


class StoreServer:
    """The key-value store server (c10d TCPStore semantics, token-authenticated).

    ``StoreServer(host="127.0.0.1", port=0, token=None, backlog=4096,
    max_unauthenticated=4096, torch_clients=False, max_torch_connections=4096,
    torch_max_bytes=256 MiB, torch_idle_timeout=60.0)`` binds when
    ``start()`` is called (or on entering ``with``); ``port=0`` picks a free port, read it
    from ``.port``. ``token`` is the job's secret (str or bytes, non-empty); when None a
    random one is generated — read it from ``.token``. Every client must prove it knows
    the token (HMAC-SHA256 challenge-response) before any request is served.

    ``start()`` returns once the socket listens; the event loop runs on a daemon thread.
    ``stop()`` closes the listener and every connection (clients then get
    StoreConnectionError) and joins the thread; it is idempotent. ``start()`` raises
    StoreError if the address cannot be bound (e.g. the port is in use).

    On ``start()`` the soft RLIMIT_NOFILE is raised to the hard limit and the listen
    backlog is ``backlog`` (the kernel caps it at net.core.somaxconn).

    ``max_unauthenticated`` caps the connections open but not yet authenticated (each
    has ``AUTH_TIMEOUT`` seconds): a new connection past the cap closes the oldest
    pending one, as does accept running out of file descriptors, so a flood of idle
    sockets cannot lock out a client that authenticates promptly.

    ``torch_clients=True`` also serves torch's ``TCPStore`` clients on the same port (as
    torchrun's agent store on ``MASTER_PORT``, for ``init_method="env://"`` with
    ``TORCHELASTIC_USE_AGENT_STORE=True``): they carry no secret, so they see a key space
    of their own, never the distlaunch keys (docs/security.md). At most
    ``max_torch_connections`` are open at once (newer ones are closed at once: an
    outsider cannot evict clients already connected), and everything held for them
    (keys, values, queues, waits, partly received queries) is capped at
    ``torch_max_bytes`` (counted as the memory Python holds for it): the query that
    would exceed it closes its connection. Off by default. With it on, a distlaunch
    client that does not send CLIENT_HELLO is greeted ``SNIFF_GRACE`` seconds after
    connecting instead of at once.

    Descriptors: torch clients never hold the last ``fd_reserve(limit)`` of the process's
    RLIMIT_NOFILE (read on ``start()``; ``torch_connection_limit`` is the resulting cap,
    at most ``max_torch_connections``), so distlaunch clients always find room. When
    accept still runs out of descriptors, the oldest unauthenticated connection is
    closed, else the torch connection idle longest, if it has sent nothing for
    ``torch_idle_timeout`` seconds and has no wait or reply in progress
    (``stats["torch_evicted"]``). Idleness alone never closes a torch connection: torch's
    TCPStore client connects once and keeps that connection, silent (no heartbeat),
    between the program's store calls, for as long as training runs, and torch's servers
    never close it either. One torch connection's work is done a few milliseconds per
    loop turn (a MULTI_GET or LIST_KEYS reply a piece at a time), so authenticated
    requests wait for at most one torch query, never for a whole reply or backlog.

    The constructor raises TypeError for a token that is not str/bytes, ValueError for an
    empty one, for ``max_unauthenticated``, ``max_torch_connections`` or
    ``torch_max_bytes`` < 1, or a ``torch_idle_timeout`` that is not a finite number >= 0.
    Nothing else is shared with other threads: ``port``, ``token``, ``num_connections``
    and ``stats`` (counters: accepted, auth_failures, unauthenticated_dropped,
    protocol_errors, closed, requests, internal_errors, torch_accepted, torch_refused,
    torch_limit_drops, torch_evicted) may be read from any thread.
    Semantics follow torch's c10d TCPStore; see docs/store.md.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | bytes | None = None,
        backlog: int = 4096,
        max_unauthenticated: int = 4096,
        torch_clients: bool = False,
        max_torch_connections: int = 4096,
        torch_max_bytes: int = 256 * 1024 * 1024,
        torch_idle_timeout: float = 60.0,
    ) -> None:
        if token is None:
            token = os.urandom(32).hex()
        secret = P.secret_bytes(token)
        if not secret:
            raise ValueError("store token must not be empty")
        if not isinstance(max_unauthenticated, int) or max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated must be an int >= 1, got {max_unauthenticated!r}")
        for name, v in (
            ("max_torch_connections", max_torch_connections),
            ("torch_max_bytes", torch_max_bytes),
        ):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if (
            isinstance(torch_idle_timeout, bool)
            or not isinstance(torch_idle_timeout, (int, float))
            or not 0.0 <= torch_idle_timeout < math.inf
        ):
            raise ValueError(
                f"torch_idle_timeout must be a finite number of seconds >= 0, got {torch_idle_timeout!r}"
            )
        self.max_torch_connections = max_torch_connections
        self.torch_connection_limit = max_torch_connections  # lowered on start() to fit RLIMIT_NOFILE
        self.torch_idle_timeout = float(torch_idle_timeout)
        # torch connections -> when they last sent something, least recently first
        self._torch_idle: dict[_Conn, float] = {}
        self._later: list[_Conn] = []  # torch connections with work left for the next turn
        self._torch = TorchKeySpace(self._torch_send, torch_max_bytes) if torch_clients else None
        self._torch_conns = 0
        # Connections not greeted yet (torch clients on) -> greeting deadline, in accept order.
        self._sniffing: dict[_Conn, float] = {}
        self.max_unauthenticated = max_unauthenticated
        self.host = host
        self.token: str | bytes = token
        self._secret = secret
        self._requested_port = port
        self._backlog = backlog
        self.port: int | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stopped = False
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, dict[_Waiter, None]] = {}  # key -> waiters (ordered set)
        self._heap: list[tuple[float, int, _Waiter]] = []  # (deadline, seq, waiter)
        self._seq = 0
        self._conns: dict[int, _Conn] = {}
        # Unauthenticated connections -> auth deadline, in accept (= deadline) order.
        self._pending: dict[_Conn, float] = {}
        self._resume: list[_Conn] = []
        self._adopt: list[socket.socket] = []  # local connections for the loop to take in
        self._listen_paused_until = 0.0
        self.stats = {
            "accepted": 0,
            "auth_failures": 0,
            "unauthenticated_dropped": 0,
            "protocol_errors": 0,
            "closed": 0,
            "requests": 0,
            "internal_errors": 0,
            "torch_accepted": 0,
            "torch_refused": 0,
            "torch_limit_drops": 0,
            "torch_evicted": 0,
        }
        self.last_internal_error: str | None = None
        self._handlers: dict[int, Callable[[_Conn, Reader], bytes | None]] = {
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

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> StoreServer:
        """Bind, listen and start the event-loop thread. Returns self. Raises StoreError
        when already started or when the address cannot be bound."""
        if self._thread is not None or self._stopped:
            raise StoreError("StoreServer.start(): already started (a server runs once)")
        limit = _raise_nofile_limit()
        if limit is not None:
            self.torch_connection_limit = min(self.max_torch_connections, max(1, limit - fd_reserve(limit)))
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            lsock = socket.create_server(
                (self.host, self._requested_port), family=family, backlog=self._backlog
            )
        except OSError as e:
            raise StoreError(f"store cannot listen on {self.host}:{self._requested_port}: {e}") from e
        lsock.setblocking(False)
        self.port = lsock.getsockname()[1]
        self._poller = _Poller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(lsock.fileno(), _IN)
        self._poller.register(self._wake_r.fileno(), _IN)
        self._lpoll = select.poll()  # "is a connection waiting?" without a descriptor
        self._lpoll.register(lsock.fileno(), _IN)
        self._thread = threading.Thread(
            target=self._run, args=(lsock,), name=f"distlaunch-store:{self.port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close the listener and every connection, and join the loop thread (waiting at
        most ``timeout`` seconds). Idempotent; never raises for an already stopped server."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping = True
        if self._thread is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    close = stop

    def connect_local(self) -> socket.socket:
        """A connection to this server for the process running it, already
        authenticated: one end of a socketpair (blocking) whose other end the event loop
        takes in. Nothing crosses a network, so there is nothing to prove: the launcher's
        own agent skips the handshake's round trips and hashlib's import before its
        workers start. ``StoreClient(..., connect=server.connect_local)`` uses it. Raises
        StoreError when the server is not running."""
        if self._thread is None or self._stopping:
            raise StoreError("StoreServer.connect_local(): the server is not running")
        mine, theirs = socket.socketpair()
        theirs.setblocking(False)
        self._adopt.append(theirs)  # list.append is atomic; the loop pops after the wake
        try:
            self._wake_w.send(b"x")
        except OSError:  # stopped meanwhile
            pass
        if self._stopping:  # the loop may have shut down before taking it in
            theirs.close()
        return mine

    def _take_in_local(self) -> None:
        while self._adopt:
            sock = self._adopt.pop()
            c = _Conn(sock, "local")
            c.authed = True
            self._conns[c.fd] = c
            self._poller.register(c.fd, _IN)

    def __enter__(self) -> StoreServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def num_connections(self) -> int:
        """Connections currently open (authenticated or not)."""
        return len(self._conns)

    @property
    def address(self) -> tuple[str, int | None]:
        return (self.host, self.port)

    def __repr__(self) -> str:
        state = (
            "running"
            if self._thread is not None and not self._stopped
            else ("stopped" if self._stopped else "not started")
        )
        return f"StoreServer({self.host!r}, {self.port}, {state})"

    def serve_forever(self, on_ready: Callable[[StoreServer], object] | None = None) -> None:
        """Start (if needed) and block until SIGINT or SIGTERM, then stop and return.

        Must be called from the main thread (signal handlers are installed there, and
        the previous handlers are restored on return). ``on_ready(server)`` is called
        once the server listens, e.g. to print ``server.port``.
        """
        import signal

        got = threading.Event()

        def _handler(signum: int, frame: object) -> None:
            got.set()

        previous = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self._thread is None:
                self.start()
            thread = self._thread
            assert thread is not None  # start() set it, or raised
            if on_ready is not None:
                on_ready(self)
            while not got.wait(0.5):
                if not thread.is_alive():  # loop died: don't pretend to serve
                    raise StoreError("store event loop exited unexpectedly")
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            self.stop()

    # --- event loop --------------------------------------------------------------------------

    def _run(self, lsock: socket.socket) -> None:
        poll = self._poller.poll
        conns = self._conns
        lfd = lsock.fileno()
        wfd = self._wake_r.fileno()
        heap = self._heap
        pending = self._pending
        sniffing = self._sniffing
        try:
            while not self._stopping:
                timeout: float | None = None
                if heap or pending:
                    first = min(
                        heap[0][0] if heap else math.inf,
                        next(iter(pending.values())) if pending else math.inf,
                        next(iter(sniffing.values())) if sniffing else math.inf,
                    )
                    timeout = max(0.0, first - time.monotonic())
                if self._listen_paused_until:
                    t = max(0.0, self._listen_paused_until - time.monotonic())
                    timeout = t if timeout is None else min(timeout, t)
                if self._resume or self._later:  # work left over from the last turn
                    timeout = 0.0
                try:
                    events = poll(timeout)
                except InterruptedError:  # pragma: no cover - PEP 475 retries
                    continue
                for fd, ev in events:
                    c = conns.get(fd)
                    if c is not None:
                        try:
                            if ev & _OUT and c.out is not None:
                                self._flush(c, c.out)
                            if ev & (_IN | _BAD) and not c.closed:
                                self._on_readable(c)
                        except Exception as e:  # a bug must cost one connection, not all
                            self._internal_error(c, e)
                    elif fd == lfd:
                        try:
                            self._accept(lsock)
                        except Exception as e:  # pragma: no cover - e.g. ENOMEM registering
                            self.stats["internal_errors"] += 1
                            self.last_internal_error = repr(e)
                    elif fd == wfd:
                        try:
                            self._wake_r.recv(4096)
                        except OSError:
                            pass
                        self._take_in_local()
                while self._resume:
                    c = self._resume.pop()
                    if not c.closed and c.waiter is None and c.out is None and c.inbuf:
                        try:
                            if c.mode == _TORCH:
                                self._torch_run(c)
                            else:
                                self._process(c, c.inbuf, True)
                        except Exception as e:
                            self._internal_error(c, e)
                if self._later:  # one more slice of each torch connection's work
                    later, self._later = self._later, []
                    for c in later:
                        if not c.closed:
                            try:
                                self._torch_continue(c)
                            except Exception as e:
                                self._internal_error(c, e)
                if heap or pending:
                    self._expire()
                if self._listen_paused_until and time.monotonic() >= self._listen_paused_until:
                    self._listen_paused_until = 0.0
                    self._poller.register(lfd, _IN)
        finally:
            self._shutdown(lsock)

    def _internal_error(self, c: _Conn, e: Exception) -> None:
        self.stats["internal_errors"] += 1
        self.last_internal_error = repr(e)
        self._close(c)

    def _shutdown(self, lsock: socket.socket) -> None:
        for c in list(self._conns.values()):
            self._close(c, count=False)
        while self._adopt:
            self._adopt.pop().close()
        self._pending.clear()
        for s in (lsock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._poller.close()
        self._waiters.clear()
        self._heap.clear()

    def _accept(self, lsock: socket.socket) -> None:
        pending = self._pending
        fresh = 0  # connections accepted by this call (the newest pending ones)
        for _ in range(_ACCEPT_BATCH):  # the listener stays readable for the rest
            try:
                sock, peer = lsock.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    # Idle sockets must not lock clients out: free a descriptor. Also
                    # when no connection waits (Linux fails accept for want of one
                    # before it looks at the queue): a spare one lets the client just
                    # accepted authenticate (hashlib's first import opens files).
                    if self._free_descriptor(spare=fresh):
                        continue
                    if not self._lpoll.poll(0):
                        return  # nothing waits: the listener is not readable, no spin
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop accepting for a moment instead of spinning
                    # on a listener that stays readable.
                    self._poller.unregister(lsock.fileno())
                    self._listen_paused_until = time.monotonic() + 0.1
                    return
                if e.errno == errno.ECONNABORTED:
                    continue
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            if len(pending) >= self.max_unauthenticated:
                self._drop_oldest_pending()
            fresh += 1
            c = _Conn(sock, peer)
            self._conns[c.fd] = c
            self.stats["accepted"] += 1
            self._poller.register(c.fd, _IN)
            now = time.monotonic()
            pending[c] = now + P.AUTH_TIMEOUT
            if self._torch is None:
                self._send(c, P.frame(P.HELLO, P.MAGIC + c.nonce))
            else:  # greeted once its first bytes say it is not a torch client
                c.mode = _SNIFF
                self._sniffing[c] = now + SNIFF_GRACE

    def _drop_oldest_pending(self) -> None:
        self.stats["unauthenticated_dropped"] += 1
        self._close(next(iter(self._pending)))

    def _free_descriptor(self, spare: int) -> bool:
        """Out of descriptors: close the oldest unauthenticated connection, unless it is one
        of the newest ``spare`` ones, else the torch connection idle longest (for
        ``torch_idle_timeout`` at least, with no wait or reply in progress). False when no
        connection qualifies."""
        if len(self._pending) > spare:
            self._drop_oldest_pending()
            return True
        cutoff = time.monotonic() - self.torch_idle_timeout
        for c, last in self._torch_idle.items():
            if last > cutoff:
                break
            st = c.torch
            if c.out is not None or c.gen is not None or (st is not None and st.wait_keys):
                continue  # inside a store call: closing it now fails that call
            self.stats["torch_evicted"] += 1
            self._close(c)
            return True
        return False

    def _close(self, c: _Conn, count: bool = True) -> None:
        if c.closed:
            return
        c.closed = True
        if count:
            self.stats["closed"] += 1
        self._conns.pop(c.fd, None)
        self._pending.pop(c, None)
        if c.mode == _SNIFF:
            self._sniffing.pop(c, None)
        elif c.torch is not None and self._torch is not None:
            self._torch.drop(c.torch)
            self._torch_conns -= 1
            self._torch_idle.pop(c, None)
            c.gen = None
        try:
            self._poller.unregister(c.fd)
        except (OSError, ValueError, KeyError):
            pass
        try:
            c.sock.close()
        except OSError:
            pass
        w = c.waiter
        if w is not None:
            self._retire(w)
            c.waiter = None
        c.inbuf = bytearray()
        c.out = None
        c.outq = []

    def _set_events(self, c: _Conn, events: int) -> None:
        if c.events != events:
            c.events = events
            self._poller.modify(c.fd, events)

    def _send(self, c: _Conn, data: bytes) -> None:
        """Send one reply; what the kernel does not take now waits in ``c.out`` (and no
        further frame of the connection is handled until it is sent)."""
        if c.out is not None:  # behind a reply still being sent: never interleave bytes
            c.outq.append(data)
            return
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close(c)
            return
        if n < len(data):
            c.out = data
            c.outpos = n
            self._set_events(c, _IN | _OUT)

    def _flush(self, c: _Conn, out: bytes) -> None:
        """Send more of ``out`` (= ``c.out``, the reply being sent)."""
        try:
            n = c.sock.send(memoryview(out)[c.outpos :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        c.outpos += n
        if c.torch is not None:
            self._torch_account(c)  # less unsent: release that part of its charge
            if c.closed:
                return
        if c.outpos >= len(out):
            c.outpos = 0
            if c.gen is not None:  # a chunked reply: its next piece on the next turn
                c.out = None
                self._set_events(c, _IN)
                self._later.append(c)
                return
            if c.outq:
                c.out = c.outq.pop(0)
                return
            c.out = None
            self._set_events(c, _IN)
            if c.waiter is None and c.inbuf:
                self._resume.append(c)

    def _answer(self, c: _Conn, reply: bytes) -> None:
        """Answer the connection's blocked request."""
        c.waiter = None
        self._send(c, reply)
        if not c.closed and c.out is None and c.inbuf:
            self._resume.append(c)  # its queued frames, after this loop turn's events

    def _on_readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(c)
            return
        if not data:
            self._close(c)
            return
        if c.mode:  # a torch client, or a connection whose protocol is not known yet
            self._on_other(c, data)
            return
        if c.waiter is not None or c.out is not None:
            # Busy: keep the frames, in order, for when the request is answered.
            c.inbuf += data
            if len(c.inbuf) > _MAX_QUEUED:  # more than any one frame: not pipelining
                self.stats["protocol_errors"] += 1
                self._close(c)
            return
        if c.inbuf:
            c.inbuf += data
            self._process(c, c.inbuf, True)
        else:
            self._process(c, data, False)

    def _process(self, c: _Conn, buf: bytes | bytearray, in_place: bool) -> None:
        """Handle the complete frames in ``buf`` one after another, stopping at one that
        blocks or whose reply is not fully sent (replies stay in request order; later
        frames wait until it is answered); keep the rest. ``in_place``: ``buf`` is
        ``c.inbuf`` (trimmed in place), else bytes just received."""
        pos = 0
        n = len(buf)
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
                                v = self._data.get(bytes(buf[p + 2 : kend]))
                            reply = None if v is None else _VALUE_HDR.pack(len(v) + 4, P.VALUE, len(v)) + v
                        elif (
                            kend + 4 <= end
                            and kend + 4 + _U32.unpack_from(buf, kend)[0] == end
                            and end - kend - 4 <= _MAX_VALUE
                        ):
                            self._put(bytes(buf[p + 2 : kend]), bytes(buf[kend + 4 : end]))
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
            self.stats["auth_failures" if d.args[0] == "auth" else "protocol_errors"] += 1
            self._close(c)
            return
        except P.StoreProtocolError:
            self.stats["protocol_errors"] += 1
            self._close(c)
            return
        if in_place:  # buf is c.inbuf
            if pos:
                del c.inbuf[:pos]
        elif pos < n:
            c.inbuf = bytearray(memoryview(buf)[pos:])

    # --- torch clients (torch_clients=True) -------------------------------------------------

    def _on_other(self, c: _Conn, data: bytes) -> None:
        """Bytes from a torch client, or the first bytes of a connection not greeted yet."""
        if c.mode == _TORCH:
            c.inbuf += data
            idle = self._torch_idle
            del idle[c]
            idle[c] = time.monotonic()  # most recently active last
            if c.out is None and c.gen is None:
                self._torch_run(c)
            else:  # still sending: keep the input (charged, so bounded by the budget)
                self._torch_account(c)
            return
        buf = bytes(c.inbuf) + data if c.inbuf else data
        head = buf[: len(VALIDATE_PREFIX)]
        if head == VALIDATE_PREFIX[: len(head)]:
            if len(head) < len(VALIDATE_PREFIX):
                c.inbuf = bytearray(buf)  # too short to tell yet
                return
            self._sniffing.pop(c, None)
            self._pending.pop(c, None)
            if self._torch_conns >= self.torch_connection_limit:
                self.stats["torch_refused"] += 1
                self._close(c)
                return
            c.mode = _TORCH
            c.torch = TorchConn(c)
            self._torch_conns += 1
            self._torch_idle[c] = time.monotonic()
            self.stats["torch_accepted"] += 1
            c.inbuf = bytearray(buf)
            self._torch_run(c)
            return
        # Not torch: a distlaunch client (or garbage, which the auth check drops).
        self._sniffing.pop(c, None)
        c.mode = _DL
        c.inbuf = bytearray()
        self._send(c, P.frame(P.HELLO, P.MAGIC + c.nonce))
        if c.closed:
            return
        if c.out is not None:
            c.inbuf += buf
        else:
            self._process(c, buf, False)

    def _torch_run(self, c: _Conn) -> None:
        """Handle a torch client's complete queries in order, stopping while a reply is
        only partly sent or built, and after _TORCH_SLICE seconds (the rest goes on next
        turn); a query breaking the protocol or the budget closes it."""
        st = c.torch
        space = self._torch
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
                    self._later.append(c)
                    break
        except TorchLimitError:
            self.stats["torch_limit_drops"] += 1
            self._close(c)
        except StoreError:  # StoreProtocolError, and stoll's failures
            self.stats["protocol_errors"] += 1
            self._close(c)

    def _pump(self, c: _Conn) -> None:
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
                self._later.append(c)
        elif c.out is None:
            if c.outq:  # a wait's STOP_WAITING that came while the reply was being built
                c.out = c.outq.pop(0)
                self._set_events(c, _IN | _OUT)
            elif c.inbuf:
                self._later.append(c)
        self._torch_account(c)

    def _torch_continue(self, c: _Conn) -> None:
        """A torch connection's work left over from the last loop turn."""
        if c.out is not None:
            return  # _flush goes on when the peer reads
        if c.gen is not None:
            self._pump(c)
        elif c.inbuf:
            self._torch_run(c)

    @staticmethod
    def _torch_held(c: _Conn) -> int:
        """Bytes held for a torch connection outside the key space: its input not parsed
        yet and its replies not sent or not built yet (charged to the budget)."""
        unsent = len(c.out) - c.outpos if c.out is not None else 0
        left = c.gen.left if c.gen is not None else 0
        return len(c.inbuf) + unsent + sum(map(len, c.outq)) + left

    def _torch_account(self, c: _Conn) -> None:
        assert c.torch is not None and self._torch is not None
        try:
            self._torch.account(c.torch, self._torch_held(c))
        except TorchLimitError:
            self.stats["torch_limit_drops"] += 1
            self._close(c)

    def _torch_send(self, st: TorchConn, data: bytes) -> None:
        """A wait's STOP_WAITING, completed by another connection's write."""
        c = st.owner
        assert isinstance(c, _Conn)
        if c.gen is not None:  # after the reply being built, never inside it
            c.outq.append(data)
        elif not c.closed:
            self._send(c, data)

    def _auth(self, c: _Conn, buf: bytes | bytearray, p: int) -> None:
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
        del self._pending[c]
        self._send(c, P.frame(P.AUTH_OK, P.mac(self._secret, P.AUTH_LABEL_SERVER, c.nonce, client_nonce)))

    # --- waiters and deadlines ---------------------------------------------------------------

    def _expire(self) -> None:
        now = time.monotonic()
        sniffing = self._sniffing
        while sniffing:  # silent so far: a client waiting for HELLO
            c, deadline = next(iter(sniffing.items()))
            if deadline > now:
                break
            del sniffing[c]
            try:  # its first bytes may be in already, unread because this turn ran long
                self._on_readable(c)
            except Exception as e:
                self._internal_error(c, e)
            if c.closed or c.mode != _SNIFF:
                continue  # a torch client after all, or greeted on its bytes
            c.mode = _DL
            self._send(c, P.frame(P.HELLO, P.MAGIC + c.nonce))
        pending = self._pending
        while pending:
            c, deadline = next(iter(pending.items()))
            if deadline > now:
                break
            self.stats["auth_failures"] += 1
            self._close(c)  # (removes it from pending)
        heap = self._heap
        while heap and heap[0][0] <= now:
            w = heapq.heappop(heap)[2]
            if not w.done:
                missing = list(itertools.islice((k for k in w.keys if k not in self._data), P.TIMEOUT_KEYS))
                self._retire(w)
                self._answer(w.conn, P.frame(P.TIMEOUT, P.enc_keys(missing)))

    def _retire(self, w: _Waiter) -> None:
        w.done = True
        for k in w.registered:
            lst = self._waiters.get(k)
            if lst is not None:
                lst.pop(w, None)
                if not lst:
                    del self._waiters[k]
        w.registered.clear()

    def _block(self, c: _Conn, op: int, keys: list[bytes], timeout: float) -> None:
        w = _Waiter(c, op, keys)
        c.waiter = w
        self._register(w)
        if not math.isinf(timeout):
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + timeout, self._seq, w))

    def _register(self, w: _Waiter) -> bool:
        """Park ``w`` on each of its keys that does not exist; False when none is missing."""
        data, waiters = self._data, self._waiters
        for k in w.keys:
            if k not in data and k not in w.registered:
                w.registered.add(k)
                waiters.setdefault(k, {})[w] = None
        return bool(w.registered)

    def _wake(self, key: bytes) -> None:
        lst = self._waiters.pop(key, None)
        if not lst:
            return
        for w in lst:
            registered = w.registered
            registered.discard(key)
            # others still missing, or (once) a key it counted was deleted since: park again
            if w.done or registered or self._register(w):
                continue
            self._retire(w)
            self._answer(w.conn, self._reply_for(w))

    def _reply_for(self, w: _Waiter) -> bytes:
        data = self._data
        if w.op == P.GET:
            v = data[w.keys[0]]
            return _VALUE_HDR.pack(len(v) + 4, P.VALUE, len(v)) + v
        if w.op == P.MULTI_GET:
            return self._values_reply([data[k] for k in w.keys])
        return _R_OK

    @staticmethod
    def _values_reply(values: list[bytes]) -> bytes:
        body = P.U32.pack(len(values)) + b"".join(P.U32.pack(len(v)) + v for v in values)
        if len(body) > MAX_FRAME_BYTES:
            return P.frame(P.ERROR, b"multi_get reply would exceed the frame size limit")
        return P.frame(P.VALUES, body)

    def _put(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        if key in self._waiters:
            self._wake(key)

    # --- request handlers: return the reply frame, or None when the request blocks -----------

    def _h_set(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        v = r.value()
        r.done()
        self._put(k, v)
        return _R_OK

    def _h_set_noreply(self, c: _Conn, r: Reader) -> bytes | None:
        self._h_set(c, r)
        return b""

    def _h_get(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        t = r.timeout()
        r.done()
        v = self._data.get(k)
        if v is not None:
            return _VALUE_HDR.pack(len(v) + 4, P.VALUE, len(v)) + v
        self._block(c, P.GET, [k], t)
        return None

    def _h_add(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        amount = r.i64()
        r.done()
        old = self._data.get(k)
        if old is None:
            cur = 0
        else:
            try:
                cur = int(old)
            except ValueError:
                return P.frame(P.ERROR, b"add: the value stored under the key is not an integer")
        # int64 wrap-around, as torch's TCPStore (C++ int64_t arithmetic)
        new = (cur + amount + (1 << 63)) % _INT64 - (1 << 63)
        self._put(k, str(new).encode("ascii"))
        return P.frame(P.INT, P.I64.pack(new))

    def _h_compare_set(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        expected = r.value()
        desired = r.value()
        r.done()
        cur = self._data.get(k)
        if cur is None:
            if expected == b"":
                self._put(k, desired)
                return P.frame(P.VALUE, P.enc_value(desired))
            # torch returns ``expected`` here although nothing is stored (TCPStore quirk).
            return P.frame(P.VALUE, P.enc_value(expected))
        if cur == expected:
            self._put(k, desired)
            cur = desired
        return P.frame(P.VALUE, P.enc_value(cur))

    def _h_check(self, c: _Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        r.done()
        data = self._data
        return _R_TRUE if all(k in data for k in keys) else _R_FALSE

    def _h_wait(self, c: _Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        t = r.timeout()
        r.done()
        data = self._data
        if all(k in data for k in keys):
            return _R_OK
        self._block(c, P.WAIT, keys, t)
        return None

    def _h_delete(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        r.done()
        return _R_TRUE if self._data.pop(k, None) is not None else _R_FALSE

    def _h_num_keys(self, c: _Conn, r: Reader) -> bytes | None:
        r.done()
        return P.frame(P.INT, P.I64.pack(len(self._data)))

    def _h_append(self, c: _Conn, r: Reader) -> bytes | None:
        k = r.key()
        v = r.value()
        r.done()
        old = self._data.get(k, b"")
        if len(old) + len(v) > P.MAX_VALUE_BYTES:
            return P.frame(P.ERROR, f"append: the value would exceed {P.MAX_VALUE_BYTES} bytes".encode())
        self._put(k, old + v)
        return _R_OK

    def _h_multi_get(self, c: _Conn, r: Reader) -> bytes | None:
        keys = r.keys()
        t = r.timeout()
        r.done()
        data = self._data
        if all(k in data for k in keys):
            return self._values_reply([data[k] for k in keys])
        self._block(c, P.MULTI_GET, keys, t)
        return None

    def _h_multi_set(self, c: _Conn, r: Reader) -> bytes | None:
        n = r.count()
        pairs = [(r.key(), r.value()) for _ in range(n)]
        r.done()
        for k, v in pairs:
            self._put(k, v)
        return _R_OK

    def _h_ping(self, c: _Conn, r: Reader) -> bytes | None:
        r.done()
        return _R_OK


class _Drop(Exception):
    pass


def serve_forever(
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | bytes | None = None,
    on_ready: Callable[[StoreServer], object] | None = None,
) -> None:
    """Run a store server in the foreground until SIGINT or SIGTERM, then return.

    For the standalone ``distlaunch store`` command. ``token`` is the job's secret (str or
    bytes); None generates one (pass ``on_ready`` to learn it and the port:
    ``on_ready(server)`` is called once listening, with ``server.port`` and
    ``server.token``). Must run on the main thread. Raises StoreError if the address
    cannot be bound.
    """
    StoreServer(host, port, token).serve_forever(on_ready=on_ready)
