"""The public operations, with torch.distributed's names, argument order and semantics.

Buffers (``tensor``, lists of tensors): numpy arrays of a numeric or bool dtype, torch
CPU tensors, or writable buffers (bytearray, memoryview), C-contiguous; results are
written in place. ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks
inside ``group``. Blocking unless ``async_op=True`` (then a :class:`Work` is returned).
On a rank that is not a member of ``group`` every operation is a no-op returning None
(as in torch).

Blocking: a blocking collective returns when this rank's part is done (its result is in
place and its buffers may be reused); it waits at most the group timeout (or the
``timeout`` of barrier). ``async_op=True`` returns at once; the operations of one group
run in call order on a helper thread.

Every operation raises (documented once here, in this order of checks):

- CollectiveArgumentError -- a bad argument (non-contiguous or read-only buffer, dtype
  outside bool/int/uint/float/complex, reduce op not defined for the dtype, wrong list
  length or element size, rank outside the group); raised locally before anything is
  sent, the group stays usable;
- NotInitializedError -- no init_process_group();
- CollectiveMismatchError -- ranks called it with different op, dtype, element count,
  root or reduce op (detected from the header each TCP message carries, or, on shared
  memory, from the call records all ranks compare in every operation's first phase);
- CollectiveTimeoutError -- not finished within the timeout; names the ranks that did
  not call the operation;
- PeerLostError -- a peer's connection ended, or (shared memory) its process no longer
  exists: the peer died.

The last three leave a collective's group broken: later calls raise the same class at
once. For async operations they are raised by ``Work.wait()``. Algorithms: see
:mod:`.algorithms` (TCP), :mod:`.shm` (ranks of one node) and :mod:`.hierarchy` (groups
spanning nodes); semantics: torch.distributed.
"""

from __future__ import annotations

import time

import numpy as np

from . import algorithms as alg
from . import shm
from .buffers import as_array, as_array_list, byte_view, flat
from .errors import CollectiveArgumentError, CollectiveError, CollectiveMismatchError
from .group import ProcessGroup, SmallCall, Work, _RequestWork, to_seconds
from .ops import ReduceOp, as_reduce_op, check_op
from .runtime import GroupMember, current_runtime
from .wire import DTYPE_CODES, DTYPE_NAMES, NO_REDOP, OP_CODES, P2P, Header


_BARRIER = SmallCall("barrier", OP_CODES["barrier"], 0, 0)


def _group(group) -> ProcessGroup | None:
    """The ProcessGroup to run on, or None when this rank is not a member."""
    rt = current_runtime()
    if group is None or group is GroupMember.WORLD:
        return rt.world
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(group, ProcessGroup):
        if rt.groups.get(group.gid) is not group:
            raise CollectiveArgumentError(f"{group!r} was destroyed or belongs to an earlier initialisation")
        return group
    raise CollectiveArgumentError(f"group must be a ProcessGroup from new_group(), not {group!r}")


def _root(g: ProcessGroup, rank, group_rank, what: str) -> int:
    """Group rank of the root from (global ``rank``, ``group_rank``)."""
    if group_rank is not None:
        if rank is not None and g.group_rank(rank, what) != group_rank:
            raise CollectiveArgumentError(f"{what}={rank} and group_{what}={group_rank} disagree")
        return g.check_group_rank(group_rank, f"group_{what}")
    if rank is None:
        raise CollectiveArgumentError(f"either {what} or group_{what} must be given")
    return g.group_rank(rank, what)


def _same(arrs, ref, what: str, size: int | None = None):
    for i, a in enumerate(arrs):
        if a.dtype != ref.dtype or a.size != (ref.size if size is None else size):
            raise CollectiveArgumentError(
                f"{what}[{i}] has {a.size} x {a.dtype}; expected {ref.size if size is None else size} x {ref.dtype}")


def _meta(arr, count=None, root=-1, redop=None):
    return dict(dtype=DTYPE_CODES[arr.dtype], count=arr.size if count is None else count,
                root=root, redop=redop)


# --------------------------------------------------------------------- point to point

def _p2p_peer(g, rank, group_rank, what):
    peer = _root(g, rank, group_rank, what)
    if peer == g.rank:
        raise CollectiveArgumentError(f"{what}={g.ranks[peer]} is this rank: sending to oneself is not supported")
    return peer


def _check_tag(tag):
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise CollectiveArgumentError(f"tag must be an int, not {tag!r}")
    return tag


