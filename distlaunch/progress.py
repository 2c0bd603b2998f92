"""Per-rank progress and in-flight records: a 128-byte file the agent creates for each
worker (named by ``DISTLAUNCH_PROGRESS_FILE``) and the worker maps shared, so that
reporting progress is a few memory writes into the mapping (no system call, no lock):
the agent's hang watchdog and ``distlaunch top`` read it from outside.

Worker side (cost: one Python call and a few stores into the mapping, well under a
microsecond; outside distlaunch, where the variable is unset, each call is a no-op)::

    heartbeat()                  # progress: the hang watchdog sees the rank move on
    begin("all_reduce", 1834, peers=(5, 7))   # an operation is in flight
    waiting((7,))                # optional: who it still waits for
    end()                        # it completed: also counts as progress

``begin``/``end`` are meant for a runtime's collectives (distlaunch.collectives, the
torch backend, mpi): ``begin`` before blocking on peers, ``end`` once the operation
completed; an operation never ended (an exception) is replaced by the next ``begin``.

Layout (little-endian): ``0`` magic ``DLP1``; ``8`` progress counter (u64); ``16`` the
operation's sequence number (u64); ``24`` its start, CLOCK_MONOTONIC nanoseconds (u64,
0: nothing in flight); ``32`` the operation's name (32 bytes, NUL-padded); ``64`` the
"waiting for ..." text (64 bytes, NUL-padded). A reader may see a record half-written
(no lock): a name or text torn between two operations is possible, harmless for a view.

Standard library only: workers import it.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

# a record's size and magic, and create(): in workerenv (the fast lane makes records too)
from .workerenv import PROGRESS_MAGIC as MAGIC
from .workerenv import PROGRESS_SIZE as SIZE
from .workerenv import create_progress as create  # noqa: F401  (progress.create)

ENV = "DISTLAUNCH_PROGRESS_FILE"
_NAME, _NAME_LEN = 32, 32
_TEXT, _TEXT_LEN = 64, 64
_HEADER = struct.Struct("<4s4xQQQ")


class _Record:
    """The mapping of this process's record (None until first used, False: none)."""

    mm: mmap.mmap | None = None
    words: memoryview | None = None  # the mapping as u64 words: [magic, progress, seq, start]


_rec = _Record()
_now = time.monotonic_ns
_looked = False


def _open() -> memoryview | None:
    global _looked
    _looked = True
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < SIZE:
            return None
        _rec.mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    _rec.words = memoryview(_rec.mm).cast("Q")
    return _rec.words


def _words() -> memoryview | None:
    w = _rec.words
    if w is None and not _looked:
        w = _open()
    return w


def words() -> memoryview | None:
    """This process's record as u64 words (``[magic, progress, seq, start]``), or None
    outside a distlaunch worker: for a caller that ends many operations itself (``end``
    is ``w[3] = 0; w[1] += 1``)."""
    return _rec.words if _looked else _words()


def heartbeat() -> None:
    """Count one unit of progress for this rank (see ``--hang-timeout``). Never raises,
    never blocks; a no-op outside a distlaunch worker."""
    w = _rec.words if _looked else _words()
    if w is not None:
        w[1] += 1


def _padded(text: str, size: int) -> bytes:
    data = text.encode(errors="replace")[: size - 1]
    return data + bytes(size - len(data))


# what the record holds now: a begin with the same op and peers as the last one (a
# collective in a loop) writes only its sequence number and start time
_UNSET = object()
_last_op: str | None = None
_last_peers: object = _UNSET
_NAMES: dict[str, bytes] = {}


def _put_peers(peers: Iterable[int] | str | None) -> None:
    global _last_peers
    if isinstance(peers, (list, set)):
        peers = tuple(peers)  # comparable with the next call's, and not changed later by the caller
    if _last_peers is _UNSET or peers != _last_peers:
        assert _rec.mm is not None
        _rec.mm[_TEXT : _TEXT + _TEXT_LEN] = _padded(_peers_text(peers), _TEXT_LEN)
        _last_peers = peers


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 4, 5, 7]`` -> ``"0-2,4-5,7"`` (sorted, duplicates dropped)."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _peers_text(peers: Iterable[int] | str | None) -> str:
    if peers is None or isinstance(peers, str):
        return peers or ""
    rs = set(peers)
    return f"waiting for rank{'s' if len(rs) > 1 else ''} {rank_ranges(rs)}" if rs else ""


