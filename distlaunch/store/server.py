"""The store server's event loop: one background thread running epoll (poll elsewhere)
over non-blocking sockets; ``StoreServer`` is the public class.

Why one thread and no asyncio: the work per request is a dict operation, so one loop is
as fast as Python gets, there is no locking, and ``import asyncio`` would cost workers
tens of milliseconds of start-up. Three layers: the loop (here: accept, descriptors,
deadlines, sending, closing), the connections' protocols (session.py: handshake,
framing, torch clients) and the socket-free key-value core (core.py). Blocked
``get``/``wait``/``multi_get`` calls are parked in the core on per-key waiter lists
(woken by the write that creates the key, no polling) and on a deadline heap (the server
answers TIMEOUT at the deadline, so the connection never gets out of step). Each
connection has its own input buffer; a frame that breaks the protocol drops that
connection only.

Replies are sent in order; one that is only partly sent holds those behind it.

Unauthenticated connections are kept in accept order (which is also auth-deadline
order); past ``max_unauthenticated``, or when accept runs out of descriptors, the oldest
one is closed, so idle sockets cannot lock out a client that authenticates promptly.

torch clients (``torch_clients=True``): a new connection is not greeted at once (see
session.py); one silent for ``SNIFF_GRACE`` seconds is greeted by the loop (a client that
waits for HELLO before sending anything).
"""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from ..errors import StoreError
from . import protocol as P
from .session import SNIFF, Conn, Sessions

__all__ = ["StoreServer", "serve_forever"]

