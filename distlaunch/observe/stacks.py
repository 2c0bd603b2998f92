"""Every thread's Python stack of running processes, read from outside with py-spy.

py-spy (``py-spy dump --pid P --json``) reads the interpreter's memory with ptrace /
``process_vm_readv``; the target needs no change and is paused only for the read (a few
ms). Why py-spy rather than pystack: docs/observe.md.

Attaching needs the right to ptrace the target: the same user and, under YAMA
``ptrace_scope=1`` (Ubuntu's default), being its ancestor. The agent is its workers'
parent, but a sampler it spawns is their sibling; a worker that calls
``allow_tracing_by(agent_pid)`` lets the agent and its children attach. A refused attach
becomes one line naming the three ways out (``REFUSED_HINT``).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PR_SET_PTRACER = 0x59616D61  # "Yama": linux/prctl.h

REFUSED_HINT = (
    "attaching to read its stack was refused (ptrace): allow it with "
    "`sysctl kernel.yama.ptrace_scope=0`, give distlaunch CAP_SYS_PTRACE, or have the workers "
    "call distlaunch.observe.stacks.allow_tracing_by(<agent pid>)"
)


@dataclass(frozen=True)
class Frame:
    """One frame: function ``name``, source ``path`` and ``line`` (a native frame: its C
    source file and line, or its shared library and 0)."""

    name: str
    path: str
    line: int

    @property
    def file(self) -> str:
        return os.path.basename(self.path)

    @property
    def native(self) -> bool:
        # py-spy --native names C frames by their source file when it has debug info
        # (callproc.c:940), else by their shared library with no line
        return self.line == 0 or not self.path.endswith(".py")


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack, innermost frame first; ``main`` for the main thread."""

    tid: int
    name: str
    main: bool
    frames: tuple[Frame, ...]


@dataclass(frozen=True)
class RankStack:
    """Every thread of one rank's process, the main thread first."""

    rank: int
    pid: int
    threads: tuple[ThreadStack, ...]

    @property
    def main(self) -> ThreadStack | None:
        return self.threads[0] if self.threads and self.threads[0].main else None


@dataclass(frozen=True)
class StackError:
    """Why one rank's stack could not be read; ``message`` is the reason alone."""

    rank: int
    pid: int
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank} (pid {self.pid}): {self.message}"


