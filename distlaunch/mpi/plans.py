"""Plans of repeated small buffer collectives. mpi4py programs call one operation with
the same buffers in a loop (the OSU benchmarks, halo exchanges): the first call goes
through the general path of :mod:`.intracomm`, which resolves and checks everything,
and, when the communicator's group runs on shared memory and the call fits one eager
phase, leaves a plan on the communicator's handle. A later call with the same buffer
objects, counts and datatypes runs the plan: the call record, the context, the segment
offsets and this rank's part are computed once, and the call is the eager algorithm of
:mod:`distlaunch.collectives.algorithms.shm` written out for bytes (same phases, same
layout, same call records, so a planned rank and a rank on the general path run one
operation together), as the group's next blocking operation (:meth:`~.ProcessGroup.enter`
and :meth:`~.ProcessGroup.leave` written out in :meth:`Plan.run`: a planned call is
about ten Python calls, each of which costs here what a few dozen bytecodes do).

A plan holds no reference to a buffer (it must not keep a dead buffer alive, nor stop
the program from closing its mmap or resizing its array): it keys on the buffer object's
id, and a call whose buffer has the plan's type, size, count and datatype has its bytes
viewed anew (a memoryview) from the object it passes, or, for small blocks of a bytes,
bytearray or mmap, sliced on the object itself (a weak reference to a receive mmap
tells when it dies: one made at its address may be read-only). A buffer that no longer
fits (a closed mmap, a resized array, a read-only receive buffer) sends the call down
the general path, which says what is wrong.
"""

from __future__ import annotations

import array
import mmap
import os
import struct
import time
import weakref
from typing import Any

import numpy as np

from .. import progress
from ..collectives.algorithms.shm import all_to_all_width, scatter_spread
from ..collectives.context import OpTimeout
from ..collectives.transport.shm import HEAD, POLL
from ..collectives.transport.shm import PHASE_HALF as _H
from ..collectives.transport.shm import PHASE_MASK as _M
from ..collectives.transport.shm_p2p import BUSY, busy_seconds
from .comm import STATE, Handle
from .datatypes import Spec

_monotonic_ns, _started = time.monotonic_ns, progress.started
MAX_PLANS = 16  # per communicator (a program making new buffers per call thrashes, bounded)
_TYPES = (np.ndarray, bytearray, mmap.mmap, bytes, array.array)  # viewed anew per call
_DIRECT = (bytearray, mmap.mmap, bytes)  # byte-indexed: sliced without a view (Buf.direct)
DIRECT_MAX = 4 << 10  # bytes per block: a larger one is read through a view (one copy)
_HEAD = struct.Struct("<q")  # all_to_all: the head of a phase buffer, the longest block
# waiting for a peer: rounds of busy-polling its phase counter (POLL checks, about 50 µs;
# a sched_yield after each, as MPICH's polls before a yield) for the point-to-point
# waiters' busy time (shm_p2p.busy_seconds: DISTLAUNCH_SHM_P2P_BUSY_US, default 100 µs;
# none when the node's ranks have fewer CPUs than they are: a spinner holds the CPU of
# the peer it waits for), then the channel's own wait (a sched_yield per check, futex
# sleeps, failure checks). A peer on another core publishes within microseconds; a
# yield per check hands the core to any runnable process, a scheduler slice under load
_SPIN_S = 50e-6  # seconds per round of POLL checks
SPIN_MAX = 64 << 10  # bytes per block: larger calls wait as the channel does


