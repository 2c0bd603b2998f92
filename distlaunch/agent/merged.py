"""``--dedup-output``: a node's console stream shared by its workers' sinks, merging
identical lines of several ranks (observe/dedup.py)."""

from __future__ import annotations

import time

from ..observe.dedup import OutputDedup, dedup_prefix
from .output import warn_once, write_all


class DedupConsole:
    """``--dedup-output`` for one console stream of a node: identical lines of several
    ranks within ``window`` seconds come out once as ``[0-7]: line`` (observe/dedup.py);
    the worker group's loop calls ``due`` by ``next_deadline`` and ``flush`` at the end."""

    def __init__(self, console_fd: int, window: float = 0.2) -> None:
        self.console_fd = console_fd
        self._dedup: OutputDedup[bytes] = OutputDedup(window)

    def add(self, rank: int, lines: bytes) -> None:
        """Whole lines (ending with a newline) printed by ``rank``."""
        now = time.monotonic()
        out: list[tuple[tuple[int, ...], bytes]] = []
        for line in lines[:-1].split(b"\n"):
            out += self._dedup.add(rank, line, now)
        self._write(out)

    def next_deadline(self) -> float | None:
        return self._dedup.next_deadline()

    def due(self, now: float) -> None:
        self._write(self._dedup.due(now))

    def flush(self) -> None:
        self._write(self._dedup.flush())

    def _write(self, groups: list[tuple[tuple[int, ...], bytes]]) -> None:
        if not groups:
            return
        data = b"".join(dedup_prefix(ranks).encode() + line + b"\n" for ranks, line in groups)
        try:
            write_all(self.console_fd, data)
        except OSError as e:
            warn_once(f"console{self.console_fd}", f"cannot write worker output: {e.strerror or e}")
