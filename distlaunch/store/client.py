"""Blocking store client with torch c10d ``Store`` semantics, and a prefixed view.

Thread-safety: a ``StoreClient`` may be shared between threads. Each request holds the
client's lock from sending the request until its reply is read, so requests from
different threads are serialised on the one connection; a ``get``/``wait`` that blocks
therefore also delays the other threads' calls on the same client. For independent
blocking calls give each thread its own connection with ``clone()`` (as torch suggests
for ``Store.clone``).
"""

from __future__ import annotations

import errno
import math
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..env import lookup, resolver_name
from ..errors import StoreAuthError, StoreConnectionError, StoreError, StoreProtocolError, StoreTimeoutError
from . import protocol as P
from .protocol import HEADER, HEADER_SIZE, Reader

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import NoReturn

__all__ = ["StoreClient", "PrefixStore"]

# What a value may be given as (str is UTF-8 encoded; the store keeps bytes).
_ValueLike = str | bytes | bytearray | memoryview

# struct timeval for SO_RCVTIMEO where its layout is known (two C longs on Linux).
_TIMEVAL = struct.Struct("@ll") if sys.platform.startswith("linux") else None
# Slack on top of a blocking call's timeout before the client gives up on a server that
# should already have answered TIMEOUT (it is then hung or the network is).
_REPLY_GRACE = 10.0
_SET_HEADER = struct.Struct("!IBH")  # frame header + the key's length prefix
_RETRYABLE_CONNECT = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.EAGAIN,
}
# Name lookups that may succeed later (a node's DNS entry appears after it starts).
_RETRYABLE_LOOKUP = {socket.EAI_NONAME, socket.EAI_AGAIN} | (
    {socket.EAI_NODATA} if hasattr(socket, "EAI_NODATA") else set()
)
# A store greets at once; an accepting peer silent this long is not one (or is stuck).
_GREETING_SECONDS = 3.0
# One connection attempt at most this long (a host that drops SYNs), so the retry
# callback hears about it periodically.
_ATTEMPT_SECONDS = 10.0


class _NoGreeting(StoreConnectionError):
    """The peer accepted the connection but closed it or stayed silent instead of greeting
    (retried while connecting: a store that is starting, or another program's port)."""


