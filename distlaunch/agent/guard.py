"""The orphan guard: a small forked process that kills every worker process group, and
removes the job's temporary files, if the launcher dies, even by SIGKILL.

A parent-death signal (prctl PR_SET_PDEATHSIG) would reach only the workers themselves,
not what they spawned; the guard holds the read end of a pipe whose write end only the
launcher has, so the launcher's death, however it happens, reads as EOF, and the guard
then SIGKILLs each registered process group. It runs in its own session and ignores the
terminal's signals, so neither a Ctrl-C nor a kill of the launcher's whole process group
takes it down before the launcher.
"""

from __future__ import annotations

import os
import signal


class OrphanGuard:
    """Fork the guard now (call before any thread is started)."""

    def __init__(self):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the guard
            try:
                os.setsid()  # a kill of the launcher's process group must not reach it
                os.close(w)
                _guard_loop(r)
            finally:
                os._exit(0)
        os.close(r)
        self.pid = pid
        self._w = w

    def watch(self, pgid: int) -> None:
        self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        self._send(b"-%d\n" % pgid)

    def clean_up(self, path: str) -> None:
        """Remove what the glob pattern ``path`` names (files or directory trees) if the
        launcher dies first."""
        self._send(b"p" + os.fsencode(path) + b"\n")

    def close(self) -> None:
        """Normal end: the guard exits without killing anything."""
        if self._w is not None:
            self._send(b"q\n")
            os.close(self._w)
            self._w = None
            os.waitpid(self.pid, 0)

    def _send(self, msg: bytes) -> None:
        if self._w is not None:
            os.write(self._w, msg)  # < PIPE_BUF: atomic


def remove_matching(pattern: str) -> None:
    """Remove every file or directory tree the glob ``pattern`` names; never raises."""
    import glob
    import shutil

    for path in glob.glob(pattern):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _guard_loop(fd: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    paths: list[bytes] = []
    buf = b""
    while True:
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not data:  # launcher gone without saying goodbye
            for pgid in groups:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except OSError:
                    pass
            for pattern in paths:
                remove_matching(os.fsdecode(pattern))
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line == b"q":
                return
            if line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
            elif line[:1] == b"p":
                paths.append(line[1:])
