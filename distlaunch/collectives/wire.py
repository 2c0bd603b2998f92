"""Wire format of the collectives transport (a leaf module: struct and numpy only).

Every message is one fixed 48-byte header followed by ``nbytes`` of payload. The header
travels with the data so that a receiver can detect, without an extra round trip, that
its peer called a different operation (op code), with another dtype, element count,
root or reduce op: the receiver compares the header with what it expects itself.

Header layout (little endian)::

    magic   4s  b"DLC2" (the protocol version: DLC1 sent the secret in its HELLO)
    kind    B   HELLO / COLL / P2P / ABORT / STATUS_REQ / STATUS_REP
    dtype   B   DTYPE_CODES
    op      B   OP_CODES (the op table's code, or reason code for ABORT)
    redop   B   ReduceOp value (255 = none)
    src     I   sender's global rank
    group   I   process group id (0 = WORLD)
    seq     q   collective sequence number in the group; tag for P2P
    step    I   message index inside one collective (checked, not matched)
    root    i   group rank of the root, -1 for unrooted ops
    count   Q   sender's element count of the op's main buffer (0 = not checked)
    nbytes  Q   payload length in bytes

A connection opens with three HELLO messages (``step`` 0, 1, 2; see tcp.py): the
connector's nonce, the acceptor's nonce and proof, the connector's proof.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from .optable import OP_CODES as OP_CODES  # op codes: one entry per operation in the op table
from .optable import OP_NAMES as OP_NAMES

MAGIC = b"DLC2"
HEADER = struct.Struct("<4sBBBBIIqIiQQ")
HEADER_SIZE = HEADER.size

# message kinds
HELLO, COLL, P2P, ABORT, STATUS_REQ, STATUS_REP = 1, 2, 3, 4, 5, 6

# ABORT reason codes (carried in the op field). A timeout's ABORT goes over TCP with
# its class and ranks; the shared-memory segment records it as ABORT_OTHER
ABORT_MISMATCH, ABORT_PEER_LOST, ABORT_OTHER, ABORT_TIMEOUT = 1, 2, 3, 4

NO_REDOP = 255


_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
DTYPE_CODES = {np.dtype(name): i + 1 for i, name in enumerate(_DTYPES)}
DTYPE_NAMES = {i + 1: name for i, name in enumerate(_DTYPES)}
DTYPE_NAMES[0] = "bytes"


class Header(NamedTuple):
    kind: int
    dtype: int
    op: int
    redop: int
    src: int
    group: int
    seq: int
    step: int
    root: int
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose: the wire field's name
    nbytes: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, *self)


def unpack_header(data: bytes | bytearray | memoryview) -> Header:
    """Decode a header; raises ValueError on a bad magic (not a distlaunch peer)."""
    fields = HEADER.unpack(data)
    if fields[0] != MAGIC:
        raise ValueError(f"bad message magic {fields[0]!r}")
    return Header(*fields[1:])
