"""Collective algorithms over TCP messages, written against
:class:`~distlaunch.collectives.context.OpContext` (post send/recv of byte views to
group ranks, wait). All buffers here are flat (1-D) C-contiguous numpy
arrays; ``r`` is this rank's group rank and ``n`` the group size.

Choice (thresholds in bytes of the buffer, see ``RING_THRESHOLD``/``CHAIN_THRESHOLD``):

- broadcast: binomial tree below CHAIN_THRESHOLD (log2 n steps); above, a pipelined
  chain root -> root+1 -> ... in PIECE-sized pieces (time ~ (n - 2 + pieces) x piece).
- reduce: binomial tree below RING_THRESHOLD; above, ring reduce-scatter then every
  rank sends its reduced block to the root (Rabenseifner's reduce).
- all_reduce: recursive doubling below RING_THRESHOLD (log2 n steps, with the
  "extra ranks fold into a partner first" handling of non-powers of two); above,
  ring reduce-scatter + ring all-gather (2(n-1) steps, each rank sends 2(n-1)/n of the
  buffer), with the incoming block split into PIECEs so that reducing one piece overlaps
  receiving the next, and every receive posted before the data can arrive. Both:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective
  Communication Operations in MPICH" (IJHPCA 2005).
- all_gather: Bruck below RING_THRESHOLD bytes of output, ring above;
  reduce_scatter: ring; barrier: dissemination (Hensgen, Finkel & Manber 1988);
  scatter, gather, all_to_all: direct (linear) exchange, all messages in flight at once.

Determinism: every reduced element is computed by exactly one sequence of ufunc calls
whose operand order depends only on ranks (the contribution of the lower-ranked side, or
the partial arriving along the ring, always comes first), and the result is then copied
to the others, so every rank gets bit-identical floats.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..buffers import byte_view, joined
from ..context import OpContext
from ..ops import ReduceOp, combine, finalize
from ..optable import implements
from ..transport import Request

RING_THRESHOLD = 64 * 1024
CHAIN_THRESHOLD = 256 * 1024
PIECE = 512 * 1024
_EMPTY = memoryview(b"")


def _step(phase: int, piece: int = 0) -> int:
    # message id checked by the receiver: which ring step / piece this is
    return (phase << 16) | piece


def block_bounds(count: int, n: int) -> list:
    """Split ``count`` elements into ``n`` contiguous blocks (the first ``count % n``
    one element larger); returns [(start, end)] in elements."""
    base, extra = divmod(count, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _pieces(length: int, unit: int) -> list:
    """[(start, end)] covering ``length`` units in pieces of about PIECE bytes."""
    per = max(1, PIECE // max(unit, 1))
    return [(a, min(a + per, length)) for a in range(0, length, per)] or [(0, 0)]


# --------------------------------------------------------------------- barrier


@implements("barrier", "tcp")
def barrier(ctx: OpContext) -> None:
    """Dissemination barrier: in round k, send to r + 2^k and receive from r - 2^k."""
    n, r = ctx.group.size, ctx.group.rank
    k, rnd = 1, 0
    while k < n:
        ctx.wait(ctx.recv((r - k) % n, memoryview(bytearray(0)), rnd), ctx.send((r + k) % n, _EMPTY, rnd))
        k <<= 1
        rnd += 1


# --------------------------------------------------------------------- broadcast


@implements("broadcast", "tcp")
def broadcast(ctx: OpContext, buf: np.ndarray, root: int) -> None:
    n = ctx.group.size
    if n == 1:
        return
    mv = byte_view(buf)
    if len(mv) < CHAIN_THRESHOLD:
        _binomial_broadcast(ctx, mv, root)
    else:
        _chain_broadcast(ctx, mv, root)


def _binomial_broadcast(ctx: OpContext, mv: memoryview, root: int) -> None:
    n, r = ctx.group.size, ctx.group.rank
    vr = (r - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            ctx.wait(ctx.recv((vr - mask + root) % n, mv))
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if vr + mask < n:
            sends.append(ctx.send((vr + mask + root) % n, mv))
        mask >>= 1
    ctx.wait(*sends)


def _chain_broadcast(ctx: OpContext, mv: memoryview, root: int) -> None:
    n, r = ctx.group.size, ctx.group.rank
    vr = (r - root) % n
    pieces = _pieces(len(mv), 1)
    nxt, sends = (r + 1) % n, []
    if vr == 0:
        sends = [ctx.send(nxt, mv[a:b], i) for i, (a, b) in enumerate(pieces)]
    else:
        # all receives posted up front: every piece lands directly in the user's buffer
        recvs = [ctx.recv((r - 1) % n, mv[a:b], i) for i, (a, b) in enumerate(pieces)]
        for i, ((a, b), req) in enumerate(zip(pieces, recvs)):
            ctx.wait(req)
            if vr != n - 1:
                sends.append(ctx.send(nxt, mv[a:b], i))
    ctx.wait(*sends)


# --------------------------------------------------------------------- ring building blocks


def ring_reduce_scatter(
    ctx: OpContext,
    work: np.ndarray,
    bounds: list,
    op: ReduceOp,
    phase0: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> None:
    """In place on ``work``: afterwards block ``bounds[r]`` of ``work`` holds the
    reduction of that block over all ranks (other blocks hold partial results).

    Step s (0..n-2): send block r-s-1 to the right neighbour, receive block r-s-2 from
    the left one and reduce it (received partial first). The receives of all steps are
    posted up front, each into its own scratch block (n-1 blocks of scratch), so data
    lands directly where it is reduced even when the left neighbour runs steps ahead.
    ``after_step(s)`` runs once step s finished (its send completed).
    """
    n, r = ctx.group.size, ctx.group.rank
    left, right = (r - 1) % n, (r + 1) % n
    biggest = max(b - a for a, b in bounds)
    scratch = np.empty((n - 1) * biggest, work.dtype)
    unit = work.itemsize
    recvs = []
    for s in range(n - 1):
        a, b = bounds[(r - s - 2) % n]
        sb = scratch[s * biggest : s * biggest + (b - a)]
        recvs.append(
            [
                (pa, pb, sb, ctx.recv(left, byte_view(sb[pa:pb]), _step(phase0 + s, i)))
                for i, (pa, pb) in enumerate(_pieces(b - a, unit))
            ]
        )
    for s in range(n - 1):
        a, b = bounds[(r - s - 1) % n]
        sends = [
            ctx.send(right, byte_view(work[a + pa : a + pb]), _step(phase0 + s, i))
            for i, (pa, pb) in enumerate(_pieces(b - a, unit))
        ]
        a, _ = bounds[(r - s - 2) % n]
        for pa, pb, sb, req in recvs[s]:
            ctx.wait(req)
            target = work[a + pa : a + pb]
            combine(sb[pa:pb], target, target, op)
        ctx.wait(*sends)
        if after_step is not None:
            after_step(s)


def _all_gather_recv(ctx: OpContext, views: list[memoryview], t: int, phase0: int) -> Request:
    n, r = ctx.group.size, ctx.group.rank
    return ctx.recv((r - 1) % n, views[(r - t - 1) % n], _step(phase0 + t))


def ring_all_gather(ctx: OpContext, views: list, phase0: int = 0, recvs: list | None = None) -> None:
    """``views[i]`` (byte memoryviews, one per group rank) hold rank i's block on rank i;
    afterwards every rank has every block. Step t: send block r-t right, receive block
    r-t-1 from the left directly into its place (all receives posted up front -- or
    already posted by the caller: ``recvs`` -- and a block is forwarded as soon as it
    arrived)."""
    n, r = ctx.group.size, ctx.group.rank
    right = (r + 1) % n
    recvs = list(recvs or [])
    recvs += [_all_gather_recv(ctx, views, t, phase0) for t in range(len(recvs), n - 1)]
    sends = []
    for t in range(n - 1):
        if t:
            ctx.wait(recvs[t - 1])
        sends.append(ctx.send(right, views[(r - t) % n], _step(phase0 + t)))
    ctx.wait(*recvs, *sends)


# --------------------------------------------------------------------- reductions


@implements("all_reduce", "tcp")
def all_reduce(ctx: OpContext, buf: np.ndarray, op: ReduceOp) -> None:
    n = ctx.group.size
    if n > 1:
        if buf.nbytes < RING_THRESHOLD or buf.size < n:
            _recursive_doubling(ctx, buf, op)
        else:
            bounds = block_bounds(buf.size, n)
            views = [byte_view(buf[a:b]) for a, b in bounds]
            # block r-s-1 is final on this rank once reduce-scatter step s sent it: the
            # all-gather may receive into it from then on
            early = []
            ring_reduce_scatter(
                ctx, buf, bounds, op, after_step=lambda s: early.append(_all_gather_recv(ctx, views, s, n))
            )
            ring_all_gather(ctx, views, phase0=n, recvs=early)
    finalize(buf, op, n)


def _recursive_doubling(ctx: OpContext, buf: np.ndarray, op: ReduceOp) -> None:
    n, r = ctx.group.size, ctx.group.rank
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    mv, tmp = byte_view(buf), np.empty_like(buf)
    tmv = byte_view(tmp)
    # fold: the first 2*rem ranks pair up, even ones hand their data to the odd partner
    if r < 2 * rem:
        if r % 2 == 0:
            ctx.wait(ctx.send(r + 1, mv, 0))
            newrank = -1
        else:
            ctx.wait(ctx.recv(r - 1, tmv, 0))
            combine(tmp, buf, buf, op)  # lower rank's data first
            newrank = r // 2
    else:
        newrank = r - rem
    if newrank >= 0:
        mask, rnd = 1, 1
        while mask < p2:
            vpeer = newrank ^ mask
            peer = vpeer * 2 + 1 if vpeer < rem else vpeer + rem
            ctx.wait(ctx.recv(peer, tmv, rnd), ctx.send(peer, mv, rnd))
            if peer < r:
                combine(tmp, buf, buf, op)
            else:
                combine(buf, tmp, buf, op)
            mask <<= 1
            rnd += 1
    # unfold: odd partners return the result
    if r < 2 * rem:
        if r % 2 == 1:
            ctx.wait(ctx.send(r - 1, mv, 1 << 20))
        else:
            ctx.wait(ctx.recv(r + 1, mv, 1 << 20))


@implements("reduce", "tcp")
def reduce(ctx: OpContext, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    """Result in ``buf`` on ``root``; other ranks' ``buf`` is left unchanged."""
    n, r = ctx.group.size, ctx.group.rank
    if n > 1:
        if buf.nbytes < RING_THRESHOLD or buf.size < n:
            _binomial_reduce(ctx, buf, op, root)
        else:
            work = buf if r == root else buf.copy()
            bounds = block_bounds(buf.size, n)
            ring_reduce_scatter(ctx, work, bounds, op)
            if r == root:
                ctx.wait(
                    *[ctx.recv(i, byte_view(buf[a:b]), _step(n)) for i, (a, b) in enumerate(bounds) if i != r]
                )
            else:
                a, b = bounds[r]
                ctx.wait(ctx.send(root, byte_view(work[a:b]), _step(n)))
    if r == root:
        finalize(buf, op, n)