def sampler_path() -> str | None:
    """The py-spy executable installed beside this interpreter (not a pyenv shim, which
    costs a shell start per call), else the one on PATH; None when there is none."""
    here = os.path.join(sysconfig.get_path("scripts"), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("py-spy")


def ptrace_scope() -> int | None:
    """YAMA's ``kernel.yama.ptrace_scope`` (0 classic, 1 ancestors only, 2 admin only,
    3 none), or None where YAMA is not in the kernel."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def allow_tracing_by(pid: int) -> bool:
    """Let process ``pid`` and its descendants ptrace this process under YAMA
    ``ptrace_scope=1`` (``prctl(PR_SET_PTRACER, pid)``; -1 lets any process of the same
    user). Meant for a worker bootstrap, with the agent's pid. Returns True when set,
    False where the kernel has no YAMA or this is not Linux; never raises."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arg = ctypes.c_ulong(pid if pid >= 0 else (1 << (8 * ctypes.sizeof(ctypes.c_ulong))) - 1)
        return bool(libc.prctl(PR_SET_PTRACER, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def parse_dump(rank: int, pid: int, text: str | bytes) -> RankStack:
    """A RankStack from ``py-spy dump --json`` output (a list of threads, each with
    ``frames`` innermost first). Raises ValueError when ``text`` is not that."""
    try:
        data = json.loads(text)
        threads = []
        for t in data:
            frames = tuple(Frame(str(f["name"]), str(f["filename"]), int(f["line"])) for f in t["frames"])
            tid = int(t.get("os_thread_id") or t["thread_id"])
            name = str(t.get("thread_name") or "")
            threads.append(ThreadStack(tid, name, tid == pid or name == "MainThread", frames))
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"py-spy's output for pid {pid} is not its JSON dump: {e}") from e
    threads.sort(key=lambda t: (not t.main, t.tid))
    return RankStack(rank, pid, tuple(threads))


def _reason(stderr: str, pid: int) -> str:
    """One line saying why py-spy failed, from its stderr (its first line and the
    'Caused by' chain name the OS error)."""
    if "Permission denied" in stderr or "Operation not permitted" in stderr:
        return REFUSED_HINT
    if "No such file or directory" in stderr or not os.path.exists(f"/proc/{pid}"):
        return "the process has exited"
    if "Failed to find python version" in stderr:
        return "not a Python process (or an interpreter py-spy cannot read)"
    first = next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "no error text")
    return f"py-spy failed: {first}"


def _dump_one(exe: str, rank: int, pid: int, native: bool, timeout: float) -> RankStack | StackError:
    argv = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else [])
    try:
        # subprocess.run kills py-spy on timeout; py-spy resumes the target when it dies
        # (the pause is a ptrace stop that ends with the tracer)
        p = subprocess.run(argv, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return StackError(rank, pid, f"py-spy did not answer within {timeout:g} s")
    except OSError as e:
        return StackError(rank, pid, f"cannot run {exe}: {e.strerror}")
    if p.returncode != 0:
        return StackError(rank, pid, _reason(p.stderr.decode(errors="replace"), pid))
    try:
        return parse_dump(rank, pid, p.stdout)
    except ValueError as e:
        return StackError(rank, pid, str(e))


_ONE_DUMP = threading.Lock()


def dump_stacks(
    pids: Mapping[int, int], native: bool = False, timeout: float = 10.0, max_parallel: int = 16
) -> dict[int, RankStack | StackError]:
    """Every thread's stack of each process in ``pids`` (rank -> pid), read by py-spy,
    up to ``max_parallel`` processes at once. Blocks until every read is done or
    ``timeout`` seconds pass for it. ``native``: add C/C++ frames (py-spy ``--native``).

    Never raises for one process: a rank whose stack cannot be read maps to a StackError
    saying why in one line (exited, refused attach and how to allow it, not Python,
    timeout). Raises FileNotFoundError when py-spy is not installed."""
    exe = sampler_path()
    if exe is None:
        raise FileNotFoundError("py-spy is not installed: `pip install py-spy` (a dependency of distlaunch)")
    if not pids:
        return {}
    # one dump at a time (an agent's watchdog and a `distlaunch stacks` request may ask
    # together): a second ptrace attach to the same process is refused
    with _ONE_DUMP, ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(pids)))) as pool:
        futures = {r: pool.submit(_dump_one, exe, r, p, native, timeout) for r, p in pids.items()}
        return {r: f.result() for r, f in sorted(futures.items())}


def encode_stacks(
    stacks: Mapping[int, RankStack | StackError], ops: Mapping[int, str] | None = None
) -> bytes:
    """Stacks as JSON for another process (``distlaunch stacks``): ``{rank: {"pid": P,
    "threads": [[tid, name, main, [[fn, path, line]...]]...], "op": in-flight op}}``, or
    ``{rank: {"pid": P, "error": "why"}}``."""
    out: dict[str, dict[str, object]] = {}
    for rank, st in stacks.items():
        if isinstance(st, StackError):
            out[str(rank)] = {"pid": st.pid, "error": st.message}
        else:
            threads = [
                [t.tid, t.name, t.main, [[f.name, f.path, f.line] for f in t.frames]] for t in st.threads
            ]
            out[str(rank)] = {"pid": st.pid, "threads": threads}
        if ops and ops.get(rank):
            out[str(rank)]["op"] = ops[rank]
    return json.dumps(out).encode()


def decode_stacks(value: bytes) -> tuple[dict[int, RankStack | StackError], dict[int, str]]:
    """Inverse of ``encode_stacks``: (stacks, ops). Raises ValueError for anything else."""
    try:
        out: dict[int, RankStack | StackError] = {}
        ops: dict[int, str] = {}
        for rank_s, d in json.loads(value).items():
            rank, pid = int(rank_s), int(d["pid"])
            if d.get("op"):
                ops[rank] = str(d["op"])
            if "error" in d:
                out[rank] = StackError(rank, pid, str(d["error"]))
                continue
            threads = tuple(
                ThreadStack(
                    int(tid), str(name), bool(main), tuple(Frame(str(a), str(b), int(c)) for a, b, c in fr)
                )
                for tid, name, main, fr in d["threads"]
            )
            out[rank] = RankStack(rank, pid, threads)
        return out, ops
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a node's stacks: {e}") from e
