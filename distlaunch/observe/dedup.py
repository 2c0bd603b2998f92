"""``--dedup-output``: identical lines printed by several ranks within a short window come
out once with their ranks, ``[0-7]: epoch 3 done`` (pytorch/pytorch#162999); other lines
come out as they are, each with its own rank.

Guarantees (checked by a hypothesis test): every line comes out exactly once (alone or in
a group), one rank's lines come out in the order it printed them, and no line is held
longer than ``window`` seconds after it arrived, provided the caller calls ``due`` by
``next_deadline()``. A line joins a waiting group of the same text only when that group
was opened after every line of that rank still waiting, so merging never reorders a
rank's lines. Pure: time is passed in; no thread, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .group import rank_ranges

L = TypeVar("L", str, bytes)


@dataclass
class _Group(Generic[L]):
    seq: int
    opened: float
    line: L
    ranks: set[int] = field(default_factory=set)


class OutputDedup(Generic[L]):
    """Merges identical lines of several ranks. ``window``: seconds a line may wait for
    the same line from other ranks (and the longest it is held)."""

    def __init__(self, window: float = 0.2) -> None:
        if not window >= 0:
            raise ValueError(f"dedup window must be >= 0 seconds, got {window!r}")
        self.window = window
        self._queue: deque[_Group[L]] = deque()
        self._latest: dict[L, _Group[L]] = {}  # per text: its most recent waiting group
        self._last_seq: dict[int, int] = {}  # per rank: the seq of its last waiting group
        self._seq = 0

    def add(self, rank: int, line: L, now: float) -> list[tuple[tuple[int, ...], L]]:
        """Take ``line`` printed by ``rank`` at ``now`` (seconds, monotonic); return the
        groups now due, oldest first, as (ranks, line)."""
        g = self._latest.get(line)
        if g is None or rank in g.ranks or g.seq <= self._last_seq.get(rank, -1):
            self._seq += 1
            g = _Group(self._seq, now, line)
            self._queue.append(g)
            self._latest[line] = g
        g.ranks.add(rank)
        self._last_seq[rank] = g.seq
        return self.due(now)

    def due(self, now: float) -> list[tuple[tuple[int, ...], L]]:
        """Pop the groups whose window has passed at ``now``, oldest first."""
        out = []
        while self._queue and self._queue[0].opened + self.window <= now:
            out.append(self._pop())
        return out

    def flush(self) -> list[tuple[tuple[int, ...], L]]:
        """Pop every waiting group (at the end of output), oldest first."""
        return [self._pop() for _ in range(len(self._queue))]

    def next_deadline(self) -> float | None:
        """When the oldest waiting group is due (call ``due`` then), None if none waits."""
        return self._queue[0].opened + self.window if self._queue else None

    def _pop(self) -> tuple[tuple[int, ...], L]:
        g = self._queue.popleft()
        if self._latest.get(g.line) is g:
            del self._latest[g.line]
        for r in g.ranks:
            if self._last_seq.get(r) == g.seq:
                del self._last_seq[r]
        return tuple(sorted(g.ranks)), g.line


def dedup_prefix(ranks: tuple[int, ...]) -> str:
    """``[0-7]: `` for a group, ``[3]: `` for one rank."""
    return f"[{rank_ranges(ranks)}]: "