def _binomial_reduce(ctx: OpContext, buf: np.ndarray, op: ReduceOp, root: int) -> None:
    n, r = ctx.group.size, ctx.group.rank
    vr = (r - root) % n
    acc = buf if vr == 0 else None  # non-roots accumulate in a copy: their input stays intact
    tmp = np.empty_like(buf)
    mask = 1
    while mask < n:
        if vr & mask:
            ctx.wait(ctx.send((vr - mask + root) % n, byte_view(buf if acc is None else acc)))
            return
        if vr | mask < n:
            ctx.wait(ctx.recv(((vr | mask) + root) % n, byte_view(tmp)))
            if acc is None:
                acc = buf.copy()
            combine(acc, tmp, acc, op)  # acc covers the lower relative ranks
        mask <<= 1


def reduce_scatter(ctx: OpContext, out: np.ndarray, work: np.ndarray, op: ReduceOp) -> None:
    """``work``: a scratch copy of the concatenated inputs (n equal blocks of
    ``out.size``); ``out`` receives block r of the reduction."""
    n, r = ctx.group.size, ctx.group.rank
    m = out.size
    bounds = [(i * m, (i + 1) * m) for i in range(n)]
    if n > 1:
        ring_reduce_scatter(ctx, work, bounds, op)
    out[:] = work[r * m : (r + 1) * m]
    finalize(out, op, n)