class Buf:
    """How to view the data bytes of one buffer specification of a planned call:
    ``nb`` bytes from byte ``off`` of an object of type ``tp`` holding ``nbytes``
    bytes, given as ``[obj, *rest]`` (``[obj, count, datatype]``: ``count`` and
    ``datatype`` compared by value, held apart; other forms: ``rest`` compared by
    value) or as the object (``rest`` None)."""

    __slots__ = (
        "tp",
        "rest",
        "three",
        "count",
        "datatype",
        "off",
        "nb",
        "nbytes",
        "cast",
        "write",
        "direct",
        "ref",
    )

    def __init__(self, spec: Any, obj: Any, s: Spec, blocks: int, write: bool) -> None:
        self.tp: Any = type(obj)  # (None once a receive mmap died: see _gone)
        self.rest = spec[1:] if type(spec) is list else None
        # [obj, count, datatype], the common form: its two items compared unpacked
        self.three = self.rest is not None and len(self.rest) == 2
        self.count: Any = spec[1] if self.three else None
        self.datatype: Any = spec[2] if self.three else None
        self.off = s.displ * s.datatype.extent
        self.nb = s.nbytes * blocks
        m = memoryview(obj)
        self.nbytes = m.nbytes
        self.cast = m.format != "B" or m.ndim != 1  # numpy arrays of other dtypes, array('d')
        self.write = write  # this rank writes into it: it must still be writable
        # small blocks of a byte-indexed object (bytes, bytearray, mmap) are sliced on
        # the object itself, without a memoryview per call (its slices copy what they
        # read: a larger block is read through a view); its size is its len, which a
        # closed mmap refuses. An mmap's access never changes, so a receive mmap stays
        # writable while it lives; when it dies, no object matches this Buf any more (one
        # the program makes at its address, the plan's key, may be read-only)
        self.direct = self.tp in _DIRECT and s.nbytes <= DIRECT_MAX
        self.ref = weakref.ref(obj, self._gone) if self.direct and write and self.tp is mmap.mmap else None

    def _gone(self, _: Any) -> None:
        """The weak reference's callback: the receive mmap died (see ``direct``)."""
        self.tp = None

    def view(self, spec: Any) -> Any:
        """The bytes of ``spec``'s whole buffer (the plan's are ``[off, end)`` of it,
        which the phase's copies slice, so no slice is made here): a flat byte
        memoryview, or the object itself when ``direct``; None when ``spec`` is not like
        the one the plan was made from or its buffer cannot give them."""
        if self.three:
            if type(spec) is not list:
                return None
            try:
                spec, c, t = spec
            except ValueError:
                return None
            if c != self.count or t != self.datatype:
                return None
        elif self.rest is not None:
            if type(spec) is not list or spec[1:] != self.rest:
                return None
            spec = spec[0]
        if type(spec) is not self.tp:
            return None
        if self.direct:
            try:
                if len(spec) != self.nbytes:
                    return None
            except ValueError:  # a closed mmap
                return None
            return spec
        try:
            m = memoryview(spec)
            if self.cast:
                m = m.cast("B")
        except (ValueError, TypeError):  # a closed mmap; an array no longer contiguous
            return None
        # (len: the bytes of a flat byte view, and cheaper than its nbytes attribute)
        if len(m) != self.nbytes or (self.write and m.readonly):
            return None
        return m


def buf_of(spec: Any, s: Spec | None, blocks: int = 1, write: bool = False) -> Any:
    """A :class:`Buf` of ``spec`` (parsed as ``s``; None: not used on this rank, so
    None) when it can have one: a contiguous type on a numpy array or a plain buffer
    object that holds ``blocks`` blocks from its displacement; else :data:`NO`."""
    if s is None:
        return None
    obj = spec[0] if type(spec) is list else spec
    if not s.datatype.contiguous or type(obj) not in _TYPES:
        return NO
    try:
        b = Buf(spec, obj, s, blocks, write)
    except (ValueError, TypeError):
        return NO
    v = s.view(s.count * blocks)
    return b if v is not None and len(v) == b.nb and b.off + b.nb <= b.nbytes else NO


NO: Any = object()  # a used buffer that cannot have a Buf


def key(op: str, a: Any, b: Any, root: int) -> tuple:
    """A plan's key: the operation, the buffer objects, the root."""
    return (
        op,
        id(a[0]) if type(a) is list and a else id(a),
        id(b[0]) if type(b) is list and b else id(b),
        root,
    )


