"""Worker output: whole prefixed lines to the console, raw bytes to per-rank log files,
and a short tail of stderr kept for the root-cause summary.

Only complete lines are written to the console, each batch with one ``write``, so lines of
different ranks never mix inside a line. A line longer than MAX_PENDING bytes without a
newline is cut there (memory stays bounded).
"""

from __future__ import annotations

import errno
import os
import threading

MAX_PENDING = 1 << 16
TAIL_BYTES = 1 << 13


# Whole batches of lines must not interleave when two threads write to the console (the
# head's local agent and its relay of remote agents' output).
_console_lock = threading.Lock()


def write_all(fd: int, data: bytes) -> bool:
    """Write every byte to ``fd``; False when the reader has gone (EPIPE)."""
    with _console_lock:
        return _write_all(fd, data)


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BrokenPipeError:
            return False
        except OSError as e:
            if e.errno == errno.EAGAIN:
                continue
            raise
        view = view[n:]
    return True


class StreamSink:
    """One stream (stdout or stderr) of one worker.

    ``console_fd``: where prefixed lines go (None: not on the console). ``log_path``: a file
    that receives the raw stream (None: no file). ``keep_tail``: keep the last TAIL_BYTES.
    """

    def __init__(self, prefix: bytes, console_fd: int | None, log_path: str | None,
                 keep_tail: bool):
        self.prefix = prefix
        self.console_fd = console_fd
        self.log = open(log_path, "wb") if log_path else None
        self.keep_tail = keep_tail
        self.pending = b""
        self.tail = b""

    def feed(self, data: bytes) -> None:
        if self.log is not None:
            self.log.write(data)
        if self.keep_tail:
            self.tail = (self.tail + data)[-TAIL_BYTES:]
        if self.console_fd is None:
            return
        cut = data.rfind(b"\n")
        if cut < 0:
            self.pending += data
            if len(self.pending) >= MAX_PENDING:
                self._emit(self.pending + b"\n")
                self.pending = b""
            return
        self._emit(self.pending + data[:cut + 1])
        self.pending = data[cut + 1:]

    def close(self) -> None:
        """End of stream: flush a last line that had no newline, close the log file."""
        if self.pending and self.console_fd is not None:
            self._emit(self.pending + b"\n")
        self.pending = b""
        if self.log is not None:
            self.log.close()
            self.log = None

    def tail_text(self, lines: int = 30) -> str:
        text = self.tail.decode("utf-8", "replace")
        return "\n".join(text.rstrip("\n").split("\n")[-lines:]) if text.strip() else ""

    def _emit(self, lines: bytes) -> None:
        # lines ends with b"\n": prefix the first line and every line after a newline.
        p = self.prefix
        out = p + lines[:-1].replace(b"\n", b"\n" + p) + b"\n" if p else lines
        if not write_all(self.console_fd, out):
            self.console_fd = None  # console reader gone (e.g. `| head`); keep supervising
