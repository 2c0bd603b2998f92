"""Wire format of the distlaunch store (a leaf module: standard library and errors only).

Every message is a frame: a 5-byte header ``!IB`` (payload length in bytes, message
type) followed by the payload. Integers are big-endian. Inside payloads:

* key    = ``!H`` length + UTF-8 bytes (1..MAX_KEY_BYTES; keys are opaque to the server)
* value  = ``!I`` length + bytes (0..MAX_VALUE_BYTES)
* keys   = ``!I`` count + that many keys (0..MAX_KEYS_PER_REQUEST)
* timeout = ``!d`` seconds (float64, >= 0; +inf means no deadline)

The full table of message types lives in docs/store.md. No pickle: values are bytes,
numbers are fixed-size integers. Anything that does not parse exactly (unknown type,
field overrunning the payload, trailing bytes, a limit exceeded) is a protocol error;
the server answers it by dropping that one connection.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..errors import StoreProtocolError

# --- limits (documented in docs/store.md) -------------------------------------------------
MAX_KEY_BYTES = 4096  # one key, UTF-8 encoded
MAX_VALUE_BYTES = 64 * 1024 * 1024  # one value (also the cap for append's result)
MAX_KEYS_PER_REQUEST = 65536  # check / wait / multi_get / multi_set
MAX_FRAME_BYTES = 128 * 1024 * 1024  # one frame's payload, either direction
AUTH_TIMEOUT = 30.0  # seconds a new connection has to authenticate
TIMEOUT_KEYS = 16  # keys a TIMEOUT reply names at most (a wait on thousands stays small)

# --- framing ---------------------------------------------------------------------------------
HEADER = struct.Struct("!IB")
HEADER_SIZE = HEADER.size  # 5
U16 = struct.Struct("!H")
U32 = struct.Struct("!I")
I64 = struct.Struct("!q")
F64 = struct.Struct("!d")
U8 = struct.Struct("!B")

MAGIC = b"DLSTORE1"
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256

# handshake
HELLO = 0x01  # S->C  MAGIC(8) | server_nonce(32)
AUTH = 0x02  # C->S  client_nonce(32) | client_mac(32)
AUTH_OK = 0x03  # S->C  server_mac(32)
AUTH_FAIL = 0x04  # S->C  empty; the server then closes the connection
CLIENT_HELLO = 0x05  # C->S  MAGIC(8), optional, first: "greet me now" (a server that also
# serves torch's TCPStore protocol otherwise waits a moment for the client's first bytes)

# requests (C->S)
SET = 0x10  # key | value                     -> OK
GET = 0x11  # key | timeout                   -> VALUE | TIMEOUT
ADD = 0x12  # key | i64 amount                -> INT | ERROR
COMPARE_SET = 0x13  # key | value expected | value desired -> VALUE
CHECK = 0x14  # keys                            -> BOOL
WAIT = 0x15  # keys | timeout                  -> OK | TIMEOUT
DELETE_KEY = 0x16  # key                             -> BOOL
NUM_KEYS = 0x17  # (empty)                         -> INT
APPEND = 0x18  # key | value                     -> OK | ERROR
MULTI_GET = 0x19  # keys | timeout                  -> VALUES | TIMEOUT
MULTI_SET = 0x1A  # u32 n | n x (key | value)       -> OK
PING = 0x1B  # (empty)                         -> OK
SET_NOREPLY = 0x1C  # key | value                     -> no reply (TCPStore's set)

# replies (S->C)
OK = 0x80  # empty
VALUE = 0x81  # value
INT = 0x82  # i64
BOOL = 0x83  # u8 (0 or 1)
VALUES = 0x84  # u32 n | n x value
TIMEOUT = 0x85  # keys (the first TIMEOUT_KEYS of the keys still missing at the deadline)
ERROR = 0x86  # UTF-8 message (the rest of the payload)

REQUEST_NAMES = {
    SET: "set",
    GET: "get",
    ADD: "add",
    COMPARE_SET: "compare_set",
    CHECK: "check",
    WAIT: "wait",
    DELETE_KEY: "delete_key",
    NUM_KEYS: "num_keys",
    APPEND: "append",
    MULTI_GET: "multi_get",
    MULTI_SET: "multi_set",
    PING: "ping",
    SET_NOREPLY: "set_noreply",
}

AUTH_LABEL_CLIENT = b"distlaunch-store-v1 client"
AUTH_LABEL_SERVER = b"distlaunch-store-v1 server"


def frame(mtype: int, payload: bytes = b"") -> bytes:
    """One frame: header + payload."""
    return HEADER.pack(len(payload), mtype) + payload


def mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 proof of knowing ``secret`` bound to both nonces and a direction label
    (so a client's proof cannot be replayed as the server's)."""
    import hashlib
    import hmac  # imported on first connect, not on ``import distlaunch.store`` (~4 ms)

    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def secret_bytes(token: str | bytes | bytearray) -> bytes:
    """The shared secret as bytes (str tokens are UTF-8 encoded)."""
    if isinstance(token, str):
        return token.encode("utf-8")
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    raise TypeError(f"store token must be str or bytes, not {type(token).__name__}")