class Plan:
    """A repeated small call on ``pg``'s shared-memory channel ``ch``: ``a`` the send
    side's :class:`Buf`, ``b`` the receive side's (None: IN_PLACE, or not used on this
    rank), ``nb`` bytes per block. ``run(a_spec, b_spec)`` runs the call and returns
    True, or returns False (nothing done) when the plan does not apply to them."""

    __slots__ = (
        "eng",
        "pg",
        "ch",
        "ctx",
        "rec",
        "a",
        "b",
        "nb",
        "n",
        "r",
        "root",
        "mine",
        "offs",
        "peers",
        "spin",
        "words",
        "cidx",
        "recs",
        "pw",
        "ex",
        "ao",
        "bo",
    )

    def __init__(self, pg: Any, ctx: Any, a: Buf | None, b: Buf | None, nb: int, root: int) -> None:
        self.eng = STATE.engine
        self.pg, self.ctx, self.ch, self.rec = pg, ctx, ctx.shm, ctx.record
        self.a, self.b, self.nb, self.root = a, b, nb, root
        # where the plan's bytes start in the send and the receive buffer (their views
        # are whole: the phase's copies slice them)
        self.ao, self.bo = a.off if a else 0, b.off if b else 0
        self.n, self.r = pg.size, pg.rank
        # the segment offset of each rank's data buffer, per phase parity
        self.offs = [[self.ch.data_offset(j, k) for j in range(self.n)] for k in (0, 1)]
        self.mine = [offs[self.r] for offs in self.offs]
        self.peers = [j for j in range(self.n) if j != self.r]
        # (peer, word index of its phase counter): the counters open looks at first
        self.words = self.ch.words
        self.cidx = [(j, self.ch.counter_index(j)) for j in self.peers]
        # per phase parity: the offsets of this rank's call record and the others' (open)
        rec = self.ch.record_offset
        self.recs = [(rec(self.r, k), [rec(j, k) for j in self.peers]) for k in (0, 1)]
        self.pw = progress.words()  # the progress record (None: not a distlaunch worker)
        self.ex = pg._executor  # (its pending jobs: the group's enter finishes them first)
        pids = self.ch.pids()
        busy = busy_seconds(pids) if all(pids) else float(self.n <= (os.cpu_count() or 1)) * BUSY
        # rounds of POLL checks; none for large blocks: a peer copying them takes longer
        self.spin = int(busy / _SPIN_S + 0.999) if nb <= SPIN_MAX else 0

    def _takes(self, at: int) -> list:
        """Per parity: (rank j, the block ``at`` bytes into j's buffer, block j of the
        receive buffer) for every other rank j, as the phases' loops read them."""
        nb, b = self.nb, self.bo
        return [[(j, _at(offs[j] + at, nb), _at(b + j * nb, nb)) for j in self.peers] for offs in self.offs]

    def open(self) -> int:
        """Open the operation's one phase (as ShmChannel.open; after the group's enter)
        and return it. A rank that does not read from every other (a broadcast or
        scatter root) finds some peer's reach of the previous phase unknown: it
        busy-polls the peers not there yet (then waits with the channel's checks) and
        compares that phase's calls (``unchecked``): when they agree, here; else the
        channel's settle compares them again and raises."""
        ch = self.ch
        q = ch.phase
        if ch.all_at != q:  # (all_at <= phase: every rank reached q is not known yet)
            w = self.words
            for j, idx in self.cidx:
                if (w[idx] - q) & _M >= _H:
                    if self.spin:
                        _wait(ch, j, q, self.spin)
                    if (w[idx] - q) & _M >= _H:
                        ch.need(j, q, self.ctx)
            if ch.unlinked:  # (reached() without the call, as the channel's need_all)
                ch.all_at = q
            else:
                ch.reached(q)
        u = ch.unchecked
        if u:
            if u == q:
                mm, (o, offs) = ch.mm, self.recs[q & 1]
                mine = mm[o : o + 48]
                for o in offs:
                    if mm[o : o + 48] != mine:
                        break
                else:
                    ch.unchecked = 0
                    return q + 1
            # (the channel's rule: compares q's calls again and raises
            # CollectiveMismatchError; drops an older unchecked phase, which an operation
            # that failed half way left)
            ch.settle(self.ctx, q + 1)
        return q + 1

    def run(self, a: Any, b: Any) -> bool:
        """The call on these buffers (True), or nothing done (False: the plan does not
        apply: another MPI engine (finalized, re-initialised), the group shut down,
        buffers unlike the plan's). Its one phase (``phase``, on the send and receive
        bytes: None for a side without a Buf) runs as the group's next blocking
        operation: :meth:`~.ProcessGroup.enter` and ``leave`` written out (the same
        sequence number, deadline and progress record; the group's own enter when it
        is broken or has asynchronous operations to finish first)."""
        g = self.pg
        if STATE.engine is not self.eng or g.fast_channel is not self.ch:
            return False
        pa, pb = self.a, self.b
        sa = sb = None
        if pa is not None:
            sa = pa.view(a)
            if sa is None:
                return False
        if pb is not None:
            sb = pb.view(b)
            if sb is None:
                return False
        ctx = self.ctx
        if g.broken is not None or self.ex.pending:
            g.enter(ctx)
        else:
            g._current_op = ctx.op
            g.seq = seq = g.seq + 1
            ctx.seq = seq
            t = _monotonic_ns()
            ctx.deadline = t * 1e-9 + ctx.timeout
            _started(ctx.name, seq, t)
        ch = self.ch
        try:
            q = ch.phase  # (open's first test written out: the usual reader's whole open)
            self.phase(q + 1 if ch.all_at == q and not ch.unchecked else self.open(), sa, sb)
        except BaseException as e:
            raise g.fail(ctx, e) from (None if isinstance(e, OpTimeout) else e)
        g.completed = ctx.seq
        pw = self.pw
        if pw is not None:  # (progress.end)
            pw[3] = 0
            pw[1] += 1
        return True

    def phase(self, p: int, src: Any, dst: Any) -> None:
        """The operation's phase ``p`` (opened) on its send and receive bytes."""
        raise NotImplementedError


