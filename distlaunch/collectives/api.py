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
:mod:`.algorithms.tcp` (TCP), :mod:`.algorithms.shm` (ranks of one node) and
:mod:`.algorithms.hierarchy` (groups spanning nodes); semantics: torch.distributed.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

from .buffers import as_array, as_array_list, check_same, flat, split_bounds
from .context import to_seconds
from .errors import CollectiveArgumentError
from .group import ProcessGroup
from .ops import ReduceOp, as_reduce_op
from .runtime import GroupMember, current_runtime
from .work import Work

# a buffer: numpy array, torch CPU tensor, or writable object exporting a buffer
Buffer = Any
Group = Any  # a ProcessGroup, GroupMember.WORLD / NON_GROUP_MEMBER, or None (the world)
Timeout = float | datetime.timedelta | None


def resolve_group(group: Group) -> ProcessGroup | None:
    """The ProcessGroup to run on, or None when this rank is not a member. Raises
    NotInitializedError, or CollectiveArgumentError for a destroyed or foreign group."""
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


def root_of(g: ProcessGroup, rank: int | None, group_rank: int | None, what: str) -> int:
    """Group rank of the root from (global ``rank``, ``group_rank``); CollectiveArgumentError
    when neither is given, they disagree, or the rank is not in ``g``."""
    if group_rank is not None:
        if rank is not None and g.group_rank(rank, what) != group_rank:
            raise CollectiveArgumentError(f"{what}={rank} and group_{what}={group_rank} disagree")
        return g.check_group_rank(group_rank, f"group_{what}")
    if rank is None:
        raise CollectiveArgumentError(f"either {what} or group_{what} must be given")
    return g.group_rank(rank, what)


# --------------------------------------------------------------------- point to point


def _p2p_peer(g: ProcessGroup, rank: int | None, group_rank: int | None, what: str) -> int:
    peer = root_of(g, rank, group_rank, what)
    if peer == g.rank:
        raise CollectiveArgumentError(
            f"{what}={g.ranks[peer]} is this rank: sending to oneself is not supported"
        )
    return peer


