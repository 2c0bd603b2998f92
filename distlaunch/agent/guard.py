"""The orphan guard: a small forked process that kills every worker process group, and
removes the job's temporary files, if the launcher dies, even by SIGKILL.

A parent-death signal (prctl PR_SET_PDEATHSIG) would reach only the workers themselves,
not what they spawned; the guard holds the read end of a pipe whose write end only the
launcher has, so the launcher's death, however it happens, reads as EOF, and the guard
then SIGKILLs each registered process group. It runs in its own session and ignores the
terminal's signals, so neither a Ctrl-C nor a kill of the launcher's whole process group
takes it down before the launcher.

Processes that leave the worker's process group and session (``setsid``: daemonising
tools) escape every group signal. Two pieces catch them:

- The launcher becomes a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a worker's
  descendant whose parent exits is re-parented to the launcher instead of init, so while
  the launcher lives every job process is its descendant. When a group ends the agent
  kills its adopted children and their descendants (``kill_strays``).
- After the launcher's death its children go to init, and the parent links that made
  them job processes are gone. So the guard, while worker groups are registered, reads
  the process table every SCAN_SECONDS (longer when the table is large: at most about 1%
  of a CPU) and keeps the launcher's descendants (pid and start time). At EOF it kills
  those still alive, every process in a registered worker's session or process group,
  and all their descendants, freezing each with SIGSTOP first so nothing forks away
  between the look and the kill.

What the guard cannot catch: a process that leaves the session and loses its parent
(daemonises) less than one scan interval before the launcher is SIGKILLed. A writable
cgroup would close that gap but is not available to most users; a PID namespace would
make each worker its namespace's init, which changes how it receives signals.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import time
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36
# How often the guard records the launcher's descendants while workers run (seconds);
# stretched so one scan costs at most SCAN_BUDGET of the interval.
SCAN_SECONDS = 1.0
SCAN_BUDGET = 0.01


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init as before
        pass


class Proc:
    """One row of the process table (from /proc/PID/stat)."""

    __slots__ = ("pid", "ppid", "pgrp", "sid", "start", "zombie")

    def __init__(self, pid: int, stat: bytes):
        # comm (field 2) may hold spaces and parentheses: split after its last ')'
        f = stat[stat.rindex(b")") + 2 :].split()
        self.pid, self.zombie = pid, f[0] == b"Z"
        self.ppid, self.pgrp, self.sid, self.start = int(f[1]), int(f[2]), int(f[3]), int(f[19])


def process_table() -> dict[int, Proc]:
    """Every process visible in /proc, by pid (processes that exit meanwhile are left
    out; empty when /proc cannot be read). Reads one small file per process: about 15
    microseconds each."""
    table: dict[int, Proc] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # out of file descriptors: nothing to see this time
        return table
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    table[int(name)] = Proc(int(name), f.read())
            except (OSError, ValueError, IndexError):
                pass
    return table


def own_children() -> set[int] | None:
    """This process's children, from /proc/self/task/*/children: a few small reads
    instead of a scan of every process. None when the kernel does not offer the file
    (CONFIG_PROC_CHILDREN)."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        return None
    found: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found.update(int(pid) for pid in f.read().split())
        except FileNotFoundError:
            pass  # a thread that ended meanwhile: its children went to another thread
        except (OSError, ValueError):
            return None
    return found


def job_processes(table: dict[int, Proc], roots: set[int], groups: set[int]) -> set[int]:
    """``roots`` (those in ``table``), every process in a session or process group listed
    in ``groups``, and all their descendants."""
    found = {p.pid for p in table.values() if p.pid in roots or p.sid in groups or p.pgrp in groups}
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def kill_processes(find: Callable[[dict[int, Proc]], set[int]]) -> set[int]:
    """SIGKILL what ``find(table)`` returns (a set of pids), freezing each with SIGSTOP
    first and looking again until nothing new appears, so a process forking meanwhile
    cannot leave a child behind. Returns the pids killed."""
    stopped: set[int] = set()
    for _ in range(20):
        new = find(process_table()) - stopped - {os.getpid()}
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return stopped


class OrphanGuard:
    """Fork the guard now (call before any thread is started), and make this process a
    child subreaper. Children this process already has are never treated as strays."""

    def __init__(self) -> None:
        agent = os.getpid()
        kids = own_children()
        self._spared = (
            kids if kids is not None else {p.pid for p in process_table().values() if p.ppid == agent}
        )
        _become_subreaper()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the guard
            try:
                os.setsid()  # a kill of the launcher's process group must not reach it
                os.close(w)
                _guard_loop(r, agent, self._spared)
            finally:
                os._exit(0)
        os.close(r)
        self.pid = pid
        self._spared.add(pid)
        self._w: int | None = w

    def strays(self, table: dict[int, Proc]) -> set[int]:
        """This process's adopted children (not the guard, a worker or a child it had
        before) and their descendants; call when no worker of a live group is running."""
        me = os.getpid()
        return job_processes(
            table, {p.pid for p in table.values() if p.ppid == me and p.pid not in self._spared}, set()
        )

    def kill_strays(self, timeout: float = 2.0) -> None:
        """SIGKILL the strays (see ``strays``) and reap the ones that are this process's
        children; blocks until none is left or ``timeout`` seconds passed (a process in
        uninterruptible sleep dies late; it is reaped at the next call)."""
        kids = own_children()
        if kids is not None and kids <= self._spared:
            # A stray would be a child: this process is the subreaper of everything the
            # workers left behind. No child, no stray, no scan of the whole table.
            return
        kill_processes(self.strays)
        me, end = os.getpid(), time.monotonic() + timeout
        while True:
            table = process_table()
            left = [p for p in table.values() if p.ppid == me and p.pid not in self._spared]
            for p in left:
                try:
                    os.waitpid(p.pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            if not left or time.monotonic() >= end:
                return
            if not all(p.zombie for p in left):
                kill_processes(self.strays)  # adopted from a dying stray meanwhile
                time.sleep(0.01)

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


def _guard_loop(fd: int, agent: int, spared: set[int]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    spared = spared | {os.getpid()}
    groups: set[int] = set()
    paths: list[bytes] = []
    known: dict[int, int] = {}  # the launcher's descendants at the last scan: pid -> start
    interval = SCAN_SECONDS
    buf = b""

    def descendants(table: dict[int, Proc]) -> set[int]:
        adopted = {p.pid for p in table.values() if p.ppid == agent and p.pid not in spared}
        alive = {pid for pid, start in known.items() if pid in table and table[pid].start == start}
        return job_processes(table, set(groups) | adopted | alive, groups) - spared

    while True:
        if groups and not select.select([fd], [], [], interval)[0]:
            t0 = time.monotonic()
            table = process_table()
            known = {pid: table[pid].start for pid in descendants(table)}
            interval = max(SCAN_SECONDS, (time.monotonic() - t0) / SCAN_BUDGET)
            continue
        try:
            data = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not data:  # launcher gone without saying goodbye
            kill_processes(descendants)
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
                if not groups:
                    known = {}
            elif line[:1] == b"p":
                paths.append(line[1:])