# --- encoding (both sides) ---------------------------------------------------------------------


def enc_key(key: bytes) -> bytes:
    return U16.pack(len(key)) + key


def enc_value(value: bytes) -> bytes:
    return U32.pack(len(value)) + value


def enc_keys(keys: Sequence[bytes]) -> bytes:
    return U32.pack(len(keys)) + b"".join(U16.pack(len(k)) + k for k in keys)


def enc_timeout(seconds: float) -> bytes:
    return F64.pack(seconds)


# --- decoding (robust: every failure is a StoreProtocolError) ----------------------------------


class Reader:
    """Cursor over one frame's payload. Every read checks bounds and limits."""

    __slots__ = ("buf", "pos", "end")

    buf: bytes | bytearray | memoryview
    pos: int
    end: int

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def _take(self, n: int) -> int:
        p = self.pos
        if p + n > self.end:
            raise StoreProtocolError("field overruns the frame")
        self.pos = p + n
        return p

    def key(self) -> bytes:
        (n,) = U16.unpack_from(self.buf, self._take(2))
        if n == 0 or n > MAX_KEY_BYTES:
            raise StoreProtocolError(f"key length {n} outside 1..{MAX_KEY_BYTES}")
        p = self._take(n)
        return bytes(self.buf[p : p + n])

    def value(self) -> bytes:
        (n,) = U32.unpack_from(self.buf, self._take(4))
        if n > MAX_VALUE_BYTES:
            raise StoreProtocolError(f"value length {n} exceeds {MAX_VALUE_BYTES}")
        p = self._take(n)
        return bytes(self.buf[p : p + n])

    def count(self) -> int:
        (n,) = U32.unpack_from(self.buf, self._take(4))
        if n > MAX_KEYS_PER_REQUEST:
            raise StoreProtocolError(f"{n} keys in one request exceeds {MAX_KEYS_PER_REQUEST}")
        return n

    def keys(self) -> list[bytes]:
        return [self.key() for _ in range(self.count())]

    def i64(self) -> int:
        return I64.unpack_from(self.buf, self._take(8))[0]

    def u8(self) -> int:
        return self.buf[self._take(1)]

    def timeout(self) -> float:
        (t,) = F64.unpack_from(self.buf, self._take(8))
        if not t >= 0.0:  # also rejects NaN
            raise StoreProtocolError(f"bad timeout {t!r}")
        return t

    def rest(self) -> bytes:
        p, self.pos = self.pos, self.end
        return bytes(self.buf[p : self.end])

    def done(self) -> None:
        if self.pos != self.end:
            raise StoreProtocolError(f"{self.end - self.pos} trailing bytes in frame")
