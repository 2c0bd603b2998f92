"""Shared-memory collectives for the ranks of a group that share one node.

One segment per group (a file under /dev/shm named ``<DISTLAUNCH_SHM_PREFIX>...``),
created lazily by the group's first collective and unlinked as soon as every member has
mapped it (so nothing is left behind even if a rank dies later). Layout::

    [0, 4096)           header: abort word (reason), aborting rank
    [4096, +n*256)      per rank: u32 phase counter (the futex word), u32 sleep flag
                        (1 + the rank it sleeps on), pid, 2 meta records (op seq,
                        op, dtype, count, root, redop)
    DATA + j*2*SLOT     rank j's two data buffers of SLOT bytes (double buffering)

Synchronisation is one monotonically increasing *phase* counter per rank, written only
by that rank. Invariant: when rank j publishes phase p it has written every datum of
phases <= p and finished reading every datum of phases <= p - 1; data of phase p lives
in buffer ``p % 2``, so a rank writes its buffer for phase p only after every rank
reached p - 1. Every rank runs the same sequence of phases, so phases agree across ranks
(the first phase of every operation is a full barrier that compares every rank's
(op, dtype, count, root, redop): ranks that disagree all raise CollectiveMismatchError
before any data-dependent phase).

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
transport is only enabled on x86-64.

Algorithms (n ranks, all reductions in the fixed order rank 0, 1, ..., n-1, so every
rank gets bit-identical results):

- all_reduce <= SMALL bytes: one phase -- every rank publishes its buffer, then every
  rank reduces all n buffers itself (one barrier in total);
- all_reduce larger: per CHUNK, two phases -- publish inputs; rank r reduces slice r
  of the chunk from all inputs into its own buffer (reduce-scatter); then every rank
  copies the n reduced slices (all-gather). This is the shared-memory form of
  Rabenseifner's algorithm (Thakur, Rabenseifner & Gropp, IJHPCA 2005);
- reduce: as all_reduce, the root alone copies the result out;
- broadcast / all_gather: the root / every rank publishes SLOT-sized chunks, readers
  copy them out; the root writes chunk p + 1 while readers copy chunk p;
- reduce_scatter: every rank publishes matching pieces of its n input blocks; rank r
  reduces piece r of every rank directly into its output;
- barrier: the first phase alone. Other operations (scatter, gather, all_to_all) run
  that barrier phase (mismatch check) and then go over TCP.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
import threading
import time

import numpy as np

from .algorithms import block_bounds
from .errors import CollectiveError, CollectiveMismatchError, PeerLostError
from .ops import _UFUNCS, ReduceOp, check_op, finalize
from .wire import DTYPE_CODES, OP_CODES

SLOT = int(os.environ.get("DISTLAUNCH_SHM_SLOT", 4 << 20))   # bytes per data buffer
# all_reduce: one-phase algorithm up to here (measured: it wins below ~384 KiB at n = 2
# and 4); one buffer must hold it
SMALL = min(256 * 1024, SLOT)
CHUNK = int(os.environ.get("DISTLAUNCH_SHM_CHUNK", 2 << 20))  # all_reduce bytes per chunk
_HDR, _CTL = 4096, 256
_M, _H = 0xFFFFFFFF, 0x80000000
_SLICE = 0.05                # seconds per futex sleep between liveness checks
ABORT_MISMATCH, ABORT_PEER_LOST, ABORT_OTHER = 1, 2, 3

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_futex = None


def _futex_fn():
    global _futex
    if _futex is None:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int]
        _futex = fn
    return _futex


def available() -> bool:
    """True when this platform supports the shared-memory transport (Linux x86-64 with
    /dev/shm) and DISTLAUNCH_SHM is not "0"."""
    return (os.environ.get("DISTLAUNCH_SHM", "1") != "0" and _SYS_FUTEX is not None
            and os.path.isdir("/dev/shm"))


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


class ShmGroup:
    """The shared-memory channel of one ProcessGroup whose members share a node.

    ``name``: segment file name (already carrying DISTLAUNCH_SHM_PREFIX). Created by
    the group's first collective; every method runs inside that group's operations
    (serialised by the group), on the calling or the group's executor thread.
    """

    def __init__(self, group, name: str):
        self.group = group
        self.n, self.r = group.size, group.rank
        self.path = os.path.join("/dev/shm", name)
        self.size = _HDR + _round(self.n * _CTL) + self.n * 2 * SLOT
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self.size:
                os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._unlinked = False
        self.words = memoryview(self.mm).cast("I")
        self.quads = memoryview(self.mm).cast("q")
        self.raw = np.frombuffer(self.mm, np.uint8)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self._futex = _futex_fn()
        self._ts = _Timespec()
        data = _HDR + _round(self.n * _CTL)
        self.bufs = [[self.raw[data + (2 * j + k) * SLOT: data + (2 * j + k + 1) * SLOT] for k in (0, 1)]
                     for j in range(self.n)]
        self._sidx = self._ctl(self.r) // 4
        self._flag_idx = [self._ctl(j) // 4 + 1 for j in range(self.n)]  # rank j sleeps on rank w-1
        self._fence = threading.Lock()
        self._views = {}
        self._plans = {}
        # byte offsets of every rank's two meta records
        self._meta_offs = [[self._ctl(j) + 16 + 64 * k for j in range(self.n)] for k in (0, 1)]
        self._peer_meta_offs = [[(j, o) for j, o in enumerate(offs) if j != self.r] for offs in self._meta_offs]
        self.phase = 0          # last phase this rank published
        self.all_at = 0         # every rank is known to have reached this phase
        self.ops = 0            # operations run (selects the meta record)
        self.quads[self._ctl(self.r) // 8 + 1] = os.getpid()
        self._next_check = 0.0
        spin = os.environ.get("DISTLAUNCH_SHM_SPIN", "")
        self.spin = int(spin) if spin.isdigit() else 400
        # yield while spinning: other processes on the machine (other ranks, other
        # nodes of a loopback job, their progress threads) may need this core
        self.yield_spin = os.environ.get("DISTLAUNCH_SHM_YIELD", "1") != "0"

    # -- layout

    def _ctl(self, j):
        return _HDR + j * _CTL

    def view(self, j, p, dtype, count, offset=0):
        """Rank j's buffer of phase p as ``count`` elements of ``dtype`` from byte
        ``offset``."""
        return self.bufs[j][p & 1][offset:offset + count * dtype.itemsize].view(dtype)

    def views(self, p, dtype, count):
        """Every rank's buffer of phase p as ``count`` x ``dtype`` (cached: small
        operations repeat the same shapes)."""
        key = (p & 1, dtype, count)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 64:
                self._views.clear()
            v = self._views[key] = [self.view(j, p, dtype, count) for j in range(self.n)]
        return v

    # -- synchronisation

    def _wake(self, j):
        self._futex(_SYS_FUTEX, self.base + self._ctl(j), 1, 0x7FFFFFFF, None, None, 0)

    def signal(self, p):
        """Publish phase ``p`` (everything this rank wrote for it is in place); wake the
        ranks sleeping on our counter. Dekker-style: we store the counter, fence, read
        the sleep flags; a sleeper stores its flag and the kernel re-reads the counter
        after a locked instruction, so one of the two sees the other."""
        self.phase = p
        w = self.words
        w[self._sidx] = p & _M
        self._fence.acquire()   # a locked instruction: full memory barrier on x86
        self._fence.release()
        me = self.r + 1
        for i in self._flag_idx:
            if w[i] == me:
                self._wake(self.r)
                return

    def need(self, j, p, ctx):
        """Block until rank j published phase ``p``: spin, then futex sleeps of at most
        50 ms. Raises the group's ``broken`` error (a TCP ABORT arrived), the error an
        aborting peer signalled in the segment (CollectiveMismatchError, PeerLostError,
        CollectiveError), PeerLostError when j's process is gone, and the internal
        _OpTimeout (turned into CollectiveTimeoutError naming the missing ranks by the
        group) past ``ctx.deadline``."""
        idx = self._ctl(j) // 4
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
                w[flag] = j + 1       # before re-reading the counter (see signal)
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

    def need_all(self, p, ctx):
        if (self.all_at - p) & _M < _H:
            return
        for j in range(self.n):
            if j != self.r:
                self.need(j, p, ctx)
        self.all_at = p

    def _check(self, j, ctx) -> float:
        """Raise if the operation cannot complete; else the seconds left."""
        from .group import _OpTimeout
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
            raise _OpTimeout([k for k in range(self.n) if k != self.r
                              and (self.words[self._ctl(k) // 4] - p) & _M >= _H] or [j])
        if now >= self._next_check:
            self._next_check = now + _SLICE
            pid = self.quads[self._ctl(j) // 8 + 1]
            if pid and not _alive(pid):
                raise PeerLostError(f"rank {g.ranks[j]} (pid {pid}) died: its process no longer exists")
        return left

    def _raise_abort(self, reason):
        g = self.group
        end = time.monotonic() + 0.2   # the TCP ABORT carries the full message
        while g.broken is None and time.monotonic() < end:
            time.sleep(0.005)
        if g.broken is not None:
            raise g.broken
        cls = {ABORT_MISMATCH: CollectiveMismatchError, ABORT_PEER_LOST: PeerLostError}.get(reason, CollectiveError)
        err = cls(f"rank {g.ranks[self.words[1] % g.size]} aborted {g.name}")
        err._from_abort = True
        raise err

    def abort(self, reason):
        """Tell every member (blocked or not) that the group failed."""
        try:
            if not self.words[0]:
                self.words[1] = self.r
                self.words[0] = reason
            for j in range(self.n):
                self._wake(j)
        except (ValueError, TypeError):  # already closed
            pass

    # -- operations

    def step(self, ctx, fill, first: bool) -> int:
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

    def begin(self, ctx, data=None) -> int:
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
                self.bufs[self.r][p & 1][:len(data)] = data
        self.exchange_calls(ctx, p, _CALL.pack(ctx.op, ctx.dtype, ctx.count, ctx.root, ctx.redop))
        return p

    def exchange_calls(self, ctx, p, call: bytes):
        """Publish this rank's call record (``ctx.seq`` + ``call``, the packed op, dtype,
        count, root, redop) and phase ``p``, wait for every rank, and compare records:
        CollectiveMismatchError names the first rank whose call differs."""
        k = self.ops & 1
        self.ops += 1
        offs = self._meta_offs[k]
        off = offs[self.r]
        mm = self.mm
        self.quads[off >> 3] = ctx.seq
        mm[off + 8:off + 48] = call
        self.signal(p)
        self.need_all(p, ctx)
        mine = mm[off:off + 48]
        for j, oj in self._peer_meta_offs[k]:
            if mm[oj:oj + 48] != mine:
                theirs = ctx._describe(*_META.unpack_from(mm, oj)[1:6])
                mine_text = ctx._describe(ctx.op, ctx.dtype, ctx.count, ctx.root, ctx.redop)
                if theirs == mine_text:  # same call, different position in the sequence
                    theirs += f" as call #{_META.unpack_from(mm, oj)[0]}"
                    mine_text += f" as call #{ctx.seq}"
                raise CollectiveMismatchError(f"rank {self.group.ranks[j]} called {theirs} but rank "
                                              f"{self.group.runtime.rank} called {mine_text}")
        if not self._unlinked:
            self._unlinked = True  # every member has mapped the segment
            if self.r == 0:
                _unlink(self.path)

    def small_all_reduce_plan(self, arr, op: ReduceOp) -> "SmallAllReduce":
        """The cached SmallAllReduce for ``arr``'s dtype and size and ``op`` (raises
        CollectiveArgumentError for an op the dtype does not support)."""
        key = (arr.dtype.char, arr.size, op)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:
                self._plans.clear()
            plan = self._plans[key] = SmallAllReduce(self, arr, op)
        return plan

    def close(self):
        _unlink(self.path)
        self.bufs = None
        self._views = self._plans = None
        self.raw = None
        self.words = self.quads = None
        try:
            del self._anchor
            self.mm.close()
        except (BufferError, AttributeError):
            pass  # a user-visible view still exists: the mapping goes with it


_META = struct.Struct("<6q")   # op seq, op, dtype, count, root, redop
_CALL = struct.Struct("<5q")   # the same without the sequence number


class SmallAllReduce:
    """Everything about a small all_reduce that does not change between calls with the
    same dtype, element count and op, computed once: the call record, the numpy ufunc,
    and every rank's buffer of both parities viewed as the dtype. Also the ``call`` that
    ProcessGroup.run_small_shm reads (name, op, dtype, count, root, redop)."""

    __slots__ = ("name", "op", "dtype", "count", "root", "redop", "record", "uf", "avg", "views")

    def __init__(self, s, arr, op: ReduceOp):
        check_op(op, arr.dtype)
        self.name, self.op, self.dtype, self.count = "all_reduce", OP_CODES["all_reduce"], DTYPE_CODES[arr.dtype], arr.size
        self.root, self.redop = -1, int(op)
        self.record = _CALL.pack(self.op, self.dtype, self.count, self.root, self.redop)
        self.uf, self.avg = _UFUNCS[op], op is ReduceOp.AVG
        self.views = [[s.view(j, p, arr.dtype, arr.size) for j in range(s.n)] for p in (0, 1)]


def _round(x):
    return (x + 4095) // 4096 * 4096


def _unlink(path):
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise


# --------------------------------------------------------------------- algorithms

def barrier(ctx):
    ctx.shm.begin(ctx)


def preamble(ctx):
    """Mismatch check (and barrier) before an operation that runs over TCP."""
    ctx.shm.begin(ctx)



def _reduce_into(uf, srcs, out):
    uf(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        uf(out, s, out=out)


def small_all_reduce(ctx, arr, plan: SmallAllReduce):
    """all_reduce of at most SMALL bytes in one phase (every rank publishes its buffer and
    reduces all n itself), with the constant work done once in ``plan``."""
    s = ctx.shm
    p = s.phase + 1
    if (s.all_at - p + 1) & _M >= _H:  # our buffer of this parity may still be read
        s.need_all(p - 1, ctx)
    views = plan.views[p & 1]
    views[s.r][:] = arr
    s.exchange_calls(ctx, p, plan.record)
    _reduce_into(plan.uf, views, arr)
    if plan.avg:  # skip the call otherwise: this path is all per-call overhead
        finalize(arr, ReduceOp.AVG, s.n)


def all_reduce(ctx, arr, op, root=None, between=None, chunk=None):
    """In place on ``arr`` (flat, C-contiguous). ``root``: None for all_reduce, else the
    only group rank whose ``arr`` receives the result (reduce). ``between(slice)``: run
    on this rank's reduced slice of every chunk before the others copy it (hierarchical
    all_reduce: the slice is all-reduced across nodes there); forces the chunked
    algorithm. ``chunk``: bytes per chunk (default CHUNK, at most SLOT)."""
    s = ctx.shm
    n, r = s.n, s.r
    dt, nb = arr.dtype, arr.nbytes
    uf = _UFUNCS[op]
    u8 = arr.view(np.uint8)
    if nb <= SMALL and between is None:
        p = s.begin(ctx, u8)
        if root is None or root == r:
            _reduce_into(uf, s.views(p, dt, arr.size), arr)
    else:
        per = max(n, (min(chunk or CHUNK, SLOT) // dt.itemsize) // n * n)  # elements per chunk
        for a in range(0, arr.size, per):
            m = min(per, arr.size - a)
            bounds = block_bounds(m, n)
            lo, hi = bounds[r]

            def publish(buf, a=a, m=m, bounds=bounds):
                # our own slice never leaves this process: we reduce it ourselves
                dst = buf[:m * dt.itemsize].view(dt)
                for j, (jl, jh) in enumerate(bounds):
                    if j != r:
                        dst[jl:jh] = arr[a + jl:a + jh]
            p1 = s.step(ctx, publish, first=a == 0)
            p2 = p1 + 1
            mine = s.view(r, p2, dt, m)[lo:hi]
            if hi > lo:
                own = arr[a + lo:a + hi]
                srcs = [own if j == r else s.view(j, p1, dt, m)[lo:hi] for j in range(n)]
                # not in place: the own slice is an operand after the output's first write
                _reduce_into(uf, srcs, mine)
                if between is not None:
                    between(mine)
            s.signal(p2)
            s.need_all(p2, ctx)
            if root is None or root == r:
                for j, (jl, jh) in enumerate(bounds):
                    arr[a + jl:a + jh] = s.view(j, p2, dt, m)[jl:jh]
    if root is None or root == r:
        finalize(arr, op, n)


def broadcast(ctx, u8, root):
    """``u8``: the buffer as flat uint8 (written on non-roots)."""
    s = ctx.shm
    r = s.r
    nb = len(u8)
    starts = range(0, max(nb, 1), SLOT)
    for i, a in enumerate(starts):
        b = min(a + SLOT, nb)
        if i == 0:
            p = s.begin(ctx, u8[a:b] if r == root else None)
        else:
            p = s.phase + 1
            if r == root:
                s.need_all(p - 1, ctx)
                s.bufs[r][p & 1][:b - a] = u8[a:b]
                s.signal(p)
                continue
            s.signal(p)
            s.need(root, p, ctx)
        if r != root:
            u8[a:b] = s.bufs[root][p & 1][:b - a]


def all_gather(ctx, outs, inp):
    """``outs``: n flat uint8 arrays (equal sizes); ``inp``: this rank's uint8 input."""
    s = ctx.shm
    n = s.n
    nb = len(inp)
    for i, a in enumerate(range(0, max(nb, 1), SLOT)):
        b = min(a + SLOT, nb)
        if i == 0:
            p = s.begin(ctx, inp[a:b])
        else:
            p = s.phase + 1
            s.need_all(p - 1, ctx)
            s.bufs[s.r][p & 1][:b - a] = inp[a:b]
            s.signal(p)
            s.need_all(p, ctx)
        for j in range(n):
            outs[j][a:b] = s.bufs[j][p & 1][:b - a]


def reduce_scatter(ctx, out, inp, op):
    """``out``: m elements; ``inp``: n*m elements (not modified), both flat."""
    s = ctx.shm
    n, r = s.n, s.r
    dt, m = out.dtype, out.size
    uf = _UFUNCS[op]
    per = max(1, SLOT // (n * dt.itemsize))
    blocks = inp.reshape(n, m) if m else None
    for i, a in enumerate(range(0, max(m, 1), per)):
        b = min(a + per, m)
        L = b - a

        def write(buf, a=a, b=b, L=L):  # pieces [a, b) of the n blocks, contiguous
            if L:
                buf[:n * L * dt.itemsize].view(dt).reshape(n, L)[:] = blocks[:, a:b]
        p = s.step(ctx, write, first=i == 0)
        if L:
            srcs = [s.view(j, p, dt, L, r * L * dt.itemsize) for j in range(n)]
            if n == 1:
                out[a:b] = srcs[0]
            else:
                _reduce_into(uf, srcs, out[a:b])
    finalize(out, op, n)