def _key(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, not {type(key).__name__}")
    b = key.encode("utf-8")
    if not 0 < len(b) <= P.MAX_KEY_BYTES:
        raise ValueError(f"store key must be 1..{P.MAX_KEY_BYTES} bytes of UTF-8, got {len(b)}")
    return b


def _value(value: _ValueLike) -> bytes:
    if isinstance(value, str):
        b = value.encode("utf-8")
    elif isinstance(value, bytes):
        b = value
    elif isinstance(value, (bytearray, memoryview)):
        b = bytes(value)
    else:
        raise TypeError(f"store values are bytes or str, not {type(value).__name__}")
    if len(b) > P.MAX_VALUE_BYTES:
        raise ValueError(f"store value of {len(b)} bytes exceeds the {P.MAX_VALUE_BYTES}-byte limit")
    return b


def _keys(keys: Iterable[str]) -> list[bytes]:
    if isinstance(keys, str):
        raise TypeError("keys must be a list of str, not one str")
    ks = [_key(k) for k in keys]
    if len(ks) > P.MAX_KEYS_PER_REQUEST:
        raise ValueError(f"{len(ks)} keys in one request exceed the limit of {P.MAX_KEYS_PER_REQUEST}")
    return ks


def _what(what: str | tuple[str, str]) -> str:
    if isinstance(what, tuple):
        return f"{what[0]}({what[1]!r})"
    return what


def _names(ks: list[bytes]) -> str:
    """The keys of a request for an error message (abbreviated when many)."""
    if len(ks) <= 8:
        return repr([k.decode("utf-8") for k in ks])
    return f"{len(ks)} keys"


def _timeout(timeout: float) -> float:
    t = float(timeout)
    if not t > 0:  # also rejects NaN
        raise ValueError(f"timeout must be > 0 seconds (math.inf for none), got {t!r}")
    return t


@dataclass(frozen=True)
class StoreAddress:
    """Where a job's store is and the token that opens it: ``connect()`` returns a client.

    ``local`` is set in the process that runs the store: an authenticated local connection
    (``StoreServer.connect_local``), so that process skips the HMAC handshake."""

    host: str
    port: int
    token: str
    local: Callable[[], socket.socket] | None = None

    def connect(
        self,
        timeout: float,
        connect_timeout: float | None = None,
        on_retry: Callable[[str, float], object] | None = None,
    ) -> StoreClient:
        """A new ``StoreClient`` on this address (blocks up to ``connect_timeout`` seconds
        while the store is not up yet; every call then up to ``timeout`` seconds). Raises
        what ``StoreClient`` raises: StoreConnectionError, StoreAuthError."""
        return StoreClient(
            self.host,
            self.port,
            token=self.token,
            timeout=timeout,
            connect_timeout=connect_timeout,
            on_retry=on_retry,
            connect=self.local,
        )


class StoreClient:
    """A blocking connection to a distlaunch store (semantics of torch c10d ``Store``).

    ``StoreClient(host, port, token=None, timeout=300.0, connect_timeout=None)``

    * ``token``: the job's secret (str or bytes). None reads ``DISTLAUNCH_STORE_TOKEN``
      from the environment; with neither, the server refuses the connection.
    * ``timeout``: float seconds, the default for blocking calls (``get``, ``wait``,
      ``multi_get``) and the limit for any reply; ``math.inf`` waits forever.
    * ``connect_timeout``: seconds to keep retrying a refused connection (like
      TCPStore's client, so workers may start before the server); default ``timeout``.
    * ``ack_set``: make ``set`` wait for the server's acknowledgement (default False:
      like TCPStore, ``set`` returns once sent; see ``set``).
    * ``on_retry``: called as ``on_retry(problem, waited)`` after each failed connection
      attempt (``problem``: one line saying what is wrong with the endpoint; ``waited``:
      seconds since connecting began), so a caller can report a long wait or stop it by
      raising (the exception propagates from the constructor).
    * ``connect``: for the process that runs the server: a callable returning a socket
      already connected and authenticated (``StoreServer.connect_local``); ``host`` and
      ``port`` then only name the store in messages, and ``clone`` calls it again.

    Connecting blocks. Refused or reset connections, unreachable hosts, host names that
    do not resolve (yet), and peers that accept but close or send no greeting within
    3 s are retried until ``connect_timeout``. Raises StoreTimeoutError if the server is
    not reachable within ``connect_timeout`` (naming the last problem), StoreAuthError if
    it rejects the token, StoreConnectionError for other connection failures,
    StoreProtocolError if the peer is not a distlaunch store.

    Every method may raise StoreConnectionError when the connection is (or was) lost; the
    client does not reconnect (use a new one). A call interrupted by an exception (e.g.
    KeyboardInterrupt from a signal handler) closes the connection, whose reply would
    otherwise answer the next call. Thread-safe; see the module docstring.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str | bytes | None = None,
        timeout: float = 300.0,
        connect_timeout: float | None = None,
        ack_set: bool = False,
        on_retry: Callable[[str, float], object] | None = None,
        connect: Callable[[], socket.socket] | None = None,
    ) -> None:
        self.host = host
        self.port = int(port)
        if token is None:
            token = lookup("DISTLAUNCH_STORE_TOKEN")
        self._token = token
        self._secret = P.secret_bytes(token) if token is not None else b""
        self.timeout = _timeout(timeout)
        self._connect_timeout = self.timeout if connect_timeout is None else _timeout(connect_timeout)
        self._ack_set = bool(ack_set)
        self._on_retry = on_retry
        self._local = connect
        self._unacked = False  # an unacknowledged set was sent since the last reply
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._buf = b""
        self._broken: str | None = None
        self._sock_limit: float | None = None  # the request limit the socket timeout is set for
        self._connect()

    # --- connection -------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._local is not None:
            self._sock = self._local()
            self._sock_limit = None
            return
        start = time.monotonic()
        deadline = start + self._connect_timeout
        delay = 0.01
        problem: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeoutError(
                    f"could not connect to the store at {self.host}:{self.port} within "
                    f"{self._connect_timeout:g} s: {problem}"
                )
            try:
                sock = socket.create_connection(
                    (resolver_name(self.host), self.port),  # type: ignore[arg-type]  # it takes bytes
                    timeout=min(remaining, _ATTEMPT_SECONDS),
                )
            except OSError as e:
                problem = self._connect_problem(e)
                if problem is None:
                    raise StoreConnectionError(
                        f"cannot connect to the store at {self.host}:{self.port}: {e}"
                    ) from e
            else:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sock = sock
                try:
                    self._handshake(sock, max(deadline - time.monotonic(), 1.0))
                    break
                except _NoGreeting as e:
                    self._drop("handshake failed")
                    self._broken = None
                    problem = str(e)
                except BaseException:
                    self._drop("handshake failed")
                    raise
            if self._on_retry is not None:
                self._on_retry(problem, time.monotonic() - start)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        self._sock_limit = None

    def _connect_problem(self, e: OSError) -> str | None:
        """What a failed connection attempt says about the endpoint (which the caller
        names), in one line; None when retrying cannot help."""
        if isinstance(e, socket.gaierror):
            if e.errno in _RETRYABLE_LOOKUP:
                return f"the host name {self.host!r} does not resolve ({e.strerror})"
            return None
        if isinstance(e, socket.timeout) or e.errno == errno.ETIMEDOUT:
            return "connecting timed out (a wrong or unreachable address, or a firewall dropping the packets)"
        if e.errno == errno.ECONNREFUSED:
            return (
                "connection refused (nothing listens on that port yet; a socket bound "
                "there without listening looks the same)"
            )
        if e.errno in _RETRYABLE_CONNECT:
            return f"cannot reach it ({e.strerror or e})"
        return None

    def _handshake(self, sock: socket.socket, timeout: float) -> None:
        """Read the greeting (raises _NoGreeting when the peer closes or stays silent for
        _GREETING_SECONDS) and authenticate within ``timeout`` s."""
        greeting = min(timeout, _GREETING_SECONDS)
        sock.settimeout(greeting)
        where = f"the store at {self.host}:{self.port}"
        # a server that also serves torch's clients greets at once on this, not after a pause
        self._sendall(sock, P.frame(P.CLIENT_HELLO, P.MAGIC))
        try:
            mtype, body = self._read_frame(sock)
        except StoreTimeoutError:
            raise _NoGreeting(
                f"the process listening there accepted the connection but sent "
                f"no greeting within {greeting:g} s (another program on that "
                f"port, not a distlaunch store?)"
            ) from None
        except StoreConnectionError:
            raise _NoGreeting(
                "the process listening there closed the connection before "
                "greeting (another program on that port, not a distlaunch "
                "store?)"
            ) from None
        sock.settimeout(timeout)
        if mtype != P.HELLO or len(body) != len(P.MAGIC) + P.NONCE_BYTES or not body.startswith(P.MAGIC):
            raise StoreProtocolError(f"{where} did not greet like a distlaunch store")
        server_nonce = body[len(P.MAGIC) :]
        client_nonce = os.urandom(P.NONCE_BYTES)
        proof = P.mac(self._secret, P.AUTH_LABEL_CLIENT, server_nonce, client_nonce)
        self._sendall(sock, P.frame(P.AUTH, client_nonce + proof))
        hint = (
            "no token was given (pass token= or set DISTLAUNCH_STORE_TOKEN)"
            if self._token is None
            else "the token does not match the store's"
        )
        try:
            mtype, body = self._read_frame(sock)
        except StoreConnectionError:
            # No AUTH_FAIL: not a token mismatch (the server always says so first) but, e.g.,
            # a store that dropped this pending connection under a flood of unauthenticated
            # ones: retried like a missing greeting.
            raise _NoGreeting(
                f"{where} closed the connection during authentication without "
                f"rejecting the token (a busy store?)"
            ) from None
        if mtype == P.AUTH_FAIL:
            raise StoreAuthError(f"{where} rejected the secret token: {hint}")
        if mtype != P.AUTH_OK or len(body) != P.MAC_BYTES:
            raise StoreProtocolError(f"{where} sent message type {mtype:#x} during authentication")
        if not P.macs_equal(body, P.mac(self._secret, P.AUTH_LABEL_SERVER, server_nonce, client_nonce)):
            raise StoreAuthError(f"{where} could not prove it knows the secret token")

    def _set_sock_limit(self, sock: socket.socket, limit: float) -> None:
        """Bound each send/recv by ``limit`` seconds (a blocking request passes its
        server-side timeout plus ``_REPLY_GRACE``).

        Kernel socket timeouts (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket instead of
        Python's socket timeout: Python's adds a poll() before every send and recv, which
        costs more than the rest of a small request. Elsewhere, Python's timeout is used.
        """
        self._sock_limit = limit
        t = 0.0 if math.isinf(limit) else limit  # 0 = no timeout
        if _TIMEVAL is not None:
            tv = _TIMEVAL.pack(int(t), int((t - int(t)) * 1e6))
            try:
                sock.settimeout(None)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
                return
            except OSError:
                pass
        sock.settimeout(t or None)

    def _drop(self, why: str) -> None:
        if self._broken is None:  # keep the first reason (e.g. "closed by the client")
            self._broken = why
        sock, self._sock = self._sock, None
        self._buf = b""
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _sendall(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except OSError as e:
            raise StoreConnectionError(
                f"lost the connection to the store at {self.host}:{self.port}: {e}"
            ) from e

    def _read_frame(self, sock: socket.socket) -> tuple[int, bytes]:
        """Read one whole frame (type, payload) from ``sock`` (the client's socket)."""
        buf = self._buf
        try:
            while len(buf) < HEADER_SIZE:
                chunk = sock.recv(65536)
                if not chunk:
                    raise StoreConnectionError(f"the store at {self.host}:{self.port} closed the connection")
                buf += chunk
            length, mtype = HEADER.unpack_from(buf)
            if length > P.MAX_FRAME_BYTES:
                raise StoreProtocolError(f"reply of {length} bytes exceeds the frame limit")
            end = HEADER_SIZE + length
            if len(buf) < end:
                parts = [buf]
                have = len(buf)
                while have < end:
                    chunk = sock.recv(max(65536, min(end - have, 1 << 22)))
                    if not chunk:
                        raise StoreConnectionError(
                            f"the store at {self.host}:{self.port} closed the connection"
                        )
                    parts.append(chunk)
                    have += len(chunk)
                buf = b"".join(parts)
        except StoreError:  # (StoreConnectionError is an OSError too: let ours through)
            raise
        except (socket.timeout, BlockingIOError):
            raise StoreTimeoutError(f"no reply from the store at {self.host}:{self.port} in time") from None
        except OSError as e:
            raise StoreConnectionError(
                f"lost the connection to the store at {self.host}:{self.port}: {e}"
            ) from e
        self._buf = buf[end:]
        return mtype, buf[HEADER_SIZE:end]

    def _request(
        self, what: str | tuple[str, str], mtype: int, payload: bytes, wait: float | None = None
    ) -> tuple[int, bytes]:
        """Send one request and return (reply type, payload).

        ``what`` names the call for error messages: a str, or (name, key) formatted only
        when an error is raised (the hot path stays cheap). ``wait`` is the server-side
        timeout of a blocking request; the socket waits ``_REPLY_GRACE`` longer. Other
        requests are answered at once, so ``timeout`` bounds them (a frozen store is
        noticed in ``timeout`` s).
        """
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreConnectionError(
                    f"store {_what(what)}: the connection to {self.host}:{self.port} is "
                    f"closed ({self._broken})"
                )
            try:
                limit = self.timeout if wait is None else wait + _REPLY_GRACE
                if limit != self._sock_limit:
                    self._set_sock_limit(sock, limit)
                sock.sendall(HEADER.pack(len(payload), mtype) + payload)
                if not self._buf:
                    # Fast path: a small reply arrives whole in one recv.
                    data = sock.recv(65536)
                    n = len(data)
                    if n >= HEADER_SIZE:
                        length, rtype = HEADER.unpack_from(data)
                        if n == length + HEADER_SIZE:
                            self._unacked = False  # replies are in order: earlier sets are applied
                            body = data[HEADER_SIZE:]
                            if rtype == P.ERROR:
                                raise StoreError(body.decode("utf-8", "replace"))
                            return rtype, body
                    if not data:
                        raise StoreConnectionError(
                            f"the store at {self.host}:{self.port} closed the connection"
                        )
                    self._buf = data
                rtype, body = self._read_frame(sock)
                self._unacked = False
            except StoreError as e:
                if type(e) is StoreError:  # an ERROR reply: the stream is still in step
                    raise StoreError(f"store {_what(what)}: {e}") from None
                # A half-finished exchange leaves the stream out of step: never reuse it.
                self._drop(str(e))
                if self._broken == "closed by the client":
                    raise StoreConnectionError(
                        f"store {_what(what)}: the client was closed while the call waited"
                    ) from None
                raise type(e)(f"store {_what(what)}: {e}") from None
            except (socket.timeout, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO expired
                self._drop("timed out waiting for a reply")
                raise StoreTimeoutError(
                    f"store {_what(what)}: no reply from the store at {self.host}:{self.port} in time"
                ) from None
            except OSError as e:
                self._drop(str(e))
                raise StoreConnectionError(
                    f"store {_what(what)}: lost the connection to the store at {self.host}:{self.port}: {e}"
                ) from e
            except BaseException:  # e.g. KeyboardInterrupt mid-call: its reply is still due
                self._drop(f"a {_what(what)} call was interrupted")
                raise
        if rtype == P.ERROR:
            raise StoreError(f"store {_what(what)}: {body.decode('utf-8', 'replace')}")
        return rtype, body

    def _expect(self, what: str | tuple[str, str], rtype: int, want: int) -> None:
        if rtype != want:
            self._unexpected(what, rtype)

    def _unexpected(self, what: str | tuple[str, str], rtype: int) -> NoReturn:
        self._drop(f"unexpected reply type {rtype:#x}")
        raise StoreProtocolError(f"store {_what(what)}: unexpected reply type {rtype:#x}")

    def _timed_out(self, what: str, body: bytes, timeout: float) -> StoreTimeoutError:
        r = Reader(body)
        missing = [k.decode("utf-8", "replace") for k in r.keys()]
        names = ", ".join(repr(k) for k in missing) + (
            " and maybe more" if len(missing) >= P.TIMEOUT_KEYS else ""
        )
        return StoreTimeoutError(f"store {what} timed out after {timeout:g} s waiting for key(s) {names}")

    # --- c10d Store API ----------------------------------------------------------------------

    def set(self, key: str, value: _ValueLike) -> None:
        """Store ``value`` (bytes; str is UTF-8 encoded) under ``key``, replacing any value
        and waking blocked ``get``/``wait``/``multi_get`` calls on it.

        As torch's TCPStore ``set``, this does not wait for an acknowledgement: it returns
        once the request is written to the connection. Requests of one client are applied
        in order, so every later call on this client (from any thread) sees the value. To
        know it is visible to *other* clients before telling them out of band, call
        ``ping()`` after it, or create the client with ``ack_set=True`` (then ``set`` waits
        for the server's OK). A lost connection is reported by the next call that waits
        for a reply (or by this one if the write fails): StoreConnectionError.
        """
        k = _key(key)
        v = _value(value)
        if self._ack_set:
            rtype, _ = self._request(("set", key), P.SET, P.U16.pack(len(k)) + k + P.U32.pack(len(v)) + v)
            self._expect("set", rtype, P.OK)
            return
        frame = _SET_HEADER.pack(len(k) + len(v) + 6, P.SET_NOREPLY, len(k)) + k + P.U32.pack(len(v)) + v
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreConnectionError(
                    f"store set({key!r}): the connection to {self.host}:{self.port} is "
                    f"closed ({self._broken})"
                )
            try:
                sock.sendall(frame)
                self._unacked = True
            except OSError as e:
                self._drop(str(e))
                if isinstance(e, (socket.timeout, BlockingIOError)):
                    raise StoreTimeoutError(
                        f"store set({key!r}): the store at {self.host}:{self.port} is not reading requests"
                    ) from None
                raise StoreConnectionError(
                    f"store set({key!r}): lost the connection to the store at {self.host}:{self.port}: {e}"
                ) from e
            except BaseException:  # interrupted: part of the frame may have been sent
                self._drop("a set call was interrupted")
                raise

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, blocking until some client sets it.

        ``timeout`` (seconds, default the client's) is enforced by the server; on expiry
        raises StoreTimeoutError naming the key (the connection stays usable).
        """
        k = _key(key)
        t = self.timeout if timeout is None else _timeout(timeout)
        what = ("get", key)
        rtype, body = self._request(what, P.GET, P.enc_key(k) + P.enc_timeout(t), wait=t)
        if rtype == P.VALUE:
            return body[4:]
        if rtype == P.TIMEOUT:
            raise self._timed_out(_what(what), body, t)
        self._unexpected(what, rtype)

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add ``amount`` (int64) to the integer stored under ``key`` (created as
        0 if missing) and return the new value; the value is stored as ASCII decimal, as
        torch does. Raises StoreError if the existing value is not an integer."""
        k = _key(key)
        rtype, body = self._request(("add", key), P.ADD, P.enc_key(k) + P.I64.pack(amount))
        self._expect("add", rtype, P.INT)
        return P.I64.unpack(body)[0]

    def compare_set(self, key: str, expected: _ValueLike, desired: _ValueLike) -> bytes:
        """Set ``key`` to ``desired`` if its value equals ``expected``; return the value
        now stored. torch semantics: a missing key is set when ``expected`` is b"" (and
        ``desired`` is returned); a missing key with non-empty ``expected`` is left
        missing and ``expected`` is returned (TCPStore does exactly this)."""
        k = _key(key)
        rtype, body = self._request(
            ("compare_set", key),
            P.COMPARE_SET,
            P.enc_key(k) + P.enc_value(_value(expected)) + P.enc_value(_value(desired)),
        )
        self._expect("compare_set", rtype, P.VALUE)
        return body[4:]

    def check(self, keys: Iterable[str]) -> bool:
        """True if every key in ``keys`` exists now (True for an empty list). Does not block."""
        ks = _keys(keys)
        rtype, body = self._request("check", P.CHECK, P.enc_keys(ks))
        self._expect("check", rtype, P.BOOL)
        return body == b"\x01"

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key in ``keys`` exists. ``timeout`` in seconds (default the
        client's), enforced by the server; raises StoreTimeoutError naming the missing keys."""
        ks = _keys(keys)
        t = self.timeout if timeout is None else _timeout(timeout)
        what = f"wait({_names(ks)})"
        rtype, body = self._request(what, P.WAIT, P.enc_keys(ks) + P.enc_timeout(t), wait=t)
        if rtype == P.TIMEOUT:
            raise self._timed_out(_what(what), body, t)
        self._expect(what, rtype, P.OK)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        k = _key(key)
        rtype, body = self._request(("delete_key", key), P.DELETE_KEY, P.enc_key(k))
        self._expect("delete_key", rtype, P.BOOL)
        return body == b"\x01"

    def num_keys(self) -> int:
        """Number of keys in the whole store (all prefixes)."""
        rtype, body = self._request("num_keys", P.NUM_KEYS, b"")
        self._expect("num_keys", rtype, P.INT)
        return P.I64.unpack(body)[0]

    def append(self, key: str, value: _ValueLike) -> None:
        """Append ``value`` to the value of ``key`` (created if missing), waking waiters.
        Raises StoreError if the result would exceed the value size limit."""
        k = _key(key)
        rtype, _ = self._request(("append", key), P.APPEND, P.enc_key(k) + P.enc_value(_value(value)))
        self._expect("append", rtype, P.OK)

    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        """Values of ``keys`` in order, blocking until all exist (as torch's TCPStore).
        ``timeout`` as for ``get``; raises StoreTimeoutError naming the missing keys."""
        ks = _keys(keys)
        t = self.timeout if timeout is None else _timeout(timeout)
        what = f"multi_get({_names(ks)})"
        rtype, body = self._request(what, P.MULTI_GET, P.enc_keys(ks) + P.enc_timeout(t), wait=t)
        if rtype == P.TIMEOUT:
            raise self._timed_out(_what(what), body, t)
        self._expect(what, rtype, P.VALUES)
        r = Reader(body)
        (n,) = P.U32.unpack_from(body)
        r.pos = 4
        return [r.value() for _ in range(n)]

    def multi_set(self, keys: Iterable[str], values: Iterable[_ValueLike]) -> None:
        """Set each ``keys[i]`` to ``values[i]`` in one request (applied in order, atomically
        with respect to other clients)."""
        ks = _keys(keys)
        vs = [_value(v) for v in values]
        if len(ks) != len(vs):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(vs)} values")
        payload = P.U32.pack(len(ks)) + b"".join(P.enc_key(k) + P.enc_value(v) for k, v in zip(ks, vs))
        if len(payload) > P.MAX_FRAME_BYTES:
            raise ValueError(f"multi_set request exceeds the {P.MAX_FRAME_BYTES}-byte frame limit")
        rtype, _ = self._request("multi_set", P.MULTI_SET, payload)
        self._expect("multi_set", rtype, P.OK)

    def ping(self) -> None:
        """One round trip. When it returns, every earlier request of this client (e.g. a
        ``set``) has been applied by the server. Raises StoreConnectionError if the store
        is gone."""
        rtype, _ = self._request("ping", P.PING, b"")
        self._expect("ping", rtype, P.OK)

    # --- conveniences -------------------------------------------------------------------------

    def set_timeout(self, timeout: float) -> None:
        """Change the default timeout (seconds) of blocking calls."""
        self.timeout = _timeout(timeout)

    def prefixed(self, prefix: str) -> PrefixStore:
        """A view that puts ``prefix + "/"`` before every key (torch ``PrefixStore``)."""
        return PrefixStore(prefix, self)

    def clone(self, connect_timeout: float | None = None) -> StoreClient:
        """A new, independent connection with the same address, token and timeout.
        ``connect_timeout`` (seconds) bounds its connecting; default this client's.
        Blocks and raises as the constructor."""
        return StoreClient(
            self.host,
            self.port,
            token=self._token,
            timeout=self.timeout,
            connect_timeout=connect_timeout or self._connect_timeout,
            ack_set=self._ack_set,
            connect=self._local,
        )

    def close(self) -> None:
        """Close the connection (idempotent). Later calls raise StoreConnectionError; a
        call blocked in another thread on this client is woken with StoreConnectionError
        at once (the socket is shut down before the lock is taken).

        If unacknowledged ``set`` calls are outstanding (and no other thread is in a call),
        close first does one round trip (``ping``, bounded by min(timeout, 5) s plus
        grace) so that when ``close`` returns, every ``set`` has been applied — e.g.
        before the process exits and another process reacts to that exit.
        """
        sock = self._sock
        if sock is not None and self._unacked and not self._lock.locked():
            try:
                rtype, _ = self._request("close", P.PING, b"", wait=min(self.timeout, 5.0))
            except StoreError:
                pass  # the connection is gone; nothing more to make sure of
            sock = self._sock
        if sock is not None:
            self._broken = "closed by the client"
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            if self._sock is not None:
                self._drop("closed by the client")

    @property
    def closed(self) -> bool:
        return self._sock is None

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def __repr__(self) -> str:
        state = "open" if self._sock is not None else "closed"
        return f"StoreClient({self.host!r}, {self.port}, {state})"


class PrefixStore:
    """A view of ``store`` (a StoreClient or another PrefixStore) in which every key is
    ``prefix + "/" + key`` — torch's ``PrefixStore(prefix, store)``. Same methods,
    blocking behaviour, timeouts and exceptions as StoreClient; ``num_keys`` counts the
    whole underlying store (as torch). Closing is the underlying client's business.
    """

    def __init__(self, prefix: str, store: StoreClient | PrefixStore) -> None:
        if not isinstance(prefix, str):
            raise TypeError("prefix must be str")
        self.prefix = prefix
        self.underlying_store = store

    def _k(self, key: str) -> str:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, not {type(key).__name__}")
        return f"{self.prefix}/{key}"

    def _ks(self, keys: Iterable[str]) -> list[str]:
        if isinstance(keys, str):
            raise TypeError("keys must be a list of str, not one str")
        return [self._k(k) for k in keys]

    def set(self, key: str, value: _ValueLike) -> None:
        return self.underlying_store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.underlying_store.get(self._k(key), timeout)

    def add(self, key: str, amount: int = 1) -> int:
        return self.underlying_store.add(self._k(key), amount)

    def compare_set(self, key: str, expected: _ValueLike, desired: _ValueLike) -> bytes:
        return self.underlying_store.compare_set(self._k(key), expected, desired)

    def check(self, keys: Iterable[str]) -> bool:
        return self.underlying_store.check(self._ks(keys))

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        return self.underlying_store.wait(self._ks(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self.underlying_store.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.underlying_store.num_keys()

    def append(self, key: str, value: _ValueLike) -> None:
        return self.underlying_store.append(self._k(key), value)

    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]:
        return self.underlying_store.multi_get(self._ks(keys), timeout)

    def multi_set(self, keys: Iterable[str], values: Iterable[_ValueLike]) -> None:
        return self.underlying_store.multi_set(self._ks(keys), values)

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    def prefixed(self, prefix: str) -> PrefixStore:
        return PrefixStore(prefix, self)

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"
