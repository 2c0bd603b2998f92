"""TCP implementation of :class:`~distlaunch.collectives.transport.Transport`.

- One listening socket per process; its ``host:port`` is published in the store under
  ``<prefix>addr/<rank>``. Connections are made lazily, the first time a rank sends to
  a peer, and are one-directional for data: rank a sends to b over the connection *a*
  opened, so two ranks connecting to each other at once never race. Control replies
  (status) travel back over the same socket.
- A connection starts with a mutual challenge-response on the group's secret (random,
  exchanged through the authenticated store), which never travels on the wire: the
  connector sends HELLO step 0 with a nonce Nc; the acceptor answers step 1 with its
  nonce Na and HMAC-SHA256(secret, "acceptor" context); the connector checks it (so it
  never sends data, which peers unpickle for ``*_object`` ops, to an impostor) and
  answers step 2 with HMAC-SHA256(secret, "connector" context). The context holds both
  ranks and both nonces, so a proof cannot be replayed, reflected or used for another
  pair. The connector does this synchronously (one round trip) before its first send.
- Unauthenticated incoming connections are bounded: any byte that is not the next
  expected handshake message closes the connection; one that has not authenticated
  within ``handshake_timeout`` seconds is closed; past ``max_pending`` of them the oldest
  is closed. When accept() runs out of descriptors (EMFILE/ENFILE) the older half of the
  pending ones is closed and accepting pauses for _ACCEPT_PAUSE seconds instead of
  spinning.
  Only authentication is provided: data after the handshake is neither encrypted nor
  integrity-protected (use a trusted network).
- One progress thread owns all reads: it reads a header, matches it against the posted
  receives and then ``recv_into`` the destination buffer directly (an unmatched,
  "unexpected" message is read into a new bytearray and copied once when its receive
  is posted). Sends are written without copying with ``sendmsg([header, memoryview])``,
  first from the posting thread (non-blocking), the rest by the progress thread when the
  socket becomes writable. Sockets are non-blocking with TCP_NODELAY; nothing here
  blocks without a deadline.
- A connection that breaks (EOF, reset) marks the peer lost: its pending and future
  requests fail with PeerLostError.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import hmac
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from ..wire import COLL, DTYPE_NAMES, HEADER_SIZE, HELLO, P2P, STATUS_REP, STATUS_REQ, Header, unpack_header
from . import Check, Request, Transport

_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_SUSPECT_GRACE = 1.0  # seconds; see _conn_failed_locked
_SUSPECT_RECHECK = 0.05  # seconds between looks at a suspect whose handshake is under way
HANDSHAKE_TIMEOUT = 5.0  # seconds an incoming connection may take to authenticate
_ACCEPT_PAUSE = 0.1  # seconds accept() is left alone after running out of descriptors
_LINGER = 5.0  # seconds close() waits for peers to read what was sent (see _linger)
_NONCE, _MAC = 16, 32  # bytes
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def _proof(secret: bytes, role: bytes, connector: int, acceptor: int, nc: bytes, na: bytes) -> bytes:
    """HMAC-SHA256 that ``role`` (b"connector" / b"acceptor") knows the secret, bound to
    both ranks and both nonces."""
    msg = b"distlaunch-coll-v2 %s %d>%d " % (role, connector, acceptor) + nc + na
    return hmac.new(secret, msg, hashlib.sha256).digest()


class _HandshakeRetry(Exception):
    """The acceptor closed (or reset) the connection during the handshake, or this
    process is out of descriptors: worth another try before the deadline."""


class _Conn:
    __slots__ = (
        "sock",
        "peer",
        "outgoing",
        "sendq",
        "events",
        "closed",
        "hdr_buf",
        "hdr_mv",
        "hdr_got",
        "hdr",
        "target",
        "got",
        "req",
        "hs",
    )

    def __init__(self, sock, peer, outgoing):
        self.sock = sock
        self.peer = peer  # None until an incoming connection said HELLO
        self.outgoing = outgoing
        self.sendq: collections.deque[list] = collections.deque()  # [list of memoryviews, Request or None]
        self.events = 0
        self.closed = False
        self.hdr_buf = bytearray(HEADER_SIZE)
        self.hdr_mv = memoryview(self.hdr_buf)
        self.hdr_got = 0
        self.hdr = None  # header of the message being read
        self.target = None  # memoryview the payload goes into
        self.got = 0
        self.req = None  # matched receive, or None (unexpected / control)
        self.hs = None  # incoming, mid-handshake: (claimed rank, Nc, Na)


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _earliest(*waits):
    """The smallest of the select timeouts that are not None (None if all are)."""
    given = [w for w in waits if w is not None]
    return min(given) if given else None


class TcpTransport(Transport):
    """TCP transport between the ranks of one job.

    ``store``: set/get/wait (thread-safe wrapper); ``prefix``: store key namespace;
    ``host``: the address to listen on and publish; ``secret``: bytes both ends of every
    connection prove they know (never sent); ``status_provider(group) -> (seq, op)``: this
    rank's progress, answered to peers diagnosing a timeout; ``abort_handler(header,
    text)``: called on the progress thread when a peer aborts a group;
    ``handshake_timeout``: seconds an incoming connection may take to authenticate
    (pass min(a few seconds, the group timeout)); it and ``max_pending``, the number of
    unauthenticated incoming connections kept at once, are attributes that apply to
    connections accepted after a change.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        prefix: str,
        host: str,
        secret: bytes,
        status_provider: Callable[[int], tuple],
        abort_handler: Callable[[Header, str], None],
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ):
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._prefix = prefix
        self._secret = secret
        self._status_provider = status_provider
        self._abort_handler = abort_handler
        self._lock = threading.Lock()
        self._status_cv = threading.Condition(self._lock)
        self._connect_locks: collections.defaultdict[int, threading.Lock] = collections.defaultdict(
            threading.Lock
        )
        self._out: dict[int, _Conn] = {}  # peer -> outgoing _Conn
        self._conns: set[_Conn] = set()
        self._addrs: dict[int, tuple[str, int]] = {}
        self._posted: dict[tuple[tuple, int], collections.deque[Request]] = {}  # (key, src) -> requests
        self._posted_any: dict[tuple, collections.deque[Request]] = {}  # key -> requests
        # (key, src) -> the messages no receive was posted for yet
        self._unexpected: dict[tuple[tuple, int], collections.deque[tuple[Header, memoryview]]] = {}
        self._lost: dict[int, str] = {}  # peer -> reason
        self._suspects: dict[
            int, tuple[float, str]
        ] = {}  # peer -> (deadline, reason): see _conn_failed_locked
        self._status: dict[tuple[int, int], tuple[int, int]] = {}  # (group, peer) -> (seq, op)
        self._new_conns: list[_Conn] = []
        self._dirty: set[_Conn] = set()
        self._closed = False
        self.handshake_timeout = handshake_timeout
        self.max_pending = max(64, 2 * world_size)
        self._pending: dict[_Conn, float] = {}  # unauthenticated incoming _Conn -> deadline, oldest first
        self._accept_paused_until: float | None = None  # monotonic time, while out of descriptors
        # late_handler(header): called on the progress thread for an unmatched collective
        # message, so the runtime can spot messages of operations it already finished
        self.late_handler: Callable[[Header], None] | None = None
        # point-to-point with the ranks of this node goes over shared memory once a
        # point-to-point call created the links (shm_p2p.links_for); P2P messages only
        self.local: Any = None
        self.local_checked = False
        self.local_lock = threading.Lock()

        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((host, 0))
        self._listen.listen(max(128, world_size))
        self._listen.setblocking(False)
        self.address = (host, self._listen.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, _READ, "listen")
        self._sel.register(self._wake_r, _READ, "wake")
        store.set(f"{prefix}addr/{rank}", f"{host}:{self.address[1]}".encode())
        self._thread = threading.Thread(target=self._run, name=f"distlaunch-tcp-{rank}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- connections

    def _addr_of(self, peer: int, deadline: float) -> tuple[str, int]:
        addr = self._addrs.get(peer)
        if addr is None:
            key = f"{self._prefix}addr/{peer}"
            try:
                self._store.wait([key], max(0.01, deadline - time.monotonic()))
                host, _, port = self._store.get(key).decode().rpartition(":")
            except Exception as e:  # store timeout or connection problem
                raise CollectiveTimeoutError(
                    f"rank {peer} did not publish its address in the store ({e})"
                ) from e
            addr = self._addrs[peer] = (host, int(port))
        return addr

    def _connection(self, peer: int, deadline: float) -> _Conn:
        conn = self._out.get(peer)
        if conn is not None:
            return conn
        with self._connect_locks[peer]:
            conn = self._out.get(peer)
            if conn is not None:
                return conn
            if peer in self._lost:
                raise PeerLostError(f"rank {peer} is lost: {self._lost[peer]}")
            addr = self._addr_of(peer, deadline)
            pause = 0.01
            while True:
                try:
                    sock = self._handshake(peer, addr, deadline)
                    break
                except _HandshakeRetry as e:
                    if time.monotonic() + pause >= deadline:
                        raise CollectiveTimeoutError(
                            f"could not complete the transport handshake with rank {peer} at "
                            f"{addr[0]}:{addr[1]} before the deadline: {e}"
                        ) from e
                    time.sleep(pause)  # the acceptor may be flooded by outsiders: back off
                    pause = min(2 * pause, 0.5)
            conn = _Conn(sock, peer, outgoing=True)
            with self._lock:
                if self._closed:
                    sock.close()
                    raise CollectiveError("transport is closed")
                self._conns.add(conn)
                self._new_conns.append(conn)
                self._out[peer] = conn
            self._wake()
            return conn

    def _handshake(self, peer: int, addr: tuple[str, int], deadline: float) -> socket.socket:
        """Connect to ``peer`` at ``addr`` and run the connector's side of the handshake
        (blocking, until ``deadline``); returns the authenticated non-blocking socket.
        Raises CollectiveTimeoutError, PeerLostError (refused, or the listener failed
        to prove it knows the secret), _HandshakeRetry (closed or reset mid-handshake,
        or out of descriptors)."""
        where = f"{addr[0]}:{addr[1]}"
        nc = os.urandom(_NONCE)
        sock = None
        try:
            sock = socket.create_connection(addr, timeout=max(0.05, deadline - time.monotonic()))
            _tune(sock)
            sock.sendall(Header(HELLO, 0, 0, 0, self.rank, 0, 0, 0, peer, 0, _NONCE).pack() + nc)
            reply = bytearray(HEADER_SIZE + _NONCE + _MAC)
            view, got = memoryview(reply), 0
            while got < len(reply):
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise _HandshakeRetry(
                        f"rank {peer} at {where} closed the connection during the handshake"
                    )
                got += n
            hdr = unpack_header(reply[:HEADER_SIZE])
            na = bytes(reply[HEADER_SIZE : HEADER_SIZE + _NONCE])
            if (hdr.kind, hdr.step, hdr.src, hdr.root, hdr.nbytes) != (
                HELLO,
                1,
                peer,
                self.rank,
                _NONCE + _MAC,
            ) or not hmac.compare_digest(
                bytes(reply[-_MAC:]), _proof(self._secret, b"acceptor", self.rank, peer, nc, na)
            ):
                raise ValueError("its handshake reply does not prove it knows this group's secret")
            sock.sendall(
                Header(HELLO, 0, 0, 0, self.rank, 0, 0, 2, peer, 0, _MAC).pack()
                + _proof(self._secret, b"connector", self.rank, peer, nc, na)
            )
            sock.setblocking(False)
            return sock
        except BaseException as e:
            if sock is not None:
                sock.close()
            if isinstance(e, socket.timeout):
                raise CollectiveTimeoutError(f"connecting to rank {peer} at {where} timed out") from e
            if (
                isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError))
                or isinstance(e, OSError)
                and e.errno in _OUT_OF_FDS
            ):
                raise _HandshakeRetry(str(e)) from e
            if isinstance(e, (OSError, ValueError)):
                self._peer_lost(peer, f"connection to {where} failed: {e}")
                raise PeerLostError(f"rank {peer} is unreachable at {where}: {e}") from e
            raise

    def _wake(self):
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are closing

    # ---------------------------------------------------------------- sending

    def isend(
        self, peer: int, header: Header, payload: memoryview, deadline: float, owner: Any = None
    ) -> Request:
        local = self.local
        if local is not None and header.kind == P2P and peer in local.index:
            return local.send(peer, header, np.frombuffer(payload, np.uint8))
        req = Request(True, peer, (), payload, owner=owner)  # a send is never matched by key
        conn = self._connection(peer, deadline)
        bufs = [memoryview(header.pack())]
        if len(payload):
            bufs.append(payload)
        with self._lock:
            if conn.closed:
                req.complete(
                    PeerLostError(f"rank {peer} is lost: {self._lost.get(peer, 'connection closed')}")
                )
                return req
            self._enqueue(conn, bufs, req)
        return req

    def _enqueue(self, conn, bufs, req):
        # lock held
        conn.sendq.append([bufs, req])
        if len(conn.sendq) == 1:
            self._flush(conn)
        if conn.sendq and not conn.events & _WRITE:
            self._dirty.add(conn)
            if threading.current_thread() is not self._thread:
                self._wake()

    def _flush(self, conn):
        # lock held; write as much as the socket takes without blocking
        while conn.sendq:
            bufs, req = conn.sendq[0]
            try:
                n = conn.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._conn_failed_locked(conn, f"send failed: {e}")
                return
            while n:
                first = bufs[0]
                if n >= len(first):
                    n -= len(first)
                    bufs.pop(0)
                else:
                    bufs[0] = first[n:]
                    n = 0
            if bufs:
                continue
            conn.sendq.popleft()
            if req is not None:
                req.complete()

    def send_control(self, peer: int, header: Header, payload: bytes, deadline: float) -> bool:
        try:
            req = self.isend(peer, header, memoryview(payload), deadline)
        except CollectiveError:
            return False
        return req.wait(max(0.0, deadline - time.monotonic())) and req.error is None

    # ---------------------------------------------------------------- receiving

    def irecv(
        self,
        peer: int | None,
        key: tuple,
        buf: memoryview | None,
        check: Check | None = None,
        owner: Any = None,
    ) -> Request:
        req = Request(False, peer, key, buf, check, owner)
        local = self.local
        if local is not None and key[0] == P2P and (peer is None or peer in local.index):
            req.local = local  # its waits drive the shared-memory progress
        with self._lock:
            item = self._take_unexpected(key, peer)
            if item is None:
                if self._closed:
                    req.complete(CollectiveError("transport is closed"))
                elif peer is not None and peer in self._lost and not self._local_p2p(key, peer):
                    req.complete(PeerLostError(f"rank {peer} is lost: {self._lost[peer]}"))
                elif peer is None:
                    self._posted_any.setdefault(key, collections.deque()).append(req)
                else:
                    self._posted.setdefault((key, peer), collections.deque()).append(req)
                return req
        hdr, data = item
        self._fill(req, hdr, data)
        return req

    def _fill(self, req: Request, hdr: Header, data: memoryview) -> None:
        """Complete ``req`` with an unexpected message's payload (taken as is by a receive
        of any size, else copied)."""
        err = self._accept(req, hdr)
        if err is None:
            if req.buf is None:
                req.buf = data
            else:
                req.buf[:] = data
        req.complete(err)

    def lost(self, peer: int) -> str | None:
        """Why ``peer`` is lost (its connection ended, or its process on this node is
        gone), or None while it is not."""
        why = self._lost.get(peer)
        if why is None and self.local is not None:
            why = self.local.lost(peer)
        return why

    def _local_p2p(self, key: tuple, peer: int) -> bool:
        """True when messages ``key`` from ``peer`` come over the shared-memory links,
        not TCP: the end of a TCP connection then says nothing about them (the links'
        waits notice a peer whose process is gone, after taking what it sent)."""
        local = self.local
        return local is not None and key[0] == P2P and peer in local.index

    def _take_unexpected(self, key, peer):
        # lock held
        if peer is None:
            for (k, src), waiting in self._unexpected.items():
                if k == key and waiting:
                    peer = src
                    break
            else:
                return None
        q = self._unexpected.get((key, peer))
        if not q:
            return None
        item = q.popleft()
        if not q:
            del self._unexpected[(key, peer)]
        return item

    def _take_posted(self, key, src):
        # lock held
        for k, table in (((key, src), self._posted), (key, self._posted_any)):
            q = table.get(k)
            if q:
                req = q.popleft()
                if not q:
                    del table[k]
                return req
        return None

    @staticmethod
    def _accept(req, hdr):
        """None if ``hdr`` fits ``req``, else the exception to fail it with."""
        req.header = hdr
        err = req.check(hdr) if req.check is not None else None
        if err is None and req.buf is not None and hdr.nbytes != len(req.buf):
            err = CollectiveMismatchError(
                f"rank {hdr.src} sent {hdr.nbytes} bytes ({DTYPE_NAMES.get(hdr.dtype, '?')}) "
                f"where this rank expected {len(req.buf)} bytes"
            )
        return err

    def take_leftovers(self, key: tuple) -> list:
        """Remove and return the headers of unexpected messages matching ``key`` (any
        source): messages of a finished collective that no receive will ever take."""
        with self._lock:
            found = [k for k in self._unexpected if k[0] == key]
            return [hdr for k in found for hdr, _ in self._unexpected.pop(k)]

    def cancel(self, req: Request) -> None:
        with self._lock:
            for table, k in ((self._posted, (req.key, req.peer)), (self._posted_any, req.key)):
                q = table.get(k)
                if q and req in q:
                    q.remove(req)
                    if not q:
                        del table[k]

    def fail_owner(self, owner: Any, error: BaseException) -> None:
        victims: list[Request] = []
        with self._lock:
            for table in (self._posted, self._posted_any):
                for k in list(table):
                    keep = collections.deque(r for r in table[k] if r.owner != owner)
                    victims.extend(r for r in table[k] if r.owner == owner)
                    if keep:
                        table[k] = keep
                    else:
                        del table[k]
            for conn in self._conns:
                victims.extend(r for _, r in conn.sendq if r is not None and r.owner == owner)
                if conn.req is not None and conn.req.owner == owner:
                    victims.append(conn.req)
        for r in victims:
            r.complete(error)

    # ---------------------------------------------------------------- status queries

    def query_status(self, peers: list, group: int, deadline: float) -> dict:
        with self._lock:
            for p in peers:
                self._status.pop((group, p), None)
        reachable = []
        for p in peers:
            hdr = Header(STATUS_REQ, 0, 0, 0, self.rank, group, 0, 0, -1, 0, 0)
            if self.send_control(p, hdr, b"", deadline):
                reachable.append(p)
        with self._status_cv:
            self._status_cv.wait_for(
                lambda: all((group, p) in self._status for p in reachable),
                max(0.0, deadline - time.monotonic()),
            )
            return {p: self._status.get((group, p)) for p in peers}

    # ---------------------------------------------------------------- progress thread

    def _run(self):
        try:
            while not self._closed:
                with self._lock:
                    for conn in self._new_conns:
                        if not conn.closed:
                            conn.events = _READ | (_WRITE if conn.sendq else 0)
                            self._sel.register(conn.sock, conn.events, conn)
                    self._new_conns.clear()
                    self._update_interest()
                    wait = _earliest(
                        self._check_suspects(), self._check_pending(), self._check_accept_pause()
                    )
                for key, mask in self._sel.select(wait):
                    what = key.data
                    if what == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    elif what == "listen":
                        self._accept_conn()
                    else:
                        if mask & _WRITE and not what.closed:
                            with self._lock:
                                self._flush(what)
                                self._dirty.add(what)
                        if mask & _READ and not what.closed:
                            self._on_readable(what)
        except Exception as e:  # a bug here must not hang the job silently
            self._shutdown(CollectiveError(f"transport progress thread failed: {e!r}"))
            raise

    def _check_suspects(self):
        """Declare lost the suspects whose grace ran out without an incoming connection;
        returns seconds until the next deadline (None: no suspects). Lock held."""
        now, wait = time.monotonic(), None
        for peer, (deadline, reason) in list(self._suspects.items()):
            if any(c.peer == peer and not c.outgoing for c in self._conns):
                del self._suspects[peer]  # its incoming connection will tell
            elif now >= deadline and any(c.hs is not None and c.hs[0] == peer for c in self._pending):
                # a connection claiming to be that peer is mid-handshake (a late one of a
                # loaded peer): wait for it to prove itself (handshake_timeout bounds it)
                wait = _SUSPECT_RECHECK if wait is None else min(wait, _SUSPECT_RECHECK)
            elif now >= deadline:
                del self._suspects[peer]
                victims = self._peer_lost_locked(peer, reason)
                err = PeerLostError(f"rank {peer} is lost: {reason}")
                for r in victims:
                    r.complete(err)
            else:
                wait = deadline - now if wait is None else min(wait, deadline - now)
        return wait

    def _check_pending(self):
        """Close the unauthenticated connections whose handshake time ran out; returns
        seconds until the next one does (None: none pending). Lock held."""
        now = time.monotonic()
        for conn, deadline in list(self._pending.items()):
            if now < deadline:
                return deadline - now
            self._close_conn_locked(conn)
        return None

    def _check_accept_pause(self):
        """Resume accepting once the pause after running out of descriptors is over;
        returns seconds until then (None: not paused). Lock held."""
        if self._accept_paused_until is None:
            return None
        left = self._accept_paused_until - time.monotonic()
        if left > 0:
            return left
        self._accept_paused_until = None
        self._sel.register(self._listen, _READ, "listen")
        return None

    def _update_interest(self):
        # lock held
        for conn in self._dirty:
            if conn.closed:
                continue
            want = _READ | (_WRITE if conn.sendq else 0)
            if want != conn.events:
                conn.events = want
                try:
                    self._sel.modify(conn.sock, want, conn)
                except (KeyError, ValueError, OSError):
                    pass
        self._dirty.clear()

    def _accept_conn(self):
        try:
            sock, _ = self._listen.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in _OUT_OF_FDS:
                # the listen socket stays readable: stop watching it for a while (else
                # select returns at once, forever), and free descriptors for the ranks'
                # own connections by closing the older half of the unauthenticated ones
                with self._lock:
                    for conn in list(self._pending)[: (len(self._pending) + 1) // 2]:
                        self._close_conn_locked(conn)
                    self._sel.unregister(self._listen)
                    self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE
            return  # else e.g. ECONNABORTED: that client is gone
        sock.setblocking(False)
        _tune(sock)
        conn = _Conn(sock, None, outgoing=False)
        conn.events = _READ
        with self._lock:
            self._conns.add(conn)
            self._pending[conn] = time.monotonic() + self.handshake_timeout
            while len(self._pending) > self.max_pending:
                self._close_conn_locked(next(iter(self._pending)))
        self._sel.register(sock, _READ, conn)

    def _on_readable(self, conn):
        for _ in range(64):  # bounded, so one busy connection cannot starve the others
            try:
                if conn.target is None:
                    n = conn.sock.recv_into(conn.hdr_mv[conn.hdr_got :])
                else:
                    n = conn.sock.recv_into(conn.target[conn.got :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._conn_failed(conn, f"receive failed: {e}")
                return
            if n == 0:
                self._conn_failed(conn, "connection closed by peer")
                return
            if conn.target is None:
                conn.hdr_got += n
                if conn.hdr_got < HEADER_SIZE:
                    continue
                conn.hdr_got = 0
                try:
                    hdr = unpack_header(conn.hdr_buf)
                except ValueError as e:
                    self._conn_failed(conn, str(e))
                    return
                if not self._begin(conn, hdr):
                    return
                if hdr.nbytes == 0:
                    self._end(conn)
            else:
                conn.got += n
                if conn.got == len(conn.target):
                    self._end(conn)

    def _begin(self, conn: _Conn, hdr: Header) -> bool:
        """Choose where the payload of ``hdr`` goes; False when the connection was dropped."""
        if conn.peer is None:
            expect = (HELLO, 0, _NONCE) if conn.hs is None else (HELLO, 2, _MAC)
            if (hdr.kind, hdr.step, hdr.nbytes) != expect:
                self._drop(conn)
                return False
        elif hdr.src != conn.peer:
            self._conn_failed(conn, f"protocol error: message claims to come from rank {hdr.src}")
            return False
        conn.hdr = hdr
        conn.got = 0
        conn.req = None
        if hdr.kind in (COLL, P2P):
            with self._lock:
                req = self._take_posted((hdr.kind, hdr.group, hdr.seq), conn.peer)
            if req is not None:
                err = self._accept(req, hdr)
                if err is None:
                    if req.buf is None:  # a receive of any size: the payload's own buffer
                        req.buf = memoryview(bytearray(hdr.nbytes))
                    conn.req = req
                    conn.target = req.buf
                    return True
                req.complete(err)
        conn.target = memoryview(bytearray(hdr.nbytes))
        return True

    def _end(self, conn):
        hdr, req, data = conn.hdr, conn.req, conn.target
        conn.hdr = conn.req = conn.target = None
        conn.got = 0
        if req is not None:
            req.complete()
        elif hdr.kind in (COLL, P2P):
            self._unmatched(hdr, data)
        elif hdr.kind == HELLO:
            self._on_hello(conn, hdr, bytes(data))
        elif hdr.kind == STATUS_REQ:
            seq, op = self._status_provider(hdr.group)
            reply = Header(STATUS_REP, 0, op, 0, self.rank, hdr.group, seq, 0, -1, 0, 0)
            with self._lock:
                if not conn.closed:
                    self._enqueue(conn, [memoryview(reply.pack())], None)
        elif hdr.kind == STATUS_REP:
            with self._status_cv:
                self._status[(hdr.group, hdr.src)] = (hdr.seq, hdr.op)
                self._status_cv.notify_all()
        else:  # ABORT (or future kinds): the runtime decides
            self._abort_handler(hdr, bytes(data).decode("utf-8", "replace"))

    def _unmatched(self, hdr: Header, data: memoryview) -> None:
        """A whole message that no receive took when it began: to a receive posted
        since, else kept as unexpected."""
        key = (hdr.kind, hdr.group, hdr.seq)
        with self._lock:
            req = self._take_posted(key, hdr.src)
            if req is None:
                self._unexpected.setdefault((key, hdr.src), collections.deque()).append((hdr, data))
        if req is None:
            if hdr.kind == COLL and self.late_handler is not None:
                self.late_handler(hdr)
            return
        self._fill(req, hdr, data)

    def local_route(self, hdr: Header) -> tuple[np.ndarray, Callable[[], None]]:
        """Where the payload of ``hdr``, a P2P message arriving over shared memory, goes
        (a matching posted receive's buffer, else a new one kept as unexpected), and
        what to call once it is there (see shm_p2p)."""
        with self._lock:
            req = self._take_posted((hdr.kind, hdr.group, hdr.seq), hdr.src)
        if req is not None:
            err = self._accept(req, hdr)
            if err is None:
                if req.buf is None:
                    req.buf = memoryview(bytearray(hdr.nbytes))
                return np.frombuffer(req.buf, np.uint8), req.complete
            req.complete(err)
        data = memoryview(bytearray(hdr.nbytes))
        return np.frombuffer(data, np.uint8), lambda: self._unmatched(hdr, data)

    def _on_hello(self, conn, hdr, data):
        """Acceptor's side of the handshake (kind and size already checked by _begin)."""
        if conn.peer is None and conn.hs is None and 0 <= hdr.src < self.world_size and hdr.root == self.rank:
            na = os.urandom(_NONCE)
            conn.hs = (hdr.src, data, na)
            proof = _proof(self._secret, b"acceptor", hdr.src, self.rank, data, na)
            reply = Header(HELLO, 0, 0, 0, self.rank, 0, 0, 1, hdr.src, 0, _NONCE + _MAC).pack() + na + proof
            with self._lock:
                if not conn.closed:
                    self._enqueue(conn, [memoryview(reply)], None)
            return
        if conn.peer is None and conn.hs is not None and hdr.src == conn.hs[0]:
            src, nc, na = conn.hs
            if hmac.compare_digest(data, _proof(self._secret, b"connector", src, self.rank, nc, na)):
                with self._lock:
                    self._pending.pop(conn, None)
                    conn.peer, conn.hs = src, None
                return
        self._drop(conn)

    # ---------------------------------------------------------------- failures and shutdown

    def _drop(self, conn):
        with self._lock:
            self._close_conn_locked(conn)

    def _close_conn_locked(self, conn):
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()

    def _conn_failed(self, conn, reason):
        with self._lock:
            self._conn_failed_locked(conn, reason)

    def _conn_failed_locked(self, conn, reason):
        victims = []
        peer = conn.peer
        self._close_conn_locked(conn)
        if conn.req is not None:
            victims.append(conn.req)
        victims.extend(r for _, r in conn.sendq if r is not None)
        conn.sendq.clear()
        # A peer that exits closes both directions. Data from it arrives only on its own
        # (incoming) connection, which may still hold its last messages, or even wait in
        # the accept queue: the end of our outgoing connection only makes it a suspect,
        # lost if no incoming connection shows up within _SUSPECT_GRACE seconds.
        if conn.outgoing:
            if self._out.get(peer) is conn:
                del self._out[peer]
            if not self._closed:
                self._suspects.setdefault(peer, (time.monotonic() + _SUSPECT_GRACE, reason))
                if threading.current_thread() is not self._thread:
                    self._wake()
        elif peer is not None and not self._closed:
            victims.extend(self._peer_lost_locked(peer, reason))
        err = PeerLostError(f"rank {peer} is lost: {reason}")
        for r in victims:
            r.complete(err)

    def _peer_lost(self, peer, reason):
        with self._lock:
            victims = self._peer_lost_locked(peer, reason)
        err = PeerLostError(f"rank {peer} is lost: {reason}")
        for r in victims:
            r.complete(err)

    def _peer_lost_locked(self, peer, reason):
        self._lost.setdefault(peer, reason)
        victims: list = []
        for k in [k for k in self._posted if k[1] == peer and not self._local_p2p(k[0], peer)]:
            victims.extend(self._posted.pop(k))
        out = self._out.pop(peer, None)
        if out is not None:
            victims.extend(r for _, r in out.sendq if r is not None)
            out.sendq.clear()
            self._close_conn_locked(out)
        return victims

    def _linger(self, deadline: float) -> None:
        """Close gracefully (progress thread stopped): write what is queued, half-close
        every outgoing connection and wait, until ``deadline``, for each peer to read it
        all and close its end, draining whatever arrives meanwhile. Closing a socket
        whose receive queue holds unread bytes makes Linux send RST, and a peer whose
        connection is reset may lose data it has not read yet; a peer destroying its
        group at the same time drains our connection here, so neither waits for the
        other. What MPI_Finalize and torch's destroy_process_group promise: a completed
        send is delivered even if the sender then exits."""
        with self._lock:
            outgoing = {c for c in self._out.values() if not c.closed}
            conns = [c for c in self._conns if not c.closed]
        if not outgoing:
            return
        sel = selectors.DefaultSelector()
        try:
            for c in conns:
                if c in outgoing and not c.sendq:
                    self._half_close(c)
                sel.register(c.sock, _READ | (_WRITE if c.sendq else 0), c)
            while outgoing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                for key, mask in sel.select(left):
                    c = key.data
                    if mask & _WRITE and c.sendq:
                        with self._lock:
                            self._flush(c)
                        if c.closed:
                            sel.unregister(key.fileobj)
                            outgoing.discard(c)
                            continue
                        if not c.sendq:
                            self._half_close(c)
                            sel.modify(c.sock, _READ, c)
                    if mask & _READ:
                        try:
                            more = c.sock.recv(1 << 16)
                        except (BlockingIOError, InterruptedError):
                            continue
                        except OSError:
                            more = b""
                        if not more:  # the peer has read everything and closed
                            sel.unregister(c.sock)
                            outgoing.discard(c)
                            # incoming: the peer lingers for our end of it, as we do
                            self._half_close(c)
        finally:
            sel.close()

    @staticmethod
    def _half_close(conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # FIN after the data already written
        except OSError:
            pass

    def _shutdown(self, error):
        with self._lock:
            self._closed = True
            victims = [r for q in self._posted.values() for r in q]
            victims += [r for q in self._posted_any.values() for r in q]
            for conn in list(self._conns):
                victims.extend(r for _, r in conn.sendq if r is not None)
                if conn.req is not None:
                    victims.append(conn.req)
                self._close_conn_locked(conn)
            self._posted.clear()
            self._posted_any.clear()
        for r in victims:
            r.complete(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.local is not None:
            self.local.close()
        self._wake()
        self._thread.join(timeout=5)
        self._linger(time.monotonic() + _LINGER)
        self._shutdown(CollectiveError("the process group was destroyed"))
        for s in (self._listen, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()