_IN = select.POLLIN
_OUT = select.POLLOUT
_BAD = select.POLLERR | select.POLLHUP | getattr(select, "POLLNVAL", 0)
_ACCEPT_BATCH = 64  # accepts per loop turn, so a connect flood cannot starve handshakes
_RECV = 65536  # below glibc's mmap threshold: a bigger recv buffer costs 3 syscalls per call
SNIFF_GRACE = 0.1  # seconds a torch-enabled server waits for a new connection's first bytes


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
        self._torch_idle: dict[Conn, float] = {}
        self._later: list[Conn] = []  # torch connections with work left for the next turn
        self._torch_conns = 0
        # Connections not greeted yet (torch clients on) -> greeting deadline, in accept order.
        self._sniffing: dict[Conn, float] = {}
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
        self._conns: dict[int, Conn] = {}
        # Unauthenticated connections -> auth deadline, in accept (= deadline) order.
        self._pending: dict[Conn, float] = {}
        self._resume: list[Conn] = []
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
        self._sessions = Sessions(self, secret, torch_clients, torch_max_bytes)
        self._core = self._sessions.core
        self._torch = self._sessions.torch  # torch clients' key space (None: off)

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, listener: socket.socket | None = None) -> StoreServer:
        """Bind, listen and start the event-loop thread. Returns self. Raises StoreError
        when already started or when the address cannot be bound. ``listener``: a socket
        already listening on the server's address, which the server takes over (bound
        early, so that clients told of its port queue in its backlog until the loop
        runs)."""
        if self._thread is not None or self._stopped:
            raise StoreError("StoreServer.start(): already started (a server runs once)")
        limit = _raise_nofile_limit()
        if limit is not None:
            self.torch_connection_limit = min(self.max_torch_connections, max(1, limit - fd_reserve(limit)))
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            lsock = listener or socket.create_server(
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
            c = Conn(sock, "local")
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
        next_deadline = self._core.next_deadline  # inf: no waiter has a deadline
        pending = self._pending
        sniffing = self._sniffing
        sessions = self._sessions
        try:
            while not self._stopping:
                timeout: float | None = None
                wait_deadline = next_deadline()
                if wait_deadline < math.inf or pending:
                    first = min(
                        wait_deadline,
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
                            sessions.resume(c)
                        except Exception as e:
                            self._internal_error(c, e)
                if self._later:  # one more slice of each torch connection's work
                    later, self._later = self._later, []
                    for c in later:
                        if not c.closed:
                            try:
                                sessions.torch_continue(c)
                            except Exception as e:
                                self._internal_error(c, e)
                if pending or next_deadline() < math.inf:
                    self._expire()
                if self._listen_paused_until and time.monotonic() >= self._listen_paused_until:
                    self._listen_paused_until = 0.0
                    self._poller.register(lfd, _IN)
        finally:
            self._shutdown(lsock)

    def _internal_error(self, c: Conn, e: Exception) -> None:
        self.stats["internal_errors"] += 1
        self.last_internal_error = repr(e)
        self.conn_close(c)

    def _shutdown(self, lsock: socket.socket) -> None:
        for c in list(self._conns.values()):
            self.conn_close(c, count=False)
        while self._adopt:
            self._adopt.pop().close()
        self._pending.clear()
        for s in (lsock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._poller.close()
        self._core.clear_waiters()

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
            c = Conn(sock, peer)
            self._conns[c.fd] = c
            self.stats["accepted"] += 1
            self._poller.register(c.fd, _IN)
            now = time.monotonic()
            pending[c] = now + P.AUTH_TIMEOUT
            if self._torch is None:
                self._sessions.greet(c)
            else:  # greeted once its first bytes say it is not a torch client
                c.mode = SNIFF
                self._sniffing[c] = now + SNIFF_GRACE

    def _drop_oldest_pending(self) -> None:
        self.stats["unauthenticated_dropped"] += 1
        self.conn_close(next(iter(self._pending)))

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
            self.conn_close(c)
            return True
        return False

    def conn_close(self, c: Conn, count: bool = True) -> None:
        if c.closed:
            return
        c.closed = True
        if count:
            self.stats["closed"] += 1
        self._conns.pop(c.fd, None)
        self._pending.pop(c, None)
        if c.mode == SNIFF:
            self._sniffing.pop(c, None)
        elif c.torch is not None and self._torch is not None:
            self._torch_conns -= 1
            self._torch_idle.pop(c, None)
        self._sessions.forget(c)  # its blocked request, its torch state
        try:
            self._poller.unregister(c.fd)
        except (OSError, ValueError, KeyError):
            pass
        try:
            c.sock.close()
        except OSError:
            pass
        c.inbuf = bytearray()
        c.out = None
        c.outq = []

    def conn_events(self, c: Conn, events: int) -> None:
        if c.events != events:
            c.events = events
            self._poller.modify(c.fd, events)

    def conn_send(self, c: Conn, data: bytes) -> None:
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
            self.conn_close(c)
            return
        if n < len(data):
            c.out = data
            c.outpos = n
            self.conn_events(c, _IN | _OUT)

    def _flush(self, c: Conn, out: bytes) -> None:
        """Send more of ``out`` (= ``c.out``, the reply being sent)."""
        try:
            n = c.sock.send(memoryview(out)[c.outpos :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.conn_close(c)
            return
        c.outpos += n
        if c.torch is not None:
            self._sessions.torch_account(c)  # less unsent: release that part of its charge
            if c.closed:
                return
        if c.outpos >= len(out):
            c.outpos = 0
            if c.gen is not None:  # a chunked reply: its next piece on the next turn
                c.out = None
                self.conn_events(c, _IN)
                self._later.append(c)
                return
            if c.outq:
                c.out = c.outq.pop(0)
                return
            c.out = None
            self.conn_events(c, _IN)
            if c.waiter is None and c.inbuf:
                self._resume.append(c)

    def _on_readable(self, c: Conn) -> None:
        try:
            data = c.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.conn_close(c)
            return
        if not data:
            self.conn_close(c)
            return
        self._sessions.received(c, data)

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
            if c.closed or c.mode != SNIFF:
                continue  # a torch client after all, or greeted on its bytes
            self._sessions.greet(c)
        pending = self._pending
        while pending:
            c, deadline = next(iter(pending.items()))
            if deadline > now:
                break
            self.stats["auth_failures"] += 1
            self.conn_close(c)  # (removes it from pending)
        self._core.expire(now)  # blocked requests past their deadline: TIMEOUT

    # --- what the sessions ask of the loop (session.Loop) -----------------------------------

    def conn_resume(self, c: Conn) -> None:
        self._resume.append(c)

    def conn_later(self, c: Conn) -> None:
        self._later.append(c)

    def conn_authenticated(self, c: Conn) -> None:
        del self._pending[c]

    def conn_sniffed(self, c: Conn) -> None:
        self._sniffing.pop(c, None)

    def conn_admit_torch(self, c: Conn) -> bool:
        self._sniffing.pop(c, None)
        self._pending.pop(c, None)
        if self._torch_conns >= self.torch_connection_limit:
            self.stats["torch_refused"] += 1
            self.conn_close(c)
            return False
        self._torch_conns += 1
        self._torch_idle[c] = time.monotonic()
        self.stats["torch_accepted"] += 1
        return True

    def conn_active(self, c: Conn) -> None:
        idle = self._torch_idle
        del idle[c]
        idle[c] = time.monotonic()  # most recently active last


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
