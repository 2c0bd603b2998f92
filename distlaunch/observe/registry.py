"""This user's running jobs on this host, for ``distlaunch ps``, ``top`` and ``stacks``.

Each node agent writes one small JSON file while it runs: run id, its pid, start time,
world size, its host, and how to reach the job's store (address, port and token). The
token makes the file a secret, so it follows docs/security.md's per-user secret rules:
the directory is ``$XDG_RUNTIME_DIR/distlaunch/jobs`` (the per-user runtime directory,
mode 0700, emptied at logout) or else ``$XDG_CONFIG_HOME/distlaunch/jobs`` (default
``~/.config/distlaunch/jobs``), in a directory per host (a home directory is often shared by
every node: an entry's pid means something only on its own host), made 0700; the file is
created 0600, and a reader refuses
a file another user owns or that others may read. An entry whose agent is gone is
removed by the next reader.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass

from ..env import lookup


@dataclass(frozen=True)
class JobEntry:
    """One agent's entry: ``started`` seconds since the epoch; ``store`` is
    (host, port, token)."""

    run_id: str
    pid: int
    started: float
    host: str
    world_size: int
    store_host: str
    store_port: int
    store_token: str | None


def jobs_dir() -> str:
    """Where this host's entries live (see the module docstring)."""
    run = lookup("XDG_RUNTIME_DIR")
    if run and os.path.isdir(run):
        base = run
    else:
        base = lookup("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "distlaunch", "jobs", socket.gethostname())


def _path(run_id: str, pid: int) -> str:
    return os.path.join(jobs_dir(), f"{run_id}.{pid}.json")


def write_entry(entry: JobEntry) -> str:
    """Write (or replace) this agent's entry, 0600 in a 0700 directory; returns its path.
    Raises OSError."""
    d = jobs_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    path = _path(entry.run_id, entry.pid)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(asdict(entry)).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_entry(run_id: str, pid: int) -> None:
    """Remove this agent's entry; never raises."""
    try:
        os.unlink(_path(run_id, pid))
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process reused the pid
        return False
    return True


def running_jobs() -> dict[str, list[JobEntry]]:
    """run id -> the entries of its live agents on this host, oldest job first. Entries
    of agents that are gone are removed; files that are not this user's own 0600 files
    are skipped."""
    d = jobs_dir()
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return {}
    out: dict[str, list[JobEntry]] = {}
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                continue
            e = JobEntry(**json.loads(os.read(fd, 1 << 16)))
        except (OSError, ValueError, TypeError):
            continue
        finally:
            os.close(fd)
        if not _alive(e.pid):
            remove_entry(e.run_id, e.pid)
            continue
        out.setdefault(e.run_id, []).append(e)
    return dict(sorted(out.items(), key=lambda kv: min(e.started for e in kv[1])))


def describe(run_id: str, entries: list[JobEntry]) -> str:
    """One line for ``distlaunch ps``: run id, start time, world size, hosts."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(min(e.started for e in entries)))
    hosts = ",".join(sorted({e.host for e in entries}))
    size = max(e.world_size for e in entries)
    return f"{run_id}  started {started}  world size {size or '?'}  hosts {hosts}"