def _check_tag(tag: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise CollectiveArgumentError(f"tag must be an int, not {tag!r}")
    return tag


def _recv_args(
    tensor: Buffer, src: int | None, group: Group, tag: int, group_src: int | None
) -> tuple | None:
    """(group, array, peer's group rank or None, tag, group_src given) of a receive;
    None on a non-member."""
    g = resolve_group(group)
    if g is None:
        return None
    arr = as_array(tensor, "tensor")
    peer = None if src is None and group_src is None else _p2p_peer(g, src, group_src, "src")
    return g, arr, peer, _check_tag(tag), group_src is not None


def isend(
    tensor: Buffer, dst: int | None = None, group: Group = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns a Work (None on a non-member).
    ``tensor`` must not be modified until the Work completes (no copy is made). Completes
    once the data was handed to the operating system (TCP) or is in ``dst``'s
    shared-memory ring (same node: a message that fits the ring, 1 MiB by default, is
    written at once and the Work returned complete)."""
    g = resolve_group(group)
    if g is None:
        return None
    arr = as_array(tensor, "tensor", writable=False)
    peer = _p2p_peer(g, dst, group_dst, "dst")
    return g.isend(arr, peer, _check_tag(tag))


def irecv(
    tensor: Buffer, src: int | None = None, group: Group = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (None: any source); returns a Work
    whose ``result()`` is the sender's rank (global, or group rank if ``group_src`` was
    given). The sender must send the same dtype and element count
    (CollectiveMismatchError otherwise). Receives from one source and tag match its
    messages in call order (torch.distributed's rule), whichever Work is waited first."""
    args = _recv_args(tensor, src, group, tag, group_src)
    return None if args is None else args[0].irecv(*args[1:])


def send(
    tensor: Buffer, dst: int | None = None, group: Group = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to ``dst`` (blocks until the data is handed to the OS or is in
    ``dst``'s shared-memory ring, at most the group timeout: CollectiveTimeoutError)."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(
    tensor: Buffer, src: int | None = None, group: Group = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from ``src`` (None: any source); returns the sender's rank
    (-1 on a non-member). Blocks up to the group timeout (CollectiveTimeoutError, and the
    receive is withdrawn)."""
    args = _recv_args(tensor, src, group, tag, group_src)
    return -1 if args is None else args[0].recv(*args[1:])


# --------------------------------------------------------------------- collectives


def barrier(
    group: Group = None, async_op: bool = False, device_ids: Any = None, timeout: Timeout = None
) -> Work | None:
    """Block until every rank of ``group`` called barrier (dissemination algorithm,
    ceil(log2 n) rounds). ``timeout``: seconds or timedelta for this call only."""
    g = resolve_group(group)
    if g is None:
        return None
    return g.barrier(async_op, to_seconds(timeout))


def broadcast(
    tensor: Buffer,
    src: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank (same shape/dtype
    everywhere; the root's buffer may be read-only)."""
    g = resolve_group(group)
    if g is None:
        return None
    root = root_of(g, src, group_src, "src")
    return g.broadcast(flat(as_array(tensor, "tensor", writable=g.rank != root)), root, async_op)


def all_reduce(
    tensor: Buffer, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` over all ranks with ``op``; every rank gets the (bit-identical)
    result in ``tensor``."""
    g = resolve_group(group)
    if g is None:
        return None
    return g.all_reduce(flat(as_array(tensor, "tensor")), as_reduce_op(op), async_op)


def reduce(
    tensor: Buffer,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` over all ranks into ``tensor`` on ``dst``; the other ranks'
    tensors are not modified."""
    g = resolve_group(group)
    if g is None:
        return None
    root = root_of(g, dst, group_dst, "dst")
    arr = flat(as_array(tensor, "tensor", writable=g.rank == root))
    return g.reduce(arr, as_reduce_op(op), root, async_op)


def all_gather(
    tensor_list: Sequence[Buffer], tensor: Buffer, group: Group = None, async_op: bool = False
) -> Work | None:
    """``tensor_list[i]`` receives rank i's ``tensor`` (n tensors of tensor's size and dtype)."""
    g = resolve_group(group)
    if g is None:
        return None
    inp = flat(as_array(tensor, "tensor", writable=False))
    outs = [flat(a) for a in as_array_list(tensor_list, "tensor_list", g.size)]
    check_same(outs, inp, "tensor_list")
    return g.all_gather(outs, inp, async_op)


def all_gather_into_tensor(
    output_tensor: Buffer, input_tensor: Buffer, group: Group = None, async_op: bool = False
) -> Work | None:
    """``output_tensor`` (n x input's elements, same dtype) receives the inputs of ranks
    0..n-1 concatenated."""
    g = resolve_group(group)
    if g is None:
        return None
    inp = flat(as_array(input_tensor, "input_tensor", writable=False))
    out = flat(as_array(output_tensor, "output_tensor"))
    check_same([out], inp, "[output_tensor]", size=inp.size * g.size)
    return g.all_gather_into_tensor(out, inp, async_op)


def scatter(
    tensor: Buffer,
    scatter_list: Sequence[Buffer] | None = None,
    src: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Rank i receives ``scatter_list[i]`` of rank ``src`` in ``tensor``
    (``scatter_list``: n tensors of tensor's size and dtype, only on ``src``)."""
    g = resolve_group(group)
    if g is None:
        return None
    root = root_of(g, src, group_src, "src")
    out = flat(as_array(tensor, "tensor"))
    ins = None
    if g.rank == root:
        ins = [flat(a) for a in as_array_list(scatter_list, "scatter_list", g.size, writable=False)]
        check_same(ins, out, "scatter_list")
    return g.scatter(out, ins, root, async_op)


def gather(
    tensor: Buffer,
    gather_list: Sequence[Buffer] | None = None,
    dst: int | None = None,
    group: Group = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """``gather_list[i]`` on ``dst`` receives rank i's ``tensor`` (``gather_list``: n
    tensors of tensor's size and dtype, only on ``dst``)."""
    g = resolve_group(group)
    if g is None:
        return None
    root = root_of(g, dst, group_dst, "dst")
    inp = flat(as_array(tensor, "tensor", writable=False))
    outs = None
    if g.rank == root:
        outs = [flat(a) for a in as_array_list(gather_list, "gather_list", g.size)]
        check_same(outs, inp, "gather_list")
    return g.gather(inp, outs, root, async_op)


def reduce_scatter(
    output: Buffer,
    input_list: Sequence[Buffer],
    op: Any = ReduceOp.SUM,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """``output`` on rank i receives the reduction over ranks of ``input_list[i]``
    (n tensors of output's size and dtype; inputs are not modified)."""
    g = resolve_group(group)
    if g is None:
        return None
    out = flat(as_array(output, "output"))
    ins = [flat(a) for a in as_array_list(input_list, "input_list", g.size, writable=False)]
    check_same(ins, out, "input_list")
    return g.reduce_scatter(out, ins, as_reduce_op(op), async_op)


def reduce_scatter_tensor(
    output: Buffer, input: Buffer, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False
) -> Work | None:
    """``output`` on rank i receives block i (output's size) of the reduction over ranks
    of ``input`` (n x output's elements; not modified)."""
    g = resolve_group(group)
    if g is None:
        return None
    out = flat(as_array(output, "output"))
    inp = flat(as_array(input, "input", writable=False))
    check_same([inp], out, "[input]", size=out.size * g.size)
    return g.reduce_scatter(out, inp, as_reduce_op(op), async_op)


def all_to_all(
    output_tensor_list: Sequence[Buffer],
    input_tensor_list: Sequence[Buffer],
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """``output_tensor_list[i]`` receives rank i's ``input_tensor_list[r]`` (both lists
    of n tensors of one dtype; sizes may differ per pair but must agree between the
    sender's input and the receiver's output)."""
    g = resolve_group(group)
    if g is None:
        return None
    outs = as_array_list(output_tensor_list, "output_tensor_list", g.size)
    ins = as_array_list(input_tensor_list, "input_tensor_list", g.size, writable=False)
    dt = ins[0].dtype  # (a group has at least this rank)
    for name, arrs in (("output_tensor_list", outs), ("input_tensor_list", ins)):
        for i, a in enumerate(arrs):  # (one pass: the small calls' cost)
            if a.dtype != dt:
                raise CollectiveArgumentError(f"{name}[{i}] has dtype {a.dtype}; expected {dt}")
            if a.ndim != 1:
                arrs[i] = flat(a)
    if outs[g.rank].size != ins[g.rank].size:
        raise CollectiveArgumentError(
            f"output_tensor_list[{g.rank}] and input_tensor_list[{g.rank}] differ in size"
        )
    return g.all_to_all(outs, ins, async_op)


def all_to_all_single(
    output: Buffer,
    input: Buffer,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Group = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0 (``input_split_sizes`` rows per rank, default equal),
    send split i to rank i, and concatenate what arrives into ``output`` (split by
    ``output_split_sizes``)."""
    g = resolve_group(group)
    if g is None:
        return None
    out_arr = as_array(output, "output")
    in_arr = as_array(input, "input", writable=False)
    if out_arr.dtype != in_arr.dtype:
        raise CollectiveArgumentError(f"output has dtype {out_arr.dtype} but input has {in_arr.dtype}")
    # (equal splits: None; the group makes the ranges only when it takes the general path)
    ob = split_bounds(out_arr.shape, out_arr.size, output_split_sizes, g.size, "output", True)
    ib = split_bounds(in_arr.shape, in_arr.size, input_split_sizes, g.size, "input", True)
    return g.all_to_all_single(flat(out_arr), flat(in_arr), ob, ib, async_op)


# torch 2.13 names for the single-tensor variants (the *_tensor names are deprecated there)
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (torch's P2POp):
    ``op`` is :func:`isend` or :func:`irecv`; ``peer`` a global rank (or ``group_peer``
    a rank in ``group``)."""

    def __init__(
        self,
        op: Callable[..., Work | None],
        tensor: Buffer,
        peer: int | None = None,
        group: Group = None,
        tag: int = 0,
        group_peer: int | None = None,
    ):
        if op not in (isend, irecv):
            raise CollectiveArgumentError(f"P2POp op must be isend or irecv, not {op!r}")
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group
        self.tag, self.group_peer = tag, group_peer


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list:
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
