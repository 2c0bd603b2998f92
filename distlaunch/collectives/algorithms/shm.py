"""Collective algorithms on a group's shared-memory channel
(:class:`~distlaunch.collectives.transport.shm.ShmChannel`, ``ctx.shm``): every function
runs one operation of the calling rank.

Algorithms (n ranks, all reductions in the fixed order rank 0, 1, ..., n-1, so every
rank gets bit-identical results):

- all_reduce <= ``config.small`` bytes (256 KiB): one phase -- every rank publishes its buffer, then every
  rank reduces all n buffers itself (one barrier in total);
- all_reduce larger, two ranks: per ``config.chunk`` bytes, one phase -- both publish
  the chunk and both reduce it in place (rank 0's operand first);
- all_reduce larger, more ranks: per ``config.chunk`` bytes, two phases -- publish
  inputs; rank r reduces slice r of the chunk from all inputs into its own buffer
  (reduce-scatter); then every rank
  copies the n reduced slices (all-gather). This is the shared-memory form of
  Rabenseifner's algorithm (Thakur, Rabenseifner & Gropp, IJHPCA 2005);
- reduce: as all_reduce, the root alone copies the result out;
- broadcast / all_gather: the root / every rank publishes slot-sized chunks, readers
  copy them out; the root writes chunk p + 1 while readers copy chunk p;
- reduce_scatter: every rank publishes matching pieces of its n input blocks; rank r
  reduces piece r of every rank directly into its output;
- gather / scatter / all_to_all: the publishers (every rank but the root / the root /
  every rank) publish pieces of their blocks side by side (block i at ``i * L``), each
  reader copies its piece of every publisher straight into its output (no TCP, no
  intermediate copy): one phase per ``L`` bytes of the largest block;
- barrier: the first phase alone.

Every operation whose data fits one phase is eager: its writers (the root of broadcast
and scatter, the non-roots of gather, every rank otherwise) write, publish and go on;
readers wait only for the ranks they read (see :mod:`..transport.shm` for how the calls
are still compared).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..buffers import joined
from ..context import OpContext
from ..ops import ReduceOp, finalize, ufunc
from ..optable import implements
from ..transport.shm import HEAD, ShmChannel, SmallPlan, call_record
from ..transport.shm import PHASE_HALF as _H
from ..transport.shm import PHASE_MASK as _M
from .tcp import block_bounds


@implements("barrier", "shm")
def barrier(ctx: OpContext) -> None:
    """The first phase alone (which compares the ranks' calls)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    s.begin(ctx)


def preamble(ctx: OpContext) -> None:
    """Mismatch check (and barrier) before an operation that runs over TCP."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    s.begin(ctx)


def _reduce_into(uf: np.ufunc, srcs: list[np.ndarray], out: np.ndarray) -> None:
    uf(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        uf(out, s, out=out)


def _writable_phase(s: ShmChannel, ctx: OpContext) -> int:
    """The next phase of a one-phase operation that exchanges every rank's call, once
    this rank's buffer of its parity is free to write (no rank still reads it)."""
    assert s is not None  # (only run on a shared-memory channel)
    p = s.phase + 1
    if (s.all_at - p + 1) & _M >= _H:  # our buffer of this parity may still be read
        s.need_all(p - 1, ctx)
    return p


def small_all_reduce(ctx: OpContext, arr: np.ndarray, plan: SmallPlan) -> None:
    """all_reduce of at most ``config.small`` bytes in one phase (every rank publishes its buffer and
    reduces all n itself), with the constant work done once in ``plan``."""
    s: ShmChannel = ctx.shm
    p = _writable_phase(s, ctx)
    views = plan.views[p & 1]
    views[s.r][...] = arr
    s.exchange_calls(ctx, p, plan.record)
    uf = plan.uf
    assert uf is not None  # (a plan made with the reduce op)
    _reduce_into(uf, views, arr)
    if plan.avg:  # skip the call otherwise: this path is all per-call overhead
        finalize(arr, ReduceOp.AVG, s.n)


def small_broadcast(ctx: OpContext, arr: np.ndarray, plan: SmallPlan) -> None:
    """:func:`broadcast` of ``arr`` (at most a slot) with the constant work done once
    in ``plan``: the same eager phase (the root writes and leaves, the others copy)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    p = s.open(ctx)
    root = plan.root
    if s.r == root:
        plan.one[p & 1][...] = arr
        s.publish(ctx, p, plan.record, False)
    else:
        s.publish(ctx, p, plan.record, s.n <= 2)  # (n = 2: compared with all)
        s.take(ctx, p, root)
        arr[...] = plan.one[p & 1]


def small_all_gather(ctx: OpContext, outs: np.ndarray | list, inp: np.ndarray, plan: SmallPlan) -> None:
    """:func:`all_gather` of ``inp`` (at most a slot) into ``outs`` (n arrays, or one
    of n blocks) with the constant work done once in ``plan``: the same one phase."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    p = s.open(ctx)
    r, views = s.r, plan.views[p & 1]
    views[r][...] = inp
    s.publish(ctx, p, plan.record)
    blocks = plan.blocks if isinstance(outs, np.ndarray) else None
    for j, v in enumerate(views):
        if j != r:
            s.take(ctx, p, j)
        if blocks is None:
            outs[j][...] = v
        else:
            outs[blocks[j]] = v


def small_gather(ctx: OpContext, inp: np.ndarray, outs: list | None, plan: SmallPlan) -> None:
    """The one-slot gather of ``inp`` (into ``outs`` on the root, None elsewhere) with
    the constant work done once in ``plan``: the same eager phase (non-roots write
    and leave, the root copies each rank's as soon as it is there)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    p = s.open(ctx)
    if outs is None:
        plan.one[p & 1][...] = inp
        s.publish(ctx, p, plan.record, False)
        return
    s.publish(ctx, p, plan.record)
    for j, v in enumerate(plan.views[p & 1]):
        if j == s.r:
            outs[j][...] = inp
        else:
            s.take(ctx, p, j)
            outs[j][...] = v


def small_scatter(ctx: OpContext, out: np.ndarray, ins: list | None, plan: SmallPlan) -> None:
    """The one-phase scatter into ``out`` (``ins`` on the root, None elsewhere; blocks
    of at most ``_width(s, n, 0)`` bytes) with the constant work done once in ``plan``
    (made with that ``spread``): the same eager phase (the root writes and leaves)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    p = s.open(ctx)
    if ins is None:
        s.publish(ctx, p, plan.record, s.n <= 2)
        s.take(ctx, p, plan.root)
        out[...] = plan.one[p & 1]
        return
    r = s.r
    for i, (b, v) in enumerate(zip(ins, plan.spreads[p & 1])):
        if i != r:
            v[...] = b
    s.publish(ctx, p, plan.record, False)
    out[...] = ins[r]


def small_reduce_scatter(ctx: OpContext, out: np.ndarray, inp: np.ndarray | list, plan: SmallPlan) -> None:
    """:func:`reduce_scatter` of ``inp`` (n blocks of ``out``'s size, one array or a
    list; at most a slot in all) with the constant work done once in ``plan`` (made
    with ``piece``): the same one phase."""
    s: ShmChannel = ctx.shm
    p = _writable_phase(s, ctx)
    mine = plan.mine[p & 1]
    if isinstance(inp, np.ndarray):
        mine[...] = inp
    else:
        for b, a in zip(plan.blocks, inp):
            mine[b] = a
    s.exchange_calls(ctx, p, plan.record)
    views = plan.views[p & 1]
    uf = plan.uf
    assert uf is not None  # (a plan made with the reduce op)
    if s.n == 1:
        out[...] = views[0]
    else:
        _reduce_into(uf, views, out)
    if plan.avg:
        finalize(out, ReduceOp.AVG, s.n)


def _pair_all_reduce(
    ctx: OpContext, s: ShmChannel, arr: np.ndarray, uf: np.ufunc, root: int | None, chunk: int | None
) -> None:
    """all_reduce (``root`` None) or reduce of two ranks in one phase per chunk: both
    publish the whole chunk and reduce it in place with rank 0's operand first, so the
    results are bit-identical. The same bytes move as in the two-phase form, with half
    the synchronisations: when the ranks share their cores with the caller's compute
    (a DDP backward), every wait for the peer can cost a scheduler slice.

    Run-ahead: a rank's two buffers hold ``2 * sub`` chunks (``sub`` = chunks per slot),
    used as a ring, and a rank publishes chunk m once it has read the peer's chunks up to
    m - ``sub``: it runs ``sub`` chunks ahead of the peer instead of one, so a helper
    thread that gets the core while its peer's is descheduled publishes a whole slot.
    Chunk m's ring slot last held chunk m - 2 * ``sub``, which the peer has read once it
    published chunk m - ``sub`` -- the same wait as for reading the peer's chunk
    m - ``sub``. With ``sub`` > 1 a last phase (no data) says every chunk was read: the
    channel's invariant (publishing phase p: done reading phases < p, data of phase p in
    buffer p % 2) holds again for the next operation."""
    r, dt = s.r, arr.dtype
    per = max(1, min(chunk or s.config.chunk, s.slot) // dt.itemsize)  # elements per chunk
    cb = per * dt.itemsize
    chunks = -(-arr.size // per)
    # (two or fewer chunks: the extra phase would cost more than one chunk of lead)
    sub = max(1, min(s.slot // cb, chunks - 1))
    mine = root is None or root == r
    peer = 1 - r
    p0 = s.phase + 1
    bufs = s.bufs

    def ring(k: int, owner: int) -> np.ndarray:
        """``owner``'s ring slot of chunk k as the chunk's elements."""
        i = k % (2 * sub)
        off = (i % sub) * cb
        n = min(per, arr.size - k * per)
        return bufs[owner][(p0 + i // sub) & 1][off : off + n * dt.itemsize].view(dt)

    for m in range(chunks + sub):
        k = m - sub  # the chunk to reduce before publishing chunk m
        if k >= 0:
            s.need(peer, p0 + k, ctx)
            if mine:
                # the own operand from arr, read by its publish at most a slot ago (still
                # cached; its published copy costs ~40 % more), the output exactly that
                # operand (no overlap hazard)
                seg = arr[k * per : (k + 1) * per]
                if r == 0:
                    uf(seg, ring(k, peer), out=seg)
                else:
                    uf(ring(k, peer), seg, out=seg)
        if m < chunks:
            seg = arr[m * per : (m + 1) * per]
            if m == 0:

                def publish(buf: np.ndarray, seg: np.ndarray = seg) -> None:
                    buf[: seg.nbytes].view(dt)[:] = seg

                s.begin(ctx, publish)  # (compares the calls; phase p0)
            else:
                ring(m, r)[:] = seg
                s.signal(p0 + m)
    if sub > 1:
        s.signal(p0 + chunks)


@implements("all_reduce", "shm")
def all_reduce(
    ctx: OpContext,
    arr: np.ndarray,
    op: ReduceOp,
    root: int | None = None,
    between: Callable[[np.ndarray], None] | None = None,
    chunk: int | None = None,
) -> None:
    """In place on ``arr`` (flat, C-contiguous). ``root``: None for all_reduce, else the
    only group rank whose ``arr`` receives the result (reduce). ``between(slice)``: run
    on this rank's reduced slice of every chunk before the others copy it (hierarchical
    all_reduce: the slice is all-reduced across nodes there); forces the chunked
    algorithm. ``chunk``: bytes per chunk (default ``config.chunk``, at most the slot)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    n, r = s.n, s.r
    dt, nb = arr.dtype, arr.nbytes
    uf = ufunc(op)
    u8 = arr.view(np.uint8)
    if nb <= s.config.small and between is None:
        p = s.begin(ctx, u8)
        if root is None or root == r:
            _reduce_into(uf, s.views(p, dt, arr.size), arr)
    elif n == 2 and between is None:
        _pair_all_reduce(ctx, s, arr, uf, root, chunk)
    else:
        per = max(n, (min(chunk or s.config.chunk, s.slot) // dt.itemsize) // n * n)  # elements per chunk
        for a in range(0, arr.size, per):
            m = min(per, arr.size - a)
            bounds = block_bounds(m, n)
            lo, hi = bounds[r]

            def publish(
                buf: np.ndarray, a: int = a, m: int = m, bounds: list[tuple[int, int]] = bounds
            ) -> None:
                # our own slice never leaves this process: we reduce it ourselves
                dst = buf[: m * dt.itemsize].view(dt)
                for j, (jl, jh) in enumerate(bounds):
                    if j != r:
                        dst[jl:jh] = arr[a + jl : a + jh]

            p1 = s.step(ctx, publish, first=a == 0)
            p2 = p1 + 1
            mine = s.view(r, p2, dt, m)[lo:hi]
            if hi > lo:
                own = arr[a + lo : a + hi]
                srcs = [own if j == r else s.view(j, p1, dt, m)[lo:hi] for j in range(n)]
                # not in place: the own slice is an operand after the output's first write
                _reduce_into(uf, srcs, mine)
                if between is not None:
                    between(mine)
            s.signal(p2)
            s.need_all(p2, ctx)
            if root is None or root == r:
                for j, (jl, jh) in enumerate(bounds):
                    arr[a + jl : a + jh] = s.view(j, p2, dt, m)[jl:jh]
    if root is None or root == r:
        finalize(arr, op, n)


def _record(ctx: OpContext) -> bytes:
    """The packed call record of ``ctx`` (cached on it by the group's fast path)."""
    rec = ctx.record
    if rec is None:
        rec = ctx.record = call_record(ctx.op, ctx.dtype, ctx.count, ctx.root, ctx.redop)
    return rec


def broadcast(ctx: OpContext, u8: np.ndarray, root: int) -> None:
    """``u8``: the buffer as flat uint8 (written on non-roots). Up to one slot: one
    eager phase (the root writes and leaves, every other rank copies; the next
    operation compares the root's call with the others')."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    r = s.r
    nb = len(u8)
    slot = s.slot
    if nb <= slot:
        p = s.open(ctx)
        if r == root:
            if nb:
                s.mine[p & 1][:nb] = u8
            s.publish(ctx, p, ctx.record or _record(ctx), False)
        else:
            s.publish(ctx, p, ctx.record or _record(ctx), s.n <= 2)  # (n = 2: compared with all)
            s.take(ctx, p, root)
            if nb:
                u8[:] = s.bufs[root][p & 1][:nb]
        return
    for i, a in enumerate(range(0, nb, slot)):
        b = min(a + slot, nb)
        if i == 0:
            p = s.begin(ctx, u8[a:b] if r == root else None)
        else:
            p = s.phase + 1
            if r == root:
                s.need_all(p - 1, ctx)
                s.bufs[r][p & 1][: b - a] = u8[a:b]
                s.signal(p)
                continue
            s.signal(p)
            s.need(root, p, ctx)
        if r != root:
            u8[a:b] = s.bufs[root][p & 1][: b - a]


def all_gather(ctx: OpContext, outs: list, inp: np.ndarray) -> None:
    """``outs``: n flat uint8 arrays (equal sizes); ``inp``: this rank's uint8 input.
    Up to one slot: one phase (every rank writes, then copies each rank's as soon as
    it is there)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    n, r = s.n, s.r
    nb = len(inp)
    slot = s.slot
    if nb <= slot:
        p = s.open(ctx)
        k = p & 1
        bufs = s.bufs
        if nb:
            bufs[r][k][:nb] = inp
        s.publish(ctx, p, ctx.record or _record(ctx))
        for j in range(n):
            if j != r:
                s.take(ctx, p, j)
            if nb:
                outs[j][:] = bufs[j][k][:nb]
        return
    for i, a in enumerate(range(0, nb, slot)):
        b = min(a + slot, nb)
        if i == 0:
            p = s.begin(ctx, inp[a:b])
        else:
            p = s.phase + 1
            s.need_all(p - 1, ctx)
            s.bufs[s.r][p & 1][: b - a] = inp[a:b]
            s.signal(p)
            s.need_all(p, ctx)
        for j in range(n):
            outs[j][a:b] = s.bufs[j][p & 1][: b - a]


def reduce_scatter(ctx: OpContext, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> None:
    """``out``: m elements; ``inp``: n*m elements (not modified), both flat."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    n, r = s.n, s.r
    dt, m = out.dtype, out.size
    uf = ufunc(op)
    per = max(1, s.slot // (n * dt.itemsize))
    blocks = inp.reshape(n, m)  # (n, 0) when m == 0: then never read
    for i, a in enumerate(range(0, max(m, 1), per)):
        b = min(a + per, m)
        L = b - a

        def write(
            buf: np.ndarray, a: int = a, b: int = b, L: int = L
        ) -> None:  # pieces [a, b) of the n blocks, contiguous
            if L:
                buf[: n * L * dt.itemsize].view(dt).reshape(n, L)[:] = blocks[:, a:b]

        p = s.step(ctx, write, first=i == 0)
        if L:
            srcs = [s.view(j, p, dt, L, r * L * dt.itemsize) for j in range(n)]
            if n == 1:
                out[a:b] = srcs[0]
            else:
                _reduce_into(uf, srcs, out[a:b])
    finalize(out, op, n)


def _width(s: ShmChannel, width: int, head: int) -> int:
    """Bytes of each of ``width`` blocks side by side in one phase buffer after a
    ``head``: a multiple of 64 (cache lines), at least 64."""
    return max(64, (s.slot - head) // width // 64 * 64)


def _idle(buf: np.ndarray) -> None:
    """A phase's fill with nothing to write."""


def route(ctx: OpContext, ins: list | None, outs: list, width: int, total: int | None) -> None:
    """Move blocks through the publishers' phase buffers. ``ins``: this rank's
    ``width`` flat uint8 blocks (None entries are not published; None: this rank
    publishes nothing); ``outs[j]``: a flat uint8 array receiving this rank's block of
    rank j (None: nothing from j). A publisher puts ``L`` bytes of each block per phase
    at ``i * L``; a reader takes block ``r`` (``width`` n) or block 0 (``width`` 1).
    ``total``: bytes of the largest block (the same on every rank), or None: every
    publisher writes its own into the phase buffer's head and the largest is used
    (all_to_all, whose block sizes only the sender and receiver know)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    r = s.r
    head = HEAD if total is None else 0
    L = _width(s, width, head)
    k = r if width > 1 else 0
    p = a = 0
    end = total or 0
    longest = max((len(b) for b in ins if b is not None), default=0) if head and ins is not None else 0
    while True:

        def fill(buf: np.ndarray, a: int = a) -> None:
            assert ins is not None
            if head:
                s.set_head(s.phase + 1, longest)  # the phase being filled
            for i, blk in enumerate(ins):
                if blk is not None and len(blk) > a:
                    piece = blk[a : a + L]
                    buf[head + i * L : head + i * L + len(piece)] = piece

        if a == 0 and (total is None or total <= L):
            # one eager phase (all_to_all: unless a block is longer): write, publish,
            # take each rank read from (a rank that reads from every other compared
            # every call; else the next operation compares them)
            p = s.open(ctx)
            if ins is not None:
                fill(s.mine[p & 1])
            sources = [j for j, o in enumerate(outs) if o is not None]
            s.publish(ctx, p, _record(ctx), len(sources) >= s.n - 1)
            for j in sources:
                s.take(ctx, p, j)
            if total is None:
                end = max(s.heads(p))
        elif a == 0:
            p = s.begin(ctx, fill if ins is not None else None)
        else:
            p = s.step(ctx, fill if ins is not None else _idle, first=False)
        for j, o in enumerate(outs):
            if o is not None and len(o) > a:
                m = min(L, len(o) - a)
                o[a : a + m] = s.bufs[j][p & 1][head + k * L : head + k * L + m]
        a += L
        if a >= end:
            return


def small_all_to_all(
    ctx: OpContext, outs: np.ndarray | list, ins: np.ndarray | list, plan: SmallPlan
) -> None:
    """all_to_all of blocks of ``plan.longest`` bytes, at most ``plan.width``
    (``ins``/``outs``: n arrays each, or one array of n blocks each: all_to_all_single)
    with the constant work done once in ``plan``: :func:`route`'s eager phase,
    this rank's longest block in its buffer's head as route's writers put it (a rank
    on the general path learns the number of phases from the heads), then, when
    another rank's block is longer than one phase, route's further phases, with
    nothing to move on this rank (its blocks fit the first)."""
    s: ShmChannel = ctx.shm
    assert s is not None  # (only run on a shared-memory channel)
    p = s.open(ctx)
    k, r, q = p & 1, s.r, s.quads
    q[plan.head[k]] = plan.longest
    if isinstance(ins, np.ndarray):
        assert isinstance(outs, np.ndarray)
        plan.mine[k][...] = ins.reshape(s.n, -1)
        s.publish(ctx, p, plan.record)
        for j in range(s.n):
            if j != r:
                s.take(ctx, p, j)
        outs.reshape(s.n, -1)[...] = plan.one[k]  # (this rank's own block came through its buffer)
    else:
        for i, (v, b) in enumerate(zip(plan.spreads[k], ins)):
            if i != r:
                v[...] = b
        s.publish(ctx, p, plan.record)
        outs[r][...] = ins[r]
        for j, v in enumerate(plan.views[k]):
            if j != r:
                s.take(ctx, p, j)
                outs[j][...] = v
    L = plan.width
    # route's further phases, until every rank's longest block has moved (none at n = 1)
    for _ in range(L, max([q[h] for h in plan.heads[k]], default=0), L):
        s.step(ctx, _idle, first=False)


def _u8(arrs: list) -> list:
    return [a.view(np.uint8) for a in arrs]


# --------------------------------------------------------------------- the op table's entries
# (the operations whose arguments the algorithms above take in another form)


@implements("broadcast", "shm")
def _broadcast_op(ctx: OpContext, arr: np.ndarray, root: int) -> None:
    broadcast(ctx, arr.view(np.uint8), root)


@implements("reduce", "shm")
def _reduce_op(ctx: OpContext, arr: np.ndarray, op: ReduceOp, root: int) -> None:
    all_reduce(ctx, arr, op, root)


@implements("all_gather", "shm")
def _all_gather_op(ctx: OpContext, outs: list, inp: np.ndarray) -> None:
    all_gather(ctx, [o.view(np.uint8) for o in outs], inp.view(np.uint8))


@implements("reduce_scatter", "shm")
def _reduce_scatter_op(ctx: OpContext, out: np.ndarray, blocks: np.ndarray | list, op: ReduceOp) -> None:
    reduce_scatter(ctx, out, joined(blocks)[0], op)


@implements("gather", "shm")
def _gather_op(ctx: OpContext, inp: np.ndarray, outs: list | None, root: int) -> None:
    """``outs[i]`` on ``root`` receives rank i's ``inp`` (``outs``: None elsewhere).
    Up to one slot: one eager phase (non-roots write and leave)."""
    u8 = inp.view(np.uint8)
    s: ShmChannel = ctx.shm
    nb = len(u8)
    if nb <= s.slot:
        p = s.open(ctx)
        if outs is None:
            if nb:
                s.mine[p & 1][:nb] = u8
            s.publish(ctx, p, ctx.record or _record(ctx), False)
            return
        s.publish(ctx, p, ctx.record or _record(ctx))
        bufs, k = s.bufs, p & 1
        for j, o in enumerate(outs):
            if j == root:
                o.view(np.uint8)[:] = u8
                continue
            s.take(ctx, p, j)
            if nb:
                o.view(np.uint8)[:] = bufs[j][k][:nb]
        return
    if outs is None:
        route(ctx, [u8], [], 1, len(u8))
        return
    got = _u8(outs)
    got[root][:] = u8
    got[root] = None
    route(ctx, None, got, 1, len(u8))


def all_to_all_width(s: ShmChannel) -> int:
    """Bytes per block in one phase of all_to_all (its one-phase plans' largest)."""
    return _width(s, s.n, HEAD)


def scatter_spread(s: ShmChannel) -> int:
    """Bytes between the blocks of a one-phase scatter in the root's buffer (also the
    largest block it takes)."""
    return _width(s, s.n, 0)


@implements("scatter", "shm")
def _scatter_op(ctx: OpContext, out: np.ndarray, ins: list | None, root: int) -> None:
    """``out`` on rank i receives ``ins[i]`` of ``root`` (``ins``: None elsewhere).
    Blocks up to ``L`` (a slot's n-th): one eager phase (the root writes and leaves)."""
    u8 = out.view(np.uint8)
    s: ShmChannel = ctx.shm
    n, r, nb = s.n, s.r, len(u8)
    L = _width(s, n, 0)
    if nb <= L:
        p = s.open(ctx)
        if ins is None:
            s.publish(ctx, p, ctx.record or _record(ctx), n <= 2)
            s.take(ctx, p, root)
            if nb:
                u8[:] = s.bufs[root][p & 1][r * L : r * L + nb]
            return
        if nb:
            buf = s.mine[p & 1]
            for i, b in enumerate(ins):
                if i != r:
                    buf[i * L : i * L + nb] = b.view(np.uint8)
        s.publish(ctx, p, ctx.record or _record(ctx), False)
        u8[:] = ins[r].view(np.uint8)
        return
    if ins is None:
        route(ctx, None, [u8 if j == root else None for j in range(n)], n, len(u8))
        return
    blocks = _u8(ins)
    u8[:] = blocks[root]
    blocks[root] = None
    route(ctx, blocks, [], n, len(u8))


@implements("all_to_all", "shm")
def _all_to_all_op(ctx: OpContext, outs: list, ins: list) -> None:
    """``ins[i]`` goes to rank i, ``outs[i]`` comes from rank i (one dtype)."""
    r = ctx.shm.r
    src, dst = _u8(ins), _u8(outs)
    dst[r][:] = src[r]
    src[r] = dst[r] = None
    route(ctx, src, dst, ctx.shm.n, None)