# --------------------------------------------------------------------- data movement


def all_gather(ctx: OpContext, views: list) -> None:
    """``views``: byte views of the n (equal-sized) output blocks; block r already holds
    our input. Bruck's algorithm below RING_THRESHOLD bytes in total (ceil(log2 n)
    steps), the ring above (n-1 steps, bandwidth-optimal)."""
    n = ctx.group.size
    if n > 2 and len(views[0]) * n < RING_THRESHOLD:
        _bruck_all_gather(ctx, views)
    elif n > 1:
        ring_all_gather(ctx, views)


def _bruck_all_gather(ctx: OpContext, views: list[memoryview]) -> None:
    """Bruck et al., "Efficient algorithms for all-to-all communications in multiport
    message-passing systems" (IEEE TPDS 1997): a scratch buffer holds the blocks of ranks
    r, r+1, ...; in step k (k = 1, 2, 4, ...) send the first min(k, n - have) blocks to
    rank r-k and append those of rank r+k; finally rotate into place."""
    n, r = ctx.group.size, ctx.group.rank
    b = len(views[0])
    tmp = memoryview(bytearray(n * b))
    tmp[:b] = views[r]
    have, k, step = 1, 1, 0
    while have < n:
        cnt = min(k, n - have)
        ctx.wait(
            ctx.recv((r + k) % n, tmp[have * b : (have + cnt) * b], step),
            ctx.send((r - k) % n, tmp[: cnt * b], step),
        )
        have += cnt
        k <<= 1
        step += 1
    for j in range(1, n):
        views[(r + j) % n][:] = tmp[j * b : (j + 1) * b]


