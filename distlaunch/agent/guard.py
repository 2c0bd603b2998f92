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

The guard's process title is ``distlaunch guard for pid N`` (N: the launcher), taken
TITLE_AFTER seconds after its start (not beside the workers' start-up), so ``ps`` and
``pgrep -f`` tell it from the launcher. If it dies anyway (the OOM killer, a SIGKILL by
hand), the launcher notices at once (a pidfd in the worker group's wait; else at its next
message to the guard), says so in one line and starts a new guard (a fresh interpreter:
forking a process that may run threads is not safe) that it tells every registered group
and path again; the job goes on. Only the descendants the dead guard had recorded are
forgotten: the new one records them at its first scan.

What the guard cannot catch: a process that leaves the session and loses its parent
(daemonises) less than one scan interval before the launcher is SIGKILLed. A writable
cgroup would close that gap but is not available to most users; a PID namespace would
make each worker its namespace's init, which changes how it receives signals.
"""

from __future__ import annotations

import _thread
import ctypes
import os
import select
import signal
import sys
import time
from collections.abc import Callable

from ..report import say
from ..startup import resume_gc

PR_SET_CHILD_SUBREAPER = 36
# How often the guard records the launcher's descendants while workers run (seconds);
# stretched so one scan costs at most SCAN_BUDGET of the interval.
SCAN_SECONDS = 1.0
SCAN_BUDGET = 0.01
TITLE_AFTER = 0.2  # seconds after its start the guard takes its title


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


_MAGIC = frozenset("*?[")  # glob's special characters


def glob_escape(path: str) -> str:
    """``path`` as a glob pattern that names only it (``glob.escape``, without loading
    glob at start-up). Pure."""
    return "".join(f"[{c}]" if c in _MAGIC else c for c in path)


class OrphanGuard:
    """Fork the guard now (call before any thread is started), and make this process a
    child subreaper. Children this process already has are never treated as strays.
    A guard that dies is restarted at once (see the module docstring)."""

    def __init__(self) -> None:
        agent = os.getpid()
        kids = own_children()
        self._spared = (
            kids if kids is not None else {p.pid for p in process_table().values() if p.ppid == agent}
        )
        _become_subreaper()
        # what the guard was told, to tell a restarted one again
        self._groups: set[int] = set()
        self._paths: list[bytes] = []
        # (_thread's locks and thread: threading, ~0.8 ms, is not loaded before the fast
        # lane's first spawn; nothing the watcher runs may be the first to import it, as
        # threading takes the thread that first imports it for the main thread)
        self._lock = _thread.allocate_lock()  # the pipe and the guard's pid: the watcher restarts
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the guard
            resume_gc()  # a long-lived process of its own (the launcher may have paused it)
            try:
                os.setsid()  # a kill of the launcher's process group must not reach it
                os.close(w)
                # not the launcher's terminal or pipes: a reader of its output sees the
                # end when the launcher ends, not when the guard does (close(wait=False))
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.close(null)
                _guard_loop(r, agent, self._spared)
            finally:
                os._exit(0)
        os.close(r)
        self._w: int | None = None
        self._started(pid, w)
        # held while the watcher thread runs; started without waiting for the thread to
        # run, as Thread.start waits (a scheduling before the first spawn: ms when busy)
        self._watching: _thread.LockType | None = None
        if self._pidfd is not None:  # else a death is noticed at the next message
            self._watching = _thread.allocate_lock()
            self._watching.acquire()
            try:
                _thread.start_new_thread(self._watch, ())  # (as a daemon thread)
            except RuntimeError:  # no thread to be had: a death is noticed at the next
                # message, as without a pidfd; held, every close would wait its full second
                self._watching.release()
                self._watching = None

    def _started(self, pid: int, w: int) -> None:
        self.pid = pid
        self._spared = self._spared | {pid}  # a new set: strays() may be reading the old one
        self._w = w
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):  # before Linux 5.3, out of descriptors, a Python without it
            self._pidfd = None

    def _watch(self) -> None:
        """The watcher thread: wait for the guard's exit (its pidfd); restart it unless
        the launcher closed it. Releases ``_watching`` as it ends."""
        try:
            self._watch_guard()
        finally:
            assert self._watching is not None
            self._watching.release()

    def _watch_guard(self) -> None:
        while True:
            with self._lock:  # (not between a restart's reap and its new pidfd)
                fd = self._pidfd
            if fd is None:  # closed, or no pidfd for a restarted guard
                return
            poller = select.poll()  # (not select(): any fd number)
            poller.register(fd, select.POLLIN)
            poller.poll()  # POLLNVAL at once if a restart on the main thread closed it
            with self._lock:
                if self._w is None:  # closed: the guard quit as told
                    return
                self._check()  # (the fd may be a stale one: then the guard still runs)

    def _reap(self, flags: int) -> bool:
        """Whether the guard has exited (reaped now; ``flags``: 0 waits for it); says so
        in one line unless it quit as told."""
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped already
            pid, status = self.pid, 0
        if pid == 0:
            return False
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if status != 0 or self._w is not None:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            how = f"was killed by {signal.Signals(sig).name}" if sig else f"exited with status {status >> 8}"
            if sig == signal.SIGKILL:
                how += " (the OOM killer?)"
            what = "restarting it" if self._w is not None else "the job had ended"
            say(f"warning: the orphan guard (pid {self.pid}) {how}; {what}")
        return True

    def _restart(self) -> None:
        """Start a new guard (a fresh interpreter) and tell it every registered group and
        path. If that fails the job goes on without one, and one line says so."""
        assert self._w is not None
        os.close(self._w)
        self._w = None
        msg = b"".join([b"+%d\n" % g for g in self._groups] + [p.join((b"p", b"\n")) for p in self._paths])
        r, w = os.pipe()
        try:
            os.set_inheritable(r, True)
            env = dict(os.environ)  # the package is importable wherever this copy lives
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            argv = [sys.executable, "-m", "distlaunch.agent.guard", str(os.getpid()), *map(str, self._spared)]
            # stdout and stderr on /dev/null as the first guard's (start): not the launcher's
            null = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
            pid = os.posix_spawn(
                sys.executable, argv, env, file_actions=[(os.POSIX_SPAWN_DUP2, r, 0), *null], setsid=True
            )
            self._spared = self._spared | {pid}  # at once: kill_strays must not take it for a stray
            os.write(w, msg)  # fits the pipe: a few lines per group
        except OSError as e:
            os.close(w)
            say(f"warning: cannot restart the orphan guard ({e}): no orphan protection from now on")
            return
        finally:
            os.close(r)
        self._started(pid, w)

    def _check(self) -> None:
        """Under the lock: restart the guard if it died."""
        if self._w is not None and self._reap(os.WNOHANG):
            self._restart()

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
        with self._lock:
            self._groups.add(pgid)
            self._send(b"+%d\n" % pgid)

    def forget(self, pgid: int) -> None:
        with self._lock:
            self._groups.discard(pgid)
            self._send(b"-%d\n" % pgid)

    literal = staticmethod(glob_escape)

    def clean_up(self, path: str) -> None:
        """Remove what the glob pattern ``path`` names (files or directory trees) if the
        launcher dies first (``literal`` makes a plain path one)."""
        with self._lock:
            self._paths.append(os.fsencode(path))
            self._send(self._paths[-1].join((b"p", b"\n")))

    def close(self, wait: float | None = None) -> None:
        """Normal end: the guard exits without killing anything (one that died
        meanwhile is only reported). Blocks until it has exited and is reaped; with
        ``wait`` (seconds, for a process about to exit) at most that long: a guard that
        cannot run then (stopped) is left to quit later (it reads the quit before the
        pipe's end, so it kills nothing) and to be reaped by whoever adopts it. Not
        waiting at all would leave a zombie per launch where that is a pid 1 that reaps
        nothing (a container's own program)."""
        with self._lock:
            if self._w is None:
                return
            try:
                os.write(self._w, b"q\n")
            except BrokenPipeError:
                pass
            os.close(self._w)
            self._w = None
            if wait is None:
                reaped = self._reap(0)
            else:
                end = time.monotonic() + wait
                poller = select.poll()  # readable at its exit: no sleep's granularity
                if self._pidfd is not None:
                    poller.register(self._pidfd, select.POLLIN)
                while not (reaped := self._reap(os.WNOHANG)) and (left := end - time.monotonic()) > 0:
                    if self._pidfd is None:
                        time.sleep(0.0005)  # it quits within ~1 ms when it can run
                    else:
                        poller.poll(1e3 * left)
        if self._watching is not None and reaped and self._watching.acquire(timeout=1.0):
            self._watching.release()  # (the watcher has ended)

    def _send(self, msg: bytes) -> None:
        """Under the lock."""
        if self._w is not None:
            try:
                os.write(self._w, msg)  # < PIPE_BUF: atomic
            except BrokenPipeError:  # died before the watcher saw it (or without one)
                self._reap(0)
                self._restart()  # tells the new guard everything, this message included


def remove_matching(pattern: str) -> None:
    """Remove every file or directory tree the glob ``pattern`` names; never raises.
    The patterns agents use go with os alone (glob and shutil, with shutil's bz2 and
    lzma, cost ~3-10 ms of CPU to import at every agent's end): a path without glob
    characters (the scratch directory) and ``DIR/PREFIX*`` (a round's shared-memory
    segments; PREFIX plain, not starting with a dot, which ``*`` would not match),
    for agents and the fast lane alike (``quick.finish``'s removals are these two)."""
    parent, name = os.path.split(pattern)
    if not _MAGIC & set(parent):
        prefix = name[:-1] if name.endswith("*") else None
        if not _MAGIC & set(name):  # glob names it if it exists (a dangling link too)
            if os.path.lexists(pattern):
                remove_tree(pattern)
            return
        if prefix and prefix[0] != "." and not _MAGIC & set(prefix):
            try:
                names = os.listdir(parent or os.curdir)
            except OSError:  # (glob finds nothing there)
                return
            for entry in names:
                if entry.startswith(prefix):
                    remove_tree(os.path.join(parent, entry))
            return
    import glob

    for path in glob.glob(pattern):
        remove_tree(path)


def remove_tree(path: str) -> None:
    """The file or link (the link itself), or the directory tree, at ``path`` (taken as
    it is: no glob, which a scratch directory under a $TMPDIR holding ``[`` would
    defeat), removed; never raises. A
    directory of files goes with os alone, through a descriptor opened without following
    a link (``/dev/shm`` is world-writable: a directory swapped for a link after a check
    must not have the link's target emptied, which ``shutil.rmtree`` refuses too);
    anything deeper through ``shutil.rmtree``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # not a directory (a link to one included), or gone
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        for entry in os.listdir(fd):
            os.unlink(entry, dir_fd=fd)  # (IsADirectoryError: a subdirectory)
    except OSError:
        import shutil

        shutil.rmtree(path, ignore_errors=True)  # (refuses a link, as the open above)
        return
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _set_title(agent: int) -> None:
    try:
        # imported here, in the guard only: the launcher's start-up does not pay for it.
        # SPT_NOENV: the title takes only the command line's room, the environment stays
        # readable in /proc (tools find a job's processes by it)
        os.environ["SPT_NOENV"] = "1"
        from setproctitle import setproctitle

        setproctitle(f"distlaunch guard for pid {agent}")
    except ImportError:  # ps shows the launcher's command line twice
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
    # the title (setproctitle's import: ~5 ms of CPU) once the workers have started,
    # not beside their interpreters' start; a job shorter than that never needs it
    title_at: float | None = time.monotonic() + TITLE_AFTER

    def descendants(table: dict[int, Proc]) -> set[int]:
        adopted = {p.pid for p in table.values() if p.ppid == agent and p.pid not in spared}
        alive = {pid for pid, start in known.items() if pid in table and table[pid].start == start}
        return job_processes(table, set(groups) | adopted | alive, groups) - spared

    while True:
        wait = interval if groups else None
        if title_at is not None:
            until = max(0.0, title_at - time.monotonic())
            wait = until if wait is None else min(wait, until)
        if wait is not None and not select.select([fd], [], [], wait)[0]:
            if title_at is not None and time.monotonic() >= title_at:
                _set_title(agent)
                title_at = None
                continue
            if not groups:
                continue
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


if __name__ == "__main__":  # a restarted guard (OrphanGuard._restart): the pipe is stdin
    _guard_loop(0, int(sys.argv[1]), {int(a) for a in sys.argv[2:]})