def _wait(ch: Any, j: int, p: int, rounds: int) -> None:
    """Busy-poll rank j's counter for phase ``p`` in ``rounds`` rounds of POLL checks,
    a sched_yield after each (the caller then waits with the channel's checks)."""
    for _ in range(rounds):
        if ch.poll(j, p, POLL):
            return
        os.sched_yield()


def _at(o: int, nb: int) -> slice:
    """The ``nb`` bytes from byte ``o``: the phases' copies index with slices made
    once per plan (no bound arithmetic, no int objects per call)."""
    return slice(o, o + nb)


class Bcast(Plan):
    """algorithms.shm.broadcast's eager phase: the root writes and leaves; the others
    take the root's buffer (and compare its call)."""

    __slots__ = ("seg", "own")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seg = [_at(offs[self.root], self.nb) for offs in self.offs]  # per parity
        self.own = _at(self.ao, self.nb)

    def phase(self, p: int, src: Any, dst: Any) -> None:
        ch = self.ch
        if self.r == self.root:
            ch.mv[self.seg[p & 1]] = src[self.own]
            ch.publish(self.ctx, p, self.rec, False)
        else:
            ch.publish(self.ctx, p, self.rec, self.n <= 2)  # (n = 2: compared with all)
            ch.take(self.ctx, p, self.root, self.spin)
            src[self.own] = ch.mv[self.seg[p & 1]]


class Gather(Plan):
    """algorithms.shm's gather, one eager phase: the others write and leave; the root
    takes each rank's block into its receive buffer (``a`` None: IN_PLACE)."""

    __slots__ = ("seg", "own", "into", "takes")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        nb, b = self.nb, self.bo
        self.seg = [_at(o, nb) for o in self.mine]  # (this rank's block, per parity)
        self.own = _at(self.ao, nb)
        self.into = _at(b + self.r * nb, nb)  # (this rank's own block in the receive buffer)
        self.takes = self._takes(0)

    def phase(self, p: int, src: Any, dst: Any) -> None:
        ch, ctx = self.ch, self.ctx
        if self.r != self.root:
            ch.mv[self.seg[p & 1]] = src[self.own]
            ch.publish(ctx, p, self.rec, False)
        else:
            ch.publish(ctx, p, self.rec)
            if src is not None:  # (while the others write theirs)
                dst[self.into] = src[self.own]
            mv, spin = ch.mv, self.spin
            for j, seg, into in self.takes[p & 1]:
                ch.take(ctx, p, j, spin)
                dst[into] = mv[seg]


class Scatter(Plan):
    """algorithms.shm's scatter, one eager phase: the root writes block i at ``i * L``
    of its buffer and leaves; rank i takes its block (``b`` None: the root's IN_PLACE)."""

    __slots__ = ("width", "puts", "own", "into", "seg")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        L = self.width = scatter_spread(self.ch)
        nb, a, r = self.nb, self.ao, self.r
        # the root, per parity: (block i in its segment, block i of its send buffer)
        self.puts = [[(_at(o + i * L, nb), _at(a + i * nb, nb)) for i in self.peers] for o in self.mine]
        self.own = _at(a + r * nb, nb)  # (the root's own block, kept when not IN_PLACE)
        self.into = _at(self.bo, nb)
        self.seg = [_at(offs[self.root] + r * L, nb) for offs in self.offs]  # (a non-root's)

    def phase(self, p: int, src: Any, dst: Any) -> None:
        ch = self.ch
        if self.r == self.root:
            mv = ch.mv
            for seg, blk in self.puts[p & 1]:
                mv[seg] = src[blk]
            ch.publish(self.ctx, p, self.rec, False)
            if dst is not None:
                dst[self.into] = src[self.own]
        else:
            ch.publish(self.ctx, p, self.rec, self.n <= 2)
            ch.take(self.ctx, p, self.root, self.spin)
            dst[self.into] = ch.mv[self.seg[p & 1]]