def scatter(ctx: OpContext, out_mv: memoryview, in_mvs: list | None, root: int) -> None:
    r = ctx.group.rank
    if r == root:
        assert in_mvs is not None  # (given on the root)
        sends = [ctx.send(i, mv) for i, mv in enumerate(in_mvs) if i != r]
        out_mv[:] = in_mvs[r]
        ctx.wait(*sends)
    else:
        ctx.wait(ctx.recv(root, out_mv))


def gather(ctx: OpContext, in_mv: memoryview, out_mvs: list | None, root: int) -> None:
    r = ctx.group.rank
    if r == root:
        assert out_mvs is not None  # (given on the root)
        recvs = [ctx.recv(i, mv) for i, mv in enumerate(out_mvs) if i != r]
        out_mvs[r][:] = in_mv
        ctx.wait(*recvs)
    else:
        ctx.wait(ctx.send(root, in_mv))


def all_to_all(ctx: OpContext, out_mvs: list, in_mvs: list) -> None:
    """Block i of ``in_mvs`` goes to rank i, block i of ``out_mvs`` comes from rank i."""
    n, r = ctx.group.size, ctx.group.rank
    recvs = [ctx.recv(i, out_mvs[i]) for i in range(n) if i != r]
    # start with the right-hand neighbour so not every rank sends to rank 0 first
    sends = [ctx.send((r + k) % n, in_mvs[(r + k) % n]) for k in range(1, n)]
    out_mvs[r][:] = in_mvs[r]
    ctx.wait(*recvs, *sends)


# --------------------------------------------------------------------- the op table's entries
# (the operations whose arguments the algorithms above take in another form)


@implements("all_gather", "tcp")
def _all_gather_op(ctx: OpContext, outs: list, inp: np.ndarray) -> None:
    """``outs``: n arrays of ``inp``'s size and dtype; ``outs[i]`` receives rank i's
    ``inp`` (not modified)."""
    views = [byte_view(o) for o in outs]
    views[ctx.group.rank][:] = byte_view(inp)
    all_gather(ctx, views)


@implements("reduce_scatter", "tcp")
def _reduce_scatter_op(ctx: OpContext, out: np.ndarray, blocks: np.ndarray | list, op: ReduceOp) -> None:
    """``blocks``: n arrays (or one array of n blocks) of ``out``'s size, not modified;
    ``out`` receives block r of their reduction over the ranks."""
    work, fresh = joined(blocks)
    reduce_scatter(ctx, out, work if fresh else work.copy(), op)


@implements("scatter", "tcp")
def _scatter_op(ctx: OpContext, out: np.ndarray, ins: list | None, root: int) -> None:
    """``out`` on rank i receives ``ins[i]`` of ``root`` (``ins``: None elsewhere)."""
    scatter(ctx, byte_view(out), None if ins is None else [byte_view(a) for a in ins], root)


@implements("gather", "tcp")
def _gather_op(ctx: OpContext, inp: np.ndarray, outs: list | None, root: int) -> None:
    """``outs[i]`` on ``root`` receives rank i's ``inp`` (``outs``: None elsewhere)."""
    gather(ctx, byte_view(inp), None if outs is None else [byte_view(a) for a in outs], root)


@implements("all_to_all", "tcp")
def _all_to_all_op(ctx: OpContext, outs: list, ins: list) -> None:
    """``ins[i]`` goes to rank i, ``outs[i]`` comes from rank i (one dtype)."""
    all_to_all(ctx, [byte_view(a) for a in outs], [byte_view(a) for a in ins])
