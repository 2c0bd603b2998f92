"""The shared-memory channel of a group whose members share one node: the segment, its
phases and their synchronisation (the algorithms on it: :mod:`distlaunch.collectives.algorithms.shm`).

One segment per group (a file under /dev/shm named ``<DISTLAUNCH_SHM_PREFIX>...``),
created lazily by the group's first collective and unlinked as soon as every member has
mapped it (so nothing is left behind even if a rank dies later). Layout::

    [0, 4096)           header: abort word (reason), aborting rank
    [4096, +n*256)      per rank: u32 phase counter (the futex word), u32 sleep flag
                        (1 + the rank it sleeps on), pid, 2 call records (op seq,
                        op, dtype, count, root, redop) for even and odd phases
    DATA + j*2*SLOT     rank j's two data buffers of SLOT bytes (double buffering)

Synchronisation is one monotonically increasing *phase* counter per rank, written only
by that rank. Invariant: when rank j publishes phase p it has written every datum of
phases <= p and finished reading every datum of phases <= p - 1; data of phase p lives
in buffer ``p % 2`` (and the call record of an operation starting at phase p in record
``p % 2``), so a rank writes its buffer or record for phase p only after every rank
reached p - 1 (:meth:`ShmChannel.settle`); the one exception, inside one operation, is
two ranks' chunked all_reduce (``algorithms.shm``'s run-ahead), which restores the rule
with a closing phase. Every rank runs the same sequence of phases,
so phases agree across ranks. Calls are compared on the records: an operation of several
phases starts with a full barrier that compares every rank's (:meth:`ShmChannel.begin`:
ranks that disagree all raise CollectiveMismatchError before any data-dependent phase);
a one-phase (eager) operation has each rank compare the records of the ranks it reads
from (:meth:`ShmChannel.take`), and a rank that did not compare every rank's compares
them at the start of its next operation (``unchecked``; those records stay until every
rank has passed that start).

Waiting: spin briefly on the counter (each check after a ``sched_yield``, so a waiter
hands its core to any runnable process, e.g. the peer it waits for), then set the sleep
flag and sleep in ``futex(FUTEX_WAIT)`` on the counter; the writer stores its counter,
fences, and calls ``FUTEX_WAKE`` only if a sleep flag names it (Dekker's pattern: the
kernel re-reads the counter after a locked instruction, so either the writer sees the
flag or the sleeper sees the new value).
Sleeps last at most 50 ms; between slices the waiter checks the abort word, the group's
broken flag (set by a TCP ABORT), the deadline (-> the group names the missing ranks
over TCP) and whether the awaited peer's pid still exists (-> PeerLostError). Stores
become visible in program order on x86 (TSO), which the protocol relies on: the
channel is only enabled on x86-64.

Reserving: a segment's pages are reserved when it is mapped (``map_segment``:
``posix_fallocate``), so a small or full /dev/shm (Docker's default is 64 MiB) is found
then, not as SIGBUS at the first touch of a missing page. Every process that maps a
segment reaches the same verdict (the first to decide writes it as a symlink next to the
segment, atomically, which a full tmpfs still holds), so on failure they all raise
ShmFullError and use TCP instead, and one of them prints one warning line.

Sizes (``ShmConfig``, read from the environment by init_process_group, not at import):
SLOT bytes per data buffer (DISTLAUNCH_SHM_SLOT, default 4 MiB), all_reduce CHUNK
(DISTLAUNCH_SHM_CHUNK, default 2 MiB), spins before sleeping (DISTLAUNCH_SHM_SPIN,
default 400), yielding while spinning (DISTLAUNCH_SHM_YIELD, default on).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, NoReturn

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..context import OpContext, OpTimeout
from ..errors import CollectiveError, CollectiveMismatchError, PeerLostError
from ..ops import ReduceOp, check_op, ufunc
from ..wire import ABORT_MISMATCH, ABORT_PEER_LOST, DTYPE_CODES, NO_REDOP, OP_CODES, OP_NAMES

SLOT = 4 << 20  # default bytes per data buffer
CHUNK = 2 << 20  # default all_reduce bytes per chunk
_CACHED = 64  # small_plan's plans, and the calls it met once, kept at most
# all_reduce: one-phase algorithm up to here (measured: it wins below ~384 KiB at n = 2
# and 4); one buffer must hold it
SMALL_MAX = 256 * 1024
_HDR, _CTL = 4096, 256
# phase counters are u32 and wrap: a reached b when (a - b) & PHASE_MASK < PHASE_HALF
PHASE_MASK, PHASE_HALF = 0xFFFFFFFF, 0x80000000
_M, _H = PHASE_MASK, PHASE_HALF
_SLICE = 0.05  # seconds per futex sleep between liveness checks
# bytes at the head of a phase buffer whose first int64 holds a value of its rank's
# (all_to_all: its longest block; ``set_head``/``heads``), a cache line
HEAD = 64
POLL = 1000  # busy checks of a counter per round of take's ``spin`` (about 50 µs)

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_futex: Callable[..., int] | None = None


def _futex_fn() -> Callable[..., int]:
    global _futex
    if _futex is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        _futex = fn
    return _futex


class ShmConfig(NamedTuple):
    """Sizes and spinning of every shared-memory channel of one initialisation."""

    slot: int = SLOT  # bytes per data buffer
    chunk: int = CHUNK  # all_reduce bytes per chunk
    spin: int = 400  # counter checks before sleeping in the kernel
    yield_spin: bool = True  # sched_yield between checks

    @property
    def small(self) -> int:
        """Largest all_reduce (bytes) run with the one-phase algorithm."""
        return min(SMALL_MAX, self.slot)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ShmConfig:
        """DISTLAUNCH_SHM_SLOT, DISTLAUNCH_SHM_CHUNK (bytes), DISTLAUNCH_SHM_SPIN (count),
        DISTLAUNCH_SHM_YIELD ("0": spin without yielding); unset means the default."""
        spin = env.get("DISTLAUNCH_SHM_SPIN", "")
        return cls(
            slot=int(env.get("DISTLAUNCH_SHM_SLOT", SLOT)),
            chunk=int(env.get("DISTLAUNCH_SHM_CHUNK", CHUNK)),
            spin=int(spin) if spin.isdigit() else 400,
            # yield while spinning: other processes on the machine (other ranks, other
            # nodes of a loopback job, their progress threads) may need this core
            yield_spin=env.get("DISTLAUNCH_SHM_YIELD", "1") != "0",
        )


def available() -> bool:
    """True when this platform supports the shared-memory transport (Linux x86-64 with
    /dev/shm) and DISTLAUNCH_SHM is not "0"."""
    return (
        os.environ.get("DISTLAUNCH_SHM", "1") != "0" and _SYS_FUTEX is not None and os.path.isdir("/dev/shm")
    )


class ShmFullError(OSError):
    """A shared-memory segment's pages could not be reserved (/dev/shm too small or
    full). Raised alike to every process that maps the segment (``map_segment``): they
    use TCP instead. ``str()`` is the one-line warning (:func:`warn_full`)."""

    def __init__(self, path: str, size: int, reason: str | None):
        self.path, self.size = path, size
        super().__init__(errno.ENOSPC, _full_message(path, size, reason))

    def __str__(self) -> str:
        return str(self.args[1])


_VERDICT = "-ok"  # the verdict symlink: <segment path>-ok -> "1" (reserved) or "0"
_warned = False


def _mib(n: float, up: bool = False) -> str:
    """``n`` bytes in MiB to 0.1, rounded ``up`` or down (a segment never seems to fit)."""
    tenths = -(-n * 10 // (1 << 20)) if up else n * 10 // (1 << 20)
    return f"{tenths / 10:.1f} MiB"


def _full_message(path: str, size: int, reason: str | None) -> str:
    """The warning: the directory, its size and free room, the segment, the fix."""
    d = os.path.dirname(path)
    try:
        st = os.statvfs(d)
        room = f"{_mib(st.f_blocks * st.f_frsize)}, {_mib(st.f_bavail * st.f_frsize)} free"
    except OSError:
        room = "size unknown"
    why = f" ({reason})" if reason else ""
    return (
        f"{d} ({room}) cannot hold a {_mib(size, True)} shared-memory segment{why}; the ranks "
        f"of this node use TCP instead (slower). Fix: a larger {d} (docker run --shm-size=1g, "
        f"or mount -o remount,size=... {d}), or DISTLAUNCH_SHM=0 to silence this"
    )


def warn_full(err: ShmFullError) -> None:
    """Print ``err`` as one warning line on stderr, once per process (the caller picks
    one process per segment, e.g. the lowest rank, so a node says it once)."""
    global _warned
    if not _warned:
        _warned = True
        sys.stderr.write(f"distlaunch: warning: {err}\n")
        sys.stderr.flush()


def _reserve(fd: int, size: int) -> str | None:
    """Make ``fd`` ``size`` bytes long with every page allocated; None, or why not."""
    try:
        st = os.fstat(fd)
        if st.st_blocks * 512 >= size:
            return None  # every page is there (reserved by another process): no walk over them
        if st.st_size < size:
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None  # a file system without fallocate (not tmpfs): mapped as before
        return e.strerror or str(e)
    return None


def _vote(path: str, ok: bool) -> bool:
    """The segment's verdict: the first process to vote decides for all (symlink(2) is
    atomic and needs no data block, so a full tmpfs still takes it)."""
    link = path + _VERDICT
    while True:
        try:
            os.symlink("1" if ok else "0", link)
            return ok
        except FileExistsError:
            pass
        try:
            return os.readlink(link) == "1"
        except FileNotFoundError:
            # the segment's last user unlinked it and its verdict just now (a rank that
            # ends right after its last send): nobody else maps that file, vote again
            continue


def map_segment(path: str, size: int) -> mmap.mmap:
    """Create (or open) the shared-memory file ``path``, make it ``size`` bytes with every
    page reserved (``posix_fallocate``), and map it. Every process mapping ``path`` gets
    the same outcome: the mapping, or ShmFullError (then the file is removed; its verdict
    stays for processes that come later, and goes with the segment's prefix). Blocks
    while the pages are allocated (zeroed: about 1 ms per 4 MiB)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            verdict: bool | None = os.readlink(path + _VERDICT) == "1"
        except FileNotFoundError:
            verdict = None
        why = _reserve(fd, size) if verdict is not False else None
        if verdict is None:
            verdict = _vote(path, why is None)
            if verdict and why is not None:  # another process reserved every page meanwhile
                why = _reserve(fd, size)
        if not verdict or why is not None:  # (why: None when another process failed first)
            _unlink_data(path)
            raise ShmFullError(path, size, why)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not reaped yet still answers kill(0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except OSError:
        return True


class ShmChannel:
    """The shared-memory channel of one group whose members share a node.

    ``group``: the group's :class:`~distlaunch.collectives.context.Members`; ``name``: segment file name
    (already carrying DISTLAUNCH_SHM_PREFIX); ``config``: sizes. Created by the group's
    first collective; every method runs inside that group's operations (serialised by
    the group), on the calling or the group's executor thread.
    """

    def __init__(self, group: Any, name: str, config: ShmConfig):
        self.group = group
        self.config = config
        self.slot = slot = config.slot
        self.n, self.r = group.size, group.rank
        self.path = os.path.join("/dev/shm", name)
        self.size = _HDR + _round(self.n * _CTL) + self.n * 2 * slot
        self.mm = map_segment(self.path, self.size)  # raises ShmFullError
        # every member has mapped the segment and it is unlinked (read-only outside: then
        # reached(p) only sets all_at, which the hot paths do themselves)
        self.unlinked = False
        self.words = memoryview(self.mm).cast("I")
        self.quads = memoryview(self.mm).cast("q")
        self.raw = np.frombuffer(self.mm, np.uint8)
        self.mv = memoryview(self.mm)  # the segment as bytes (for callers copying from buffers)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self._futex = _futex_fn()
        self._ts = _Timespec()
        data = _HDR + _round(self.n * _CTL)
        self.bufs = [
            [self.raw[data + (2 * j + k) * slot : data + (2 * j + k + 1) * slot] for k in (0, 1)]
            for j in range(self.n)
        ]
        self._buf_offs = [[data + (2 * j + k) * slot for k in (0, 1)] for j in range(self.n)]
        self._sidx = self._ctl(self.r) // 4
        self._flag_idx = [self._ctl(j) // 4 + 1 for j in range(self.n)]  # rank j sleeps on rank w-1
        # the flags a publish reads: the others' (ours never names this rank)
        self._peer_flags = [self._flag_idx[j] for j in range(self.n) if j != self.r]
        self._fence = threading.Lock()
        self._views: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        self._small: dict[tuple, SmallPlan] = {}  # the plans, by call (oldest first)
        self._seen: dict[tuple, bool] = {}  # calls met once without a plan (oldest first)
        # byte offsets of every rank's two meta records (phase parity)
        self._meta_offs = [[self._ctl(j) + 16 + 64 * k for j in range(self.n)] for k in (0, 1)]
        self._rec_off = [offs[self.r] for offs in self._meta_offs]
        # the call (bytes) this rank's record of each parity holds after the op sequence
        # number: a plan's, which repeats, is not rewritten
        self._calls: list[bytes | None] = [None, None]
        self._peers = [j for j in range(self.n) if j != self.r]
        self._cidx = [self._ctl(j) // 4 for j in range(self.n)]  # every rank's counter (word index)
        self.mine = self.bufs[self.r]  # this rank's two data buffers
        self.unchecked = 0  # a one-phase operation whose calls the next one compares
        self.phase = 0  # last phase this rank published
        self.all_at = 0  # every rank is known to have reached this phase
        self.quads[self._ctl(self.r) // 8 + 1] = os.getpid()
        self._fence.acquire()  # (a full barrier: our pid before reading the others')
        self._fence.release()
        if self._mapped_all():  # the last member to map it unlinks it
            self.unlinked = True
            _unlink(self.path)
        self._next_check = 0.0
        self.spin = config.spin
        self.yield_spin = config.yield_spin

    # -- layout

    def _ctl(self, j: int) -> int:
        return _HDR + j * _CTL

    def view(self, j: int, p: int, dtype: np.dtype, count: int, offset: int = 0) -> np.ndarray:
        """Rank j's buffer of phase p as ``count`` elements of ``dtype`` from byte
        ``offset``."""
        return self.bufs[j][p & 1][offset : offset + count * dtype.itemsize].view(dtype)

    def counter_index(self, j: int) -> int:
        """Index in ``words`` of rank j's phase counter."""
        return self._cidx[j]

    def record_offset(self, j: int, p: int) -> int:
        """Byte offset in the segment of rank j's call record of phase p (48 bytes: op
        seq, op, dtype, count, root, redop). For reading only: :meth:`publish` is the
        one writer of this rank's records (it skips rewriting a repeated call, and
        :meth:`take` compares with what it wrote)."""
        return self._meta_offs[p & 1][j]

    def data_offset(self, j: int, p: int) -> int:
        """Byte offset in the segment (``mv``) of rank j's data buffer of phase p."""
        return self._buf_offs[j][p & 1]

    def views(self, p: int, dtype: np.dtype, count: int) -> list:
        """Every rank's buffer of phase p as ``count`` x ``dtype`` (cached: small
        operations repeat the same shapes)."""
        key = (p & 1, dtype, count)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 64:
                self._views.clear()
            v = self._views[key] = [self.view(j, p, dtype, count) for j in range(self.n)]
        return v

    def head_index(self, j: int, p: int) -> int:
        """Index in ``quads`` of the int64 at the head of rank j's phase-``p`` buffer."""
        return self._buf_offs[j][p & 1] >> 3

    def set_head(self, p: int, value: int) -> None:
        """Store ``value`` (int64) at the head of this rank's phase-``p`` buffer."""
        _Q.pack_into(self.mm, self._buf_offs[self.r][p & 1], value)

    def heads(self, p: int) -> list[int]:
        """The int64 at the head of every rank's phase-``p`` buffer."""
        k, mm = p & 1, self.mm
        return [_Q.unpack_from(mm, offs[k])[0] for offs in self._buf_offs]

    # -- synchronisation

    def _wake(self, j: int) -> None:
        self._futex(_SYS_FUTEX, self.base + self._ctl(j), 1, 0x7FFFFFFF, None, None, 0)

    def signal(self, p: int) -> None:
        """Publish phase ``p`` (everything this rank wrote for it is in place); wake the
        ranks sleeping on our counter. Dekker-style: we store the counter, fence, read
        the sleep flags; a sleeper stores its flag and the kernel re-reads the counter
        after a locked instruction, so one of the two sees the other. (Written out in
        :meth:`publish`, the eager operations' signal.)"""
        self.phase = p
        w = self.words
        w[self._sidx] = p & _M
        # one locked instruction (a full memory barrier on x86): taking the free lock
        # (an atomic compare-and-swap) or, when the last call took it, releasing it
        # (an atomic add); whatever state an interrupted call left, never a wait. The
        # channel is one thread's at a time (the group's executor serialises its
        # operations; MPI makes concurrent collectives on one communicator erroneous):
        # two threads here at once could see release() raise RuntimeError
        if not self._fence.acquire(False):
            self._fence.release()
        me = self.r + 1
        for i in self._peer_flags:
            if w[i] == me:
                self._wake(self.r)
                return

    def need(self, j: int, p: int, ctx: OpContext) -> None:
        """Block until rank j published phase ``p``: spin, then futex sleeps of at most
        50 ms. Raises the group's ``broken`` error (a TCP ABORT arrived), the error an
        aborting peer signalled in the segment (CollectiveMismatchError, PeerLostError,
        CollectiveError), PeerLostError when j's process is gone, and the internal
        OpTimeout (turned into CollectiveTimeoutError naming the missing ranks by the
        group) past ``ctx.deadline``."""
        idx = self._cidx[j]
        w = self.words
        if (w[idx] - p) & _M < _H:
            return
        yld = self.yield_spin
        for _ in range(self.spin):
            if yld:
                os.sched_yield()
            if (w[idx] - p) & _M < _H:
                return
        ts, addr, flag = self._ts, self.base + self._ctl(j), self._flag_idx[self.r]
        try:
            while True:
                w[flag] = j + 1  # before re-reading the counter (see signal)
                v = w[idx]
                if (v - p) & _M < _H:
                    return
                left = self._check(j, ctx)
                left = min(left, _SLICE)
                ts.tv_sec = int(left)
                ts.tv_nsec = int((left - int(left)) * 1e9)
                self._futex(_SYS_FUTEX, addr, 0, v, ctypes.addressof(ts), None, 0)
        finally:
            w[flag] = 0

    def poll(self, j: int, p: int, checks: int) -> bool:
        """Busy-poll rank j's counter up to ``checks`` times without yielding the core
        or sleeping; True once j published phase ``p``. The cheapest wait when j runs
        on another core and is about to publish (a few microseconds); callers follow it
        with :meth:`need` (or :meth:`take`), which yields, sleeps and checks failures."""
        w, idx = self.words, self._cidx[j]
        for _ in range(checks):
            if (w[idx] - p) & _M < _H:
                return True
        return False

    def need_all(self, p: int, ctx: OpContext) -> None:
        """``need`` on every other rank."""
        if (self.all_at - p) & _M < _H:
            return
        w, cidx = self.words, self._cidx
        for j in self._peers:
            if (w[cidx[j]] - p) & _M >= _H:
                self.need(j, p, ctx)
        if self.unlinked:  # (reached() without the call: every small op runs this)
            self.all_at = p
        else:
            self.reached(p)

    def reached(self, p: int) -> None:
        """Every rank is known to have published phase ``p``."""
        self.all_at = p
        if not self.unlinked:
            self.unlinked = True  # every member has mapped the segment
            if self.r == 0:
                _unlink(self.path)

    def pids(self) -> list[int]:
        """Every member's pid (0: a member that has not mapped the segment yet)."""
        q = self.quads
        return [q[self._ctl(j) // 8 + 1] for j in range(self.n)]

    def _mapped_all(self) -> bool:
        """Every member has mapped the segment (each writes its pid when it maps it; a
        closed member's stays)."""
        q = self.quads
        return all(q[self._ctl(j) // 8 + 1] for j in range(self.n))

    def _check(self, j: int, ctx: OpContext) -> float:
        """Raise if the operation cannot complete; else the seconds left."""
        g = self.group
        if g.broken is not None:
            raise g.broken
        reason = self.words[0]
        if reason:
            self._raise_abort(reason)
        now = time.monotonic()
        left = ctx.deadline - now
        if left <= 0:
            p = self.phase
            raise OpTimeout(
                [k for k in range(self.n) if k != self.r and (self.words[self._ctl(k) // 4] - p) & _M >= _H]
                or [j]
            )
        if now >= self._next_check:
            self._next_check = now + _SLICE
            pid = self.quads[self._ctl(j) // 8 + 1]
            if pid and not _alive(pid):
                raise PeerLostError(f"rank {g.ranks[j]} (pid {pid}) died: its process no longer exists")
        return left

    def _raise_abort(self, reason: int) -> NoReturn:
        g = self.group
        end = time.monotonic() + 0.2  # the TCP ABORT carries the full message
        while g.broken is None and time.monotonic() < end:
            time.sleep(0.005)
        if g.broken is not None:
            raise g.broken
        cls = {ABORT_MISMATCH: CollectiveMismatchError, ABORT_PEER_LOST: PeerLostError}.get(
            reason, CollectiveError
        )
        err = cls(f"rank {g.ranks[self.words[1] % g.size]} aborted {g.name}")
        err._from_abort = True
        raise err

    def abort(self, reason: int) -> None:
        """Tell every member (blocked or not) that the group failed (``reason``: a wire
        ABORT_* code)."""
        try:
            if not self.words[0]:
                self.words[1] = self.r
                self.words[0] = reason
            for j in range(self.n):
                self._wake(j)
        except (ValueError, AttributeError):  # already closed
            pass

    # -- operations

    def step(self, ctx: OpContext, fill: Callable[[np.ndarray], None], first: bool) -> int:
        """One data phase of a multi-phase operation: the first is ``begin`` (which also
        compares the ranks' calls); a later one waits until every rank has left the
        previous phase (its buffer is free again), lets ``fill`` write this rank's
        buffer, signals, and waits for every rank. Returns the phase; raises as
        ``need_all``."""
        if first:
            return self.begin(ctx, fill)
        p = self.phase + 1
        self.need_all(p - 1, ctx)
        fill(self.bufs[self.r][p & 1])
        self.signal(p)
        self.need_all(p, ctx)
        return p

    def begin(self, ctx: OpContext, data: np.ndarray | Callable[[np.ndarray], None] | None = None) -> int:
        """First phase of an operation: publish this rank's meta (and ``data``, a uint8
        array, or a function writing into the given uint8 buffer, into the phase's
        buffer), wait for every rank and compare metas. Returns the phase. Raises
        CollectiveMismatchError naming the first rank whose call differs, or what
        ``need`` raises."""
        p = self.phase + 1
        if data is not None:
            if (self.all_at - p + 1) & _M >= _H:
                self.need_all(p - 1, ctx)
            if callable(data):
                data(self.bufs[self.r][p & 1])
            elif len(data):
                self.bufs[self.r][p & 1][: len(data)] = data
        rec = ctx.record
        if rec is None:
            rec = ctx.record = _CALL.pack(ctx.op, ctx.dtype, ctx.count, ctx.root, ctx.redop)
        self.exchange_calls(ctx, p, rec)
        return p

    def exchange_calls(self, ctx: OpContext, p: int, call: bytes) -> None:
        """Publish this rank's call record (``ctx.seq`` + ``call``, the packed op, dtype,
        count, root, redop) and phase ``p``, wait for every rank, and compare records:
        CollectiveMismatchError names the first rank whose call differs."""
        self.settle(ctx, p)
        self.publish(ctx, p, call)
        self.need_all(p, ctx)
        self.compare(ctx, p, self._peers)

    # -- one-phase (eager) operations: open, write the data, publish, take

    def open(self, ctx: OpContext) -> int:
        """Start a one-phase operation: :meth:`settle` the next phase and return it
        (this rank's buffer of it, ``mine[p & 1]``, is then free to write)."""
        p = self.phase + 1
        if (self.all_at - p + 1) & _M >= _H or self.unchecked:
            self.settle(ctx, p)
        return p

    def settle(self, ctx: OpContext, p: int) -> None:
        """Before this rank writes anything of phase ``p`` (data or call record): wait
        until every rank reached ``p - 1`` (so nobody still reads what we wrote for
        ``p - 2``, the same buffers), then compare the calls of an earlier one-phase
        operation that this rank did not compare with every rank's (``unchecked``)."""
        if (self.all_at - p + 1) & _M >= _H:
            self.need_all(p - 1, ctx)
        if self.unchecked:
            q, self.unchecked = self.unchecked, 0
            if q == p - 1:  # (an operation that failed half way left an older one)
                self.compare(ctx, q, self._peers, _BEFORE)

    def publish(self, ctx: OpContext, p: int, call: bytes, checked: bool = True) -> None:
        """Write this rank's call record of phase ``p`` (``ctx.seq`` + ``call``) and
        publish ``p`` (after :meth:`settle`, with this rank's data of ``p`` in place).
        ``checked``: this operation compares this rank's call with every other rank's
        (else the next operation does, in :meth:`settle`). ``call`` is immutable
        bytes: the same object as the last one published for this parity is not
        written again."""
        k = p & 1
        off = self._rec_off[k]
        self.quads[off >> 3] = ctx.seq
        if self._calls[k] is not call:
            self._calls[k] = None  # (an interrupted write leaves nothing believed in place)
            self.mm[off + 8 : off + 48] = call
            self._calls[k] = call
        # signal(p) written out (every eager operation publishes once)
        self.phase = p
        w = self.words
        w[self._sidx] = p & _M
        if not self._fence.acquire(False):  # (a full barrier: see signal)
            self._fence.release()
        me = self.r + 1
        for i in self._peer_flags:
            if w[i] == me:
                self._wake(self.r)
                break
        if not checked:
            self.unchecked = p

    def take(self, ctx: OpContext, p: int, j: int, spin: int = 0) -> None:
        """Wait until rank ``j`` published phase ``p`` (its data is then readable until
        this rank publishes ``p + 1``) and compare its call with ours, which this
        rank published for ``p`` (as ``need`` and :meth:`compare` raise). ``spin``:
        rounds of :data:`POLL` busy checks of j's counter first, a ``sched_yield``
        after each (see :meth:`poll`)."""
        w, idx = self.words, self._cidx[j]
        if (w[idx] - p) & _M >= _H:
            for _ in range(spin):
                for _ in range(POLL):
                    if (w[idx] - p) & _M < _H:
                        break
                else:
                    os.sched_yield()
                    continue
                break
            else:
                self.need(j, p, ctx)
        if self.n == 2:  # (we published p: the next settle has nothing to wait for)
            if self.unlinked:  # (reached() without the call, as in need_all)
                self.all_at = p
            else:
                self.reached(p)
        k = p & 1
        oj = self._meta_offs[k][j]
        # (ours: this operation's sequence number and the call its publish wrote)
        if self.quads[oj >> 3] != ctx.seq or self.mm[oj + 8 : oj + 48] != self._calls[k]:
            raise self._mismatch(ctx, j, oj, self._rec_off[k])

    def compare(self, ctx: OpContext, p: int, ranks: list[int], earlier: str = "") -> None:
        """Compare the call records of phase ``p`` of ``ranks`` (who reached it) with
        ours: CollectiveMismatchError names the first rank whose call differs
        (``earlier``: the calls are of an operation that has returned, the text that
        says which; the error's ``call`` is then that operation's (name, sequence
        number), which the group reports instead of the running one's)."""
        offs = self._meta_offs[p & 1]
        mm, off = self.mm, offs[self.r]
        mine = mm[off : off + 48]
        for j in ranks:
            oj = offs[j]
            if mm[oj : oj + 48] != mine:
                raise self._mismatch(ctx, j, oj, off, earlier)

    def _mismatch(
        self, ctx: OpContext, j: int, oj: int, off: int, earlier: str = ""
    ) -> CollectiveMismatchError:
        theirs_seq, *theirs = _META.unpack_from(self.mm, oj)
        mine_seq, *mine = _META.unpack_from(self.mm, off)
        theirs_text, mine_text = ctx.describe(*theirs), ctx.describe(*mine)
        if theirs_text == mine_text:  # same call, different position in the sequence
            theirs_text += f" as call #{theirs_seq}"
            mine_text += f" as call #{mine_seq}"
        err = CollectiveMismatchError(
            f"rank {self.group.ranks[j]} called {theirs_text} but rank "
            f"{self.group.runtime.rank} called {mine_text}{earlier}"
        )
        if earlier:
            name = OP_NAMES[mine[0]] if 0 <= mine[0] < len(OP_NAMES) else ctx.name
            setattr(err, "call", (name, mine_seq))  # noqa: B010  (read by ProcessGroup._failed)
        return err

    def last_unchecked(self) -> tuple[str, int] | None:
        """(name, sequence number) of this rank's call of the eager operation whose
        calls no rank of ours compared yet (``unchecked``), or None."""
        q = self.unchecked
        if not q:
            return None
        seq, op = _META.unpack_from(self.mm, self._rec_off[q & 1])[:2]
        return OP_NAMES[op], seq

    def check_unchecked(self, ctx: OpContext) -> None:
        """Compare the calls of the ``unchecked`` eager operation now (the group is
        destroyed: no next operation will): wait, until ``ctx.deadline``, for every
        rank to have published it, then compare (raises as ``need`` and
        :meth:`compare`)."""
        q, self.unchecked = self.unchecked, 0
        if q:
            self.need_all(q, ctx)
            self.compare(ctx, q, self._peers, _LAST)

    def small_all_reduce_plan(self, arr: np.ndarray, op: ReduceOp) -> SmallPlan:
        """The cached :class:`SmallPlan` of a one-phase all_reduce of ``arr``'s dtype and
        size with ``op``, made at the first call (every rank's buffer is read: no view
        to spare; the cache as :meth:`small_plan`'s). Raises CollectiveArgumentError for
        an op the dtype does not support."""
        key = ("all_reduce", arr.dtype, arr.size, -1, op, False, 0, 0)
        plan = self._small.get(key)
        if plan is None:
            plan = self._keep(key, SmallPlan(self, "all_reduce", arr.dtype, arr.size, -1, op, False, 0))
        return plan

    def _keep(self, key: tuple, plan: SmallPlan) -> SmallPlan:
        """Cache ``plan`` under ``key``, the oldest plan going when the cache is full."""
        plans = self._small
        if len(plans) >= _CACHED:
            del plans[next(iter(plans))]
        plans[key] = plan
        return plan

    def small_plan(
        self,
        name: str,
        dtype: np.dtype,
        count: int,
        root: int = -1,
        op: ReduceOp | None = None,
        piece: bool = False,
        *,
        spread: int = 0,
        block: int = 0,
    ) -> SmallPlan | None:
        """The cached :class:`SmallPlan` of a one-phase ``name`` call on ``count``
        elements of ``dtype`` (``root``: a group rank or -1; ``op``: the reduce op or
        None; ``piece``, ``spread``: see SmallPlan, the same for every call of ``name``;
        ``block``: all_to_all's elements per block, ``count`` then its call record's),
        or None the first time such a call is met: the caller then takes the general
        path. A plan costs O(n) to make, so it is made for calls that repeat only (calls
        whose sizes vary, e.g. of pickled objects, never pay for one). Both caches
        are bounded, the oldest entry going first. Raises CollectiveArgumentError for
        an op the dtype does not support (when making the plan)."""
        key = (name, dtype, count, root, op, piece, spread, block)  # (the dtype itself: chars alias)
        plan = self._small.get(key)
        if plan is None:
            seen = self._seen
            if seen.pop(key, True):  # (True: not met before; it is now)
                seen[key] = False
                if len(seen) > _CACHED:
                    del seen[next(iter(seen))]
                return None
            plan = self._keep(key, SmallPlan(self, name, dtype, count, root, op, piece, spread, block))
        return plan

    def close(self) -> None:
        """Unlink the segment once every member has mapped it, and unmap it (unless a
        user-visible view still holds it). A member that has not mapped it yet (an eager
        operation let this rank leave first) maps it later, finds it complete, and
        unlinks it; unlinking it now would leave that member a fresh, empty segment to
        wait in until the timeout."""
        try:
            if self.unlinked or self._mapped_all():
                _unlink(self.path)
        except (ValueError, AttributeError):  # closed before
            pass
        try:
            # drop every export of the mapping; a closed channel has none of these
            del (
                self.bufs,
                self.mine,
                self._views,
                self._small,
                self.raw,
                self.mv,
                self.words,
                self.quads,
            )
            del self._anchor
            self.mm.close()
        except (BufferError, AttributeError):  # AttributeError: closed before
            pass  # a user-visible view still exists: the mapping goes with it


# what a mismatch of calls compared after their operation returned adds (``earlier``)
_BEFORE = " (the call before this one, which left without comparing every rank's)"
_LAST = " (the group's last call, which left without comparing every rank's; compared on destroy)"
_META = struct.Struct("<6q")  # op seq, op, dtype, count, root, redop
_CALL = struct.Struct("<5q")  # the same without the sequence number
call_record = _CALL.pack  # (op, dtype, count, root, redop) -> the packed call record
_Q = struct.Struct("<q")


class SmallPlan:
    """What does not change between one-phase calls of a small operation (all_reduce
    too) with the same name, dtype, element count, root and reduce op, computed once:
    the call record and the ``call`` fields the group's fast path reads (name, op,
    dtype, count, root, redop). Only the buffers this rank touches get views
    (the plan is O(n) to make otherwise): ``views[parity][j]`` (no root, or the root
    of a gather; else empty): rank j's buffer of that phase parity as ``count``
    elements of the dtype, from byte 0, or (``piece``, reduce_scatter) from this rank's
    block, ``r * count`` elements on; ``one[parity]`` (a root; else empty): the one
    buffer the call touches, the root's (broadcast; scatter: from byte ``r * spread``)
    or this rank's (gather); ``mine[parity]`` (``piece`` only): this rank's buffer as
    its n blocks, ``n * count`` elements; ``spreads[parity][i]`` (``spread``, bytes,
    on scatter's root only): this rank's buffer from byte ``i * spread``, ``count``
    elements (the block for rank i); ``blocks`` (no root): the slices of the n blocks
    of a joined buffer; ``uf``/``avg``: the reduction's ufunc and whether AVG divides
    after it (None/False without ``op``).

    all_to_all (``block`` elements per block, ``count`` the call record's: 0 or
    ``block``): every buffer holds its rank's n blocks ``spread`` bytes apart after
    its :data:`HEAD`; ``views[parity][j]``: rank j's block for this rank;
    ``spreads[parity][i]``: this rank's block for rank i; ``mine[parity]``: those n
    as one (n, block) array; ``one[parity]``: the n blocks for this rank, one per rank,
    as one (n, block) array; ``head[parity]``, ``heads[parity]``: the ``quads``
    indices of the head of this rank's buffer, and of the others'; ``longest``: the
    head this rank writes (its block's bytes); ``width``: ``spread``."""

    __slots__ = (
        "name",
        "op",
        "dtype",
        "count",
        "root",
        "redop",
        "record",
        "views",
        "one",
        "mine",
        "spreads",
        "blocks",
        "uf",
        "avg",
        "head",
        "heads",
        "longest",
        "width",
    )

    def __init__(
        self,
        s: ShmChannel,
        name: str,
        dtype: np.dtype,
        count: int,
        root: int,
        op: ReduceOp | None,
        piece: bool,
        spread: int,
        block: int = 0,
    ):
        if op is not None:
            check_op(op, dtype)
        n, r = s.n, s.r
        self.name, self.op, self.dtype, self.count = name, OP_CODES[name], DTYPE_CODES[dtype], count
        self.root, self.redop = root, NO_REDOP if op is None else int(op)
        self.record = _CALL.pack(self.op, self.dtype, count, root, self.redop)
        self.uf = None if op is None else ufunc(op)
        self.avg = op is ReduceOp.AVG
        if block:
            self._blocks(s, dtype, block, spread)
            return
        offset = r * (spread or count * dtype.itemsize) if piece or spread else 0
        every = root < 0 or (name == "gather" and root == r)
        self.views = [[s.view(j, p, dtype, count, offset) for j in range(n)] for p in (0, 1)] if every else []
        j = r if name == "gather" else root
        self.one = [s.view(j, p, dtype, count, offset) for p in (0, 1)] if root >= 0 else []
        self.mine = [s.view(r, p, dtype, n * count) for p in (0, 1)] if piece else []
        self.spreads = (
            [[s.view(r, p, dtype, count, i * spread) for i in range(n)] for p in (0, 1)]
            if spread and root == r
            else []
        )
        self.blocks = [slice(j * count, (j + 1) * count) for j in range(n)] if root < 0 else []

    def _blocks(self, s: ShmChannel, dtype: np.dtype, block: int, spread: int) -> None:
        """all_to_all's views (see the class): blocks side by side after each head."""
        n, r, size = s.n, s.r, dtype.itemsize
        nb = block * size
        self.longest, self.width = nb, spread
        self.views = [[s.view(j, p, dtype, block, HEAD + r * spread) for j in range(n)] for p in (0, 1)]
        self.spreads = [[s.view(r, p, dtype, block, HEAD + i * spread) for i in range(n)] for p in (0, 1)]
        raw = s.raw
        self.mine, self.one = [], []
        for p in (0, 1):
            at = s.data_offset(r, p) + HEAD
            self.mine.append(raw[at : at + n * spread].reshape(n, spread)[:, :nb].view(dtype))
            at = s.data_offset(0, p) + HEAD + r * spread
            step = s.data_offset(1, p) - s.data_offset(0, p) if n > 1 else 0  # (rank to rank)
            rows = as_strided(raw[at:], (n, nb), (step, 1), writeable=False)
            self.one.append(rows.view(dtype))
        self.head = [s.head_index(r, p) for p in (0, 1)]
        self.heads = [[s.head_index(j, p) for j in s._peers] for p in (0, 1)]
        self.blocks = []


def _round(x: int) -> int:
    return (x + 4095) // 4096 * 4096


def _unlink(path: str) -> None:
    """Remove a segment and its verdict (every process has mapped it)."""
    _unlink_data(path)
    _unlink_data(path + _VERDICT)


def _unlink_data(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
