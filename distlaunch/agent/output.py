"""Worker output: whole prefixed lines to the console, raw bytes to per-rank log files,
and a short tail of stderr kept for the root-cause summary.

Only complete lines are written to the console, each batch with one ``write``, so lines of
different ranks never mix inside a line. A line longer than MAX_PENDING bytes without a
newline is cut there (memory stays bounded).

A log file that cannot be opened or written (disk full, EIO, permissions) never stops the
job: that file is dropped, the console keeps its lines, and the process prints one warning
line on stderr for the first such failure (not one per worker and stream).
"""

from __future__ import annotations

import _thread
import errno
import os
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the fast lane's path)

if TYPE_CHECKING:  # agent/merged.py sits above this module (it uses observe/dedup.py)
    from .merged import DedupConsole

MAX_PENDING = 1 << 16
TAIL_BYTES = 1 << 13
RECENT_BYTES = 800  # kept for `distlaunch top`'s last line


# Only the first failure of each kind is reported: on a full disk every sink fails alike.
_warned: set[str] = set()

# Whole batches of lines must not interleave when two threads write to the console (the
# head's local agent and its relay of remote agents' output).
_console_lock = _thread.allocate_lock()  # (not threading: the fast lane spawns without it)


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


def warn_once(kind: str, msg: str) -> None:
    """Print ``distlaunch: warning: msg`` on stderr the first time ``kind`` fails in this
    process; never raises (stderr may be what failed)."""
    with _console_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    try:
        write_all(2, f"distlaunch: warning: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


class StreamSink:
    """One stream (stdout or stderr) of one worker.

    ``console_fd``: where prefixed lines go (None: not on the console). ``log_path``: a file
    that receives the raw stream (None: no file). ``keep_tail``: keep the last TAIL_BYTES.
    """

    def __init__(
        self,
        prefix: bytes,
        console_fd: int | None,
        log_path: str | None,
        keep_tail: bool,
        duplicate: DuplicateLines | None = None,
    ):
        self.prefix = prefix
        self.duplicate = duplicate
        self.console_fd = console_fd
        self.log_path = log_path
        self.log: int | None = None  # unbuffered: a write error shows at once, nothing held
        if log_path:
            try:
                self.log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            except OSError as e:
                self._log_failed(e)
        self.keep_tail = keep_tail
        self.pending = b""
        self.tail = b""
        self._recent = b""  # the stream's last bytes, for last_line()
        self.dedup: DedupConsole | None = None  # --dedup-output: set with rank by the agent
        self.rank = 0
        self._recent_at: float | None = None  # when they came (monotonic seconds)

    def feed(self, data: bytes) -> None:
        # a print() may come as two writes ("text", "\n"): keep a window, not one chunk
        self._recent = (self._recent + data)[-RECENT_BYTES:]
        self._recent_at = time.monotonic()
        if self.log is not None:
            self._write_log(self.log, data)
        if self.duplicate is not None:
            self.duplicate.feed(data, self.prefix)
        if self.keep_tail:
            self.tail = (self.tail + data)[-TAIL_BYTES:]
        if self.console_fd is None:
            return
        cut = data.rfind(b"\n")
        if cut < 0:
            self.pending += data
            if len(self.pending) >= MAX_PENDING:
                self._emit(self.console_fd, self.pending + b"\n")
                self.pending = b""
            return
        self._emit(self.console_fd, self.pending + data[: cut + 1])
        self.pending = data[cut + 1 :]

    def close(self) -> None:
        """End of stream: flush a last line that had no newline, close the log file."""
        if self.pending and self.console_fd is not None:
            self._emit(self.console_fd, self.pending + b"\n")
        self.pending = b""
        if self.log is not None:
            os.close(self.log)
            self.log = None
        if self.duplicate is not None:
            self.duplicate.close(self.prefix)

    def last_line(self) -> tuple[str, float | None]:
        """The last line written (cut to 200 characters) and when (monotonic seconds;
        None: nothing yet), for ``distlaunch top``. Any thread."""
        recent, at = self._recent, self._recent_at
        line = recent.rstrip(b"\r\n").rsplit(b"\n", 1)[-1]
        return line.decode("utf-8", "replace")[:200], at

    def tail_text(self, lines: int = 30) -> str:
        text = self.tail.decode("utf-8", "replace")
        return "\n".join(text.rstrip("\n").split("\n")[-lines:]) if text.strip() else ""

    def _write_log(self, log: int, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(log, view) :]
        except OSError as e:
            os.close(log)
            self.log = None
            self._log_failed(e)

    def _log_failed(self, e: OSError) -> None:
        warn_once(
            "log",
            f"cannot write worker log {self.log_path}: {e.strerror or e}; worker "
            f"logs stop where they fail, the job and its console output go on",
        )

    def _emit(self, console_fd: int, lines: bytes) -> None:
        if self.dedup is not None:  # --dedup-output: the node's merger prints them
            self.dedup.add(self.rank, lines)
            return
        # lines ends with b"\n": prefix the first line and every line after a newline.
        p = self.prefix
        out = p + lines[:-1].replace(b"\n", b"\n" + p) + b"\n" if p else lines
        try:
            if write_all(console_fd, out):
                return
        except OSError as e:  # e.g. stdout is a file on a full disk: supervision goes on
            warn_once(
                f"console{console_fd}",
                f"cannot write worker output to fd "
                f"{console_fd}: {e.strerror or e}; it is dropped, the job goes on",
            )
        self.console_fd = None  # console reader gone (e.g. `| head`); keep supervising


class DuplicateLines:
    """torchrun's ``--duplicate-stdout-filters`` / ``--duplicate-stderr-filters`` for one
    worker stream: each whole line containing any of ``filters`` (plain substrings,
    torchrun's match) is appended, with the console prefix, to ``path``, a file every
    worker of the attempt shares (``O_APPEND``, one ``write`` per batch of lines, so
    lines never mix). A file that cannot be written is dropped with one warning."""

    def __init__(self, filters: tuple[str, ...], path: str) -> None:
        self.filters = tuple(f.encode() for f in filters)
        self.path = path
        self.pending = b""
        self.fd: int | None = None
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
        except OSError as e:
            self._failed(e)

    def feed(self, data: bytes, prefix: bytes) -> None:
        if self.fd is None:
            return
        data = self.pending + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self.pending = data[-MAX_PENDING:]
            return
        self.pending = data[cut + 1 :]
        self._write(data[:cut].split(b"\n"), prefix)

    def close(self, prefix: bytes) -> None:
        if self.fd is None:
            return
        if self.pending:
            self._write([self.pending], prefix)
        os.close(self.fd)
        self.fd = None

    def _write(self, lines: list[bytes], prefix: bytes) -> None:
        out = b"".join(prefix + ln + b"\n" for ln in lines if any(f in ln for f in self.filters))
        if out and self.fd is not None:
            try:
                os.write(self.fd, out)
            except OSError as e:
                os.close(self.fd)
                self.fd = None
                self._failed(e)

    def _failed(self, e: OSError) -> None:
        warn_once("duplicate", f"cannot write {self.path}: {e.strerror or e}; the job goes on")