def isend(tensor, dst=None, group=None, tag=0, group_dst=None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns a Work (None on a non-member).
    ``tensor`` must not be modified until the Work completes (no copy is made). Completes
    once the data was handed to the operating system."""
    g = _group(group)
    if g is None:
        return None
    arr = as_array(tensor, "tensor", writable=False)
    peer = _p2p_peer(g, dst, group_dst, "dst")
    tag = _check_tag(tag)
    rt = g.runtime
    hdr = Header(P2P, DTYPE_CODES[arr.dtype], OP_CODES["send"], NO_REDOP, rt.rank, g.gid, tag, 0, -1,
                 arr.size, arr.nbytes)
    what = f"send to rank {g.ranks[peer]} (tag {tag}, {arr.size} x {arr.dtype})"
    try:
        req = rt.transport.isend(g.ranks[peer], hdr, byte_view(arr), time.monotonic() + g.timeout, owner=None)
    except CollectiveError as e:
        raise type(e)(f"{what}: {e}") from e

    def done(r, timed_out):
        if timed_out:
            return f"{what} did not complete within the timeout (is rank {g.ranks[peer]} receiving?)"
        if r.error is not None:
            raise type(r.error)(f"{what}: {r.error}")
    return _RequestWork(what, g.timeout, req, done)


def irecv(tensor, src=None, group=None, tag=0, group_src=None) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (None: any source); returns a Work
    whose ``result()`` is the sender's rank (global, or group rank if ``group_src`` was
    given). The sender must send the same dtype and element count
    (CollectiveMismatchError otherwise)."""
    g = _group(group)
    if g is None:
        return None
    arr = as_array(tensor, "tensor")
    peer = None if src is None and group_src is None else _p2p_peer(g, src, group_src, "src")
    tag = _check_tag(tag)
    rt = g.runtime
    dtype = DTYPE_CODES[arr.dtype]
    who = "any rank" if peer is None else f"rank {g.ranks[peer]}"
    what = f"recv from {who} (tag {tag}, {arr.size} x {arr.dtype})"

    def check(h):
        if h.dtype != dtype or h.count != arr.size:
            return CollectiveMismatchError(
                f"rank {h.src} sent {h.count} x {DTYPE_NAMES.get(h.dtype, '?')} (tag {tag}) but rank "
                f"{rt.rank} receives {arr.size} x {arr.dtype}")
        if h.src not in g._index:
            return CollectiveMismatchError(f"rank {h.src} is not in {g.name}")
        return None

    req = rt.transport.irecv(None if peer is None else g.ranks[peer], (P2P, g.gid, tag), byte_view(arr), check)

    def done(r, timed_out):
        if timed_out:
            return f"{what} did not complete within the timeout"
        if r.error is not None:
            raise type(r.error)(f"{what}: {r.error}")
        src_rank = r.header.src
        return g.group_rank(src_rank) if group_src is not None else src_rank
    return _RequestWork(what, g.timeout, req, done)


def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
    """Send ``tensor`` to ``dst`` (blocks until the data is handed to the OS, at most
    the group timeout: CollectiveTimeoutError)."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any source); returns the sender's rank
    (-1 on a non-member). Blocks up to the group timeout (CollectiveTimeoutError, and the
    receive is withdrawn)."""
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    try:
        return work.result()
    except CollectiveError:
        if not work._req.done:
            current_runtime().transport.cancel(work._req)
        raise


# --------------------------------------------------------------------- collectives

def barrier(group=None, async_op=False, device_ids=None, timeout=None):
    """Block until every rank of ``group`` called barrier (dissemination algorithm,
    ceil(log2 n) rounds). ``timeout``: seconds or timedelta for this call only."""
    g = _group(group)
    if g is None:
        return None
    if g._shm is not None and not async_op and timeout is None:
        return g.run_small_shm(_BARRIER, shm.barrier)
    return g.run("barrier", alg.barrier, async_op, dtype=0, count=0, timeout=to_seconds(timeout),
                 shm_body=shm.barrier, hier_body=lambda ctx, h: h.barrier(ctx))


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank (same shape/dtype
    everywhere; the root's buffer may be read-only)."""
    g = _group(group)
    if g is None:
        return None
    root = _root(g, src, group_src, "src")
    arr = flat(as_array(tensor, "tensor", writable=g.rank != root))
    if g._shm is not None and not async_op and arr.nbytes <= shm.SMALL:
        return g.run_small_shm(SmallCall("broadcast", OP_CODES["broadcast"], DTYPE_CODES[arr.dtype], arr.size, root),
                               shm.broadcast, arr.view(np.uint8), root)
    return g.run("broadcast", lambda ctx: alg.broadcast(ctx, arr, root), async_op,
                 shm_body=lambda ctx: shm.broadcast(ctx, arr.view(np.uint8), root),
                 hier_body=lambda ctx, h: h.broadcast(ctx, arr.view(np.uint8), root), **_meta(arr, root=root))


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``tensor`` over all ranks with ``op``; every rank gets the (bit-identical)
    result in ``tensor``."""
    g = _group(group)
    if g is None:
        return None
    arr = flat(as_array(tensor, "tensor"))
    op = as_reduce_op(op)
    s = g._shm
    if s is not None and not async_op and arr.nbytes <= shm.SMALL:
        plan = s.small_all_reduce_plan(arr, op)  # checks op against the dtype once
        return g.run_small_shm(plan, shm.small_all_reduce, arr, plan)
    check_op(op, arr.dtype)
    return g.run("all_reduce", lambda ctx: alg.all_reduce(ctx, arr, op), async_op,
                 shm_body=lambda ctx: shm.all_reduce(ctx, arr, op),
                 hier_body=lambda ctx, h: h.all_reduce(ctx, arr, op), **_meta(arr, redop=op))


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce ``tensor`` over all ranks into ``tensor`` on ``dst``; the other ranks'
    tensors are not modified."""
    g = _group(group)
    if g is None:
        return None
    root = _root(g, dst, group_dst, "dst")
    arr = flat(as_array(tensor, "tensor", writable=g.rank == root))
    op = as_reduce_op(op)
    check_op(op, arr.dtype)
    return g.run("reduce", lambda ctx: alg.reduce(ctx, arr, op, root), async_op,
                 shm_body=lambda ctx: shm.all_reduce(ctx, arr, op, root), **_meta(arr, root=root, redop=op))


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """``tensor_list[i]`` receives rank i's ``tensor`` (n tensors of tensor's size and dtype)."""
    g = _group(group)
    if g is None:
        return None
    inp = flat(as_array(tensor, "tensor", writable=False))
    outs = [flat(a) for a in as_array_list(tensor_list, "tensor_list", g.size)]
    _same(outs, inp, "tensor_list")

    def body(ctx):
        views = [byte_view(o) for o in outs]
        views[g.rank][:] = byte_view(inp)
        alg.all_gather(ctx, views)

    def shm_body(ctx):
        shm.all_gather(ctx, [o.view(np.uint8) for o in outs], inp.view(np.uint8))
    return g.run("all_gather", body, async_op, shm_body=shm_body, **_meta(inp))


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """``output_tensor`` (n x input's elements, same dtype) receives the inputs of ranks
    0..n-1 concatenated."""
    g = _group(group)
    if g is None:
        return None
    inp = flat(as_array(input_tensor, "input_tensor", writable=False))
    out = flat(as_array(output_tensor, "output_tensor"))
    _same([out], inp, "[output_tensor]", size=inp.size * g.size)
    m = inp.size

    def body(ctx):
        views = [byte_view(out[i * m:(i + 1) * m]) for i in range(g.size)]
        views[g.rank][:] = byte_view(inp)
        alg.all_gather(ctx, views)

    def shm_body(ctx):
        u8 = out.view(np.uint8)
        b = inp.nbytes
        shm.all_gather(ctx, [u8[i * b:(i + 1) * b] for i in range(g.size)], inp.view(np.uint8))
    return g.run("all_gather_into_tensor", body, async_op, shm_body=shm_body, **_meta(inp))


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Rank i receives ``scatter_list[i]`` of rank ``src`` in ``tensor``
    (``scatter_list``: n tensors of tensor's size and dtype, only on ``src``)."""
    g = _group(group)
    if g is None:
        return None
    root = _root(g, src, group_src, "src")
    out = flat(as_array(tensor, "tensor"))
    ins = None
    if g.rank == root:
        ins = [flat(a) for a in as_array_list(scatter_list, "scatter_list", g.size, writable=False)]
        _same(ins, out, "scatter_list")

    def body(ctx):
        alg.scatter(ctx, byte_view(out), None if ins is None else [byte_view(a) for a in ins], root)
    return g.run("scatter", body, async_op, **_meta(out, root=root))


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """``gather_list[i]`` on ``dst`` receives rank i's ``tensor`` (``gather_list``: n
    tensors of tensor's size and dtype, only on ``dst``)."""
    g = _group(group)
    if g is None:
        return None
    root = _root(g, dst, group_dst, "dst")
    inp = flat(as_array(tensor, "tensor", writable=False))
    outs = None
    if g.rank == root:
        outs = [flat(a) for a in as_array_list(gather_list, "gather_list", g.size)]
        _same(outs, inp, "gather_list")

    def body(ctx):
        alg.gather(ctx, byte_view(inp), None if outs is None else [byte_view(a) for a in outs], root)
    return g.run("gather", body, async_op, **_meta(inp, root=root))


def _reduce_scatter_run(g, name, out, work, op, async_op, joined):
    op = as_reduce_op(op)
    check_op(op, out.dtype)
    return g.run(name, lambda ctx: alg.reduce_scatter(ctx, out, work(), op), async_op,
                 shm_body=lambda ctx: shm.reduce_scatter(ctx, out, joined(), op), **_meta(out, redop=op))


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """``output`` on rank i receives the reduction over ranks of ``input_list[i]``
    (n tensors of output's size and dtype; inputs are not modified)."""
    g = _group(group)
    if g is None:
        return None
    out = flat(as_array(output, "output"))
    ins = [flat(a) for a in as_array_list(input_list, "input_list", g.size, writable=False)]
    _same(ins, out, "input_list")
    concat = (lambda: np.concatenate(ins) if ins else out.copy())
    return _reduce_scatter_run(g, "reduce_scatter", out, concat, op, async_op, concat)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """``output`` on rank i receives block i (output's size) of the reduction over ranks
    of ``input`` (n x output's elements; not modified)."""
    g = _group(group)
    if g is None:
        return None
    out = flat(as_array(output, "output"))
    inp = flat(as_array(input, "input", writable=False))
    _same([inp], out, "[input]", size=out.size * g.size)
    return _reduce_scatter_run(g, "reduce_scatter_tensor", out, inp.copy, op, async_op, lambda: inp)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """``output_tensor_list[i]`` receives rank i's ``input_tensor_list[r]`` (both lists
    of n tensors of one dtype; sizes may differ per pair but must agree between the
    sender's input and the receiver's output)."""
    g = _group(group)
    if g is None:
        return None
    outs = [flat(a) for a in as_array_list(output_tensor_list, "output_tensor_list", g.size)]
    ins = [flat(a) for a in as_array_list(input_tensor_list, "input_tensor_list", g.size, writable=False)]
    ref = ins[0] if ins else None
    for name, arrs in (("output_tensor_list", outs), ("input_tensor_list", ins)):
        for i, a in enumerate(arrs):
            if a.dtype != ref.dtype:
                raise CollectiveArgumentError(f"{name}[{i}] has dtype {a.dtype}; expected {ref.dtype}")
    if outs[g.rank].size != ins[g.rank].size:
        raise CollectiveArgumentError(f"output_tensor_list[{g.rank}] and input_tensor_list[{g.rank}] differ in size")

    def body(ctx):
        alg.all_to_all(ctx, [byte_view(a) for a in outs], [byte_view(a) for a in ins])
    return g.run("all_to_all", body, async_op, **_meta(ref, count=0))


def _splits(arr, sizes, n, what):
    """Element offsets [(start, end)] of n splits of ``arr`` along its first dimension."""
    rows = arr.shape[0] if arr.ndim else 1
    per_row = arr.size // rows if rows else 0
    if sizes is None:
        if rows % n:
            raise CollectiveArgumentError(f"{what} has {rows} rows, not divisible by the group size {n}")
        sizes = [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise CollectiveArgumentError(f"{what}_split_sizes={sizes} must be {n} sizes summing to {rows}")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start * per_row, (start + s) * per_row))
        start += s
    return bounds


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """Split ``input`` along dim 0 (``input_split_sizes`` rows per rank, default equal),
    send split i to rank i, and concatenate what arrives into ``output`` (split by
    ``output_split_sizes``)."""
    g = _group(group)
    if g is None:
        return None
    out_arr = as_array(output, "output")
    in_arr = as_array(input, "input", writable=False)
    if out_arr.dtype != in_arr.dtype:
        raise CollectiveArgumentError(f"output has dtype {out_arr.dtype} but input has {in_arr.dtype}")
    ob = _splits(out_arr, output_split_sizes, g.size, "output")
    ib = _splits(in_arr, input_split_sizes, g.size, "input")
    out, inp = flat(out_arr), flat(in_arr)

    def body(ctx):
        alg.all_to_all(ctx, [byte_view(out[a:b]) for a, b in ob], [byte_view(inp[a:b]) for a, b in ib])
    return g.run("all_to_all_single", body, async_op, **_meta(inp, count=0))


# torch 2.13 names for the single-tensor variants (the *_tensor names are deprecated there)
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (torch's P2POp):
    ``op`` is :func:`isend` or :func:`irecv`; ``peer`` a global rank (or ``group_peer``
    a rank in ``group``)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        if op not in (isend, irecv):
            raise CollectiveArgumentError(f"P2POp op must be isend or irecv, not {op!r}")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer


def batch_isend_irecv(p2p_op_list) -> list:
    """Start every P2POp of the list (all in flight at once, so any order of sends and
    receives between peers is deadlock-free); returns their Works, in list order."""
    works = []
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise CollectiveArgumentError(f"batch_isend_irecv takes P2POp objects, not {p!r}")
        if p.op is isend:
            works.append(isend(p.tensor, p.peer, p.group, p.tag, p.group_peer))
        else:
            works.append(irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer))
    return works