def begin(op: str, seq: int, peers: Iterable[int] | str | None = None) -> None:
    """Mark operation ``op`` (e.g. ``"all_reduce"``, up to 31 bytes) number ``seq`` in
    flight from now, waiting for ``peers`` (ranks, or a text; None: not said). Never
    raises; a no-op outside a distlaunch worker."""
    w = _rec.words if _looked else _words()
    if w is None:
        return
    # the collectives call this for every operation: a repeated op with the same peers
    # (the usual loop) costs two word writes and a clock read
    w[2] = seq
    if op is not _last_op and op != _last_op:
        _set_op(w, op)
    if peers is not _last_peers:
        _put_peers(peers)
    w[3] = _now() or 1


def started(op: str, seq: int, now: int) -> None:
    """:func:`begin` with no peers, started at ``now`` (``time.monotonic_ns()``, which
    the caller read anyway: the collectives' fast path takes its deadline from it).
    Written out rather than shared with begin: it is on every planned call's path."""
    w = _rec.words if _looked else _words()
    if w is None:
        return
    w[2] = seq
    if op is not _last_op and op != _last_op:
        _set_op(w, op)
    if _last_peers is not None:
        _put_peers(None)
    w[3] = now or 1


def _set_op(w: memoryview, op: str) -> None:
    global _last_op
    w[3] = 0  # nothing in flight while the name changes
    assert _rec.mm is not None
    name = _NAMES.get(op)
    if name is None:  # a training loop alternates a few ops: each is encoded once
        name = _NAMES[op] = _padded(op, _NAME_LEN)
    _rec.mm[_NAME : _NAME + _NAME_LEN] = name
    _last_op = op


def waiting(peers: Iterable[int] | str | None) -> None:
    """Update whom the operation in flight still waits for. Never raises."""
    if (_rec.words if _looked else _words()) is not None:
        _put_peers(peers)


def end() -> None:
    """The operation in flight completed: clear it and count one unit of progress.
    Never raises; a no-op outside a distlaunch worker."""
    w = _rec.words if _looked else _words()
    if w is not None:
        w[3] = 0
        w[1] += 1


# --- the agent's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One read of a record: ``count`` progress units so far; ``op`` the operation in
    flight (None: none), its ``seq``, ``op_age`` seconds in flight, ``waiting`` text."""

    count: int
    op: str | None = None
    seq: int = 0
    op_age: float | None = None
    waiting: str = ""

    def describe(self) -> str | None:
        """``all_reduce #1834, 3.2 s, waiting for ranks 5,7`` (None: nothing in flight)."""
        if self.op is None or self.op_age is None:
            return None
        return ", ".join(p for p in (self.label(), f"{self.op_age:.1f} s", self.waiting) if p)

    def label(self) -> str:
        """``all_reduce #1834`` (an MPI point-to-point wait has no number: ``MPI``)."""
        return f"{self.op} #{self.seq}" if self.seq else str(self.op)


class Reader:
    """The agent's view of one worker's record (mapped read-only once)."""

    def __init__(self, path: str) -> None:
        """Raises OSError when ``path`` cannot be mapped."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)

    def read(self) -> Progress:
        magic, count, seq, start = _HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC:
            return Progress(0)
        if not start:
            return Progress(count)
        op = bytes(self._mm[_NAME : _NAME + _NAME_LEN]).split(b"\0", 1)[0].decode(errors="replace")
        text = bytes(self._mm[_TEXT : _TEXT + _TEXT_LEN]).split(b"\0", 1)[0].decode(errors="replace")
        age = max(0.0, (time.monotonic_ns() - start) / 1e9)
        return Progress(count, op or "?", seq, age, text)

    def close(self) -> None:
        self._mm.close()