class Allgather(Gather):
    """algorithms.shm.all_gather's eager phase: every rank writes its block, then takes
    every other rank's (``a`` None: IN_PLACE, its block is in the receive buffer), with
    Gather's slices: every rank is a gather's root, and writes as its other ranks do."""

    __slots__ = ()

    def phase(self, p: int, src: Any, dst: Any) -> None:
        ch, ctx, mv, spin = self.ch, self.ctx, self.ch.mv, self.spin
        own = dst[self.into] if src is None else src[self.own]
        mv[self.seg[p & 1]] = own
        ch.publish(ctx, p, self.rec)
        if src is not None:  # (while the others write theirs)
            dst[self.into] = own
        for j, seg, into in self.takes[p & 1]:
            ch.take(ctx, p, j, spin)
            dst[into] = mv[seg]


class Alltoall(Plan):
    """algorithms.shm.route's eager phase for all_to_all: every rank writes its longest
    block (every block: ``nb``) at the head of its buffer (read by a rank on the general
    path) and block i at ``head + i * L``, then takes block r of every other rank; its
    own block is copied directly. The call record's count is ``nb`` (as the general
    path's): a rank sending another block size runs a different call, which
    :meth:`~.ShmChannel.take` finds (CollectiveMismatchError)."""

    __slots__ = ("width", "head", "heads", "puts", "own", "into", "takes")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        L = self.width = all_to_all_width(self.ch)
        self.head = _HEAD.pack(self.nb)
        nb, a, b, r = self.nb, self.ao, self.bo, self.r
        self.heads = [_at(o, 8) for o in self.mine]
        # per parity: (block i in this rank's segment, block i of the send buffer)
        self.puts = [
            [(_at(o + HEAD + i * L, nb), _at(a + i * nb, nb)) for i in self.peers] for o in self.mine
        ]
        self.own, self.into = _at(a + r * nb, nb), _at(b + r * nb, nb)
        self.takes = self._takes(HEAD + r * L)  # (block r of each rank's buffer)

    def phase(self, p: int, src: Any, dst: Any) -> None:
        ch, ctx, mv, spin = self.ch, self.ctx, self.ch.mv, self.spin
        k = p & 1
        mv[self.heads[k]] = self.head
        for seg, blk in self.puts[k]:
            mv[seg] = src[blk]
        ch.publish(ctx, p, self.rec)
        dst[self.into] = src[self.own]  # (while the others write)
        for j, seg, into in self.takes[k]:
            ch.take(ctx, p, j, spin)
            dst[into] = mv[seg]


# operation -> (plan class, the largest eager block in bytes for a channel of n ranks)
KINDS = {
    "broadcast": (Bcast, lambda ch, n: ch.slot),
    "gather": (Gather, lambda ch, n: ch.slot),
    "scatter": (Scatter, lambda ch, n: scatter_spread(ch)),
    "all_gather": (Allgather, lambda ch, n: ch.slot),
    "all_to_all": (Alltoall, lambda ch, n: all_to_all_width(ch)),
}


def keep(h: Handle, pg: Any, op: str, k: tuple, count: int, root: int, a: Any, b: Any, nb: int) -> None:
    """Keep a plan for repeating this call (it just ran through the general path, which
    checked everything) when its group has the shared-memory fast path and a block of
    ``nb`` bytes fits one eager phase. ``k``: its :func:`key`; ``count``: the element
    count of the call record (as the general path's); ``a``, ``b``: :func:`buf_of`."""
    if a is NO or b is NO:
        return
    ctx = pg.small_context(op, count, root)
    if ctx is None:
        return
    cls, most = KINDS[op]
    if nb > most(ctx.shm, pg.size):
        return  # several phases: what plans save is per-call overhead
    plans = h.plans
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[k] = cls(pg, ctx, a, b, nb, root)
