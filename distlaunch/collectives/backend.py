"""The backend seam: how one group runs each collective.

A :class:`Backend` has one method per collective, called by
:meth:`~.group.ProcessGroup.run` inside the operation (with its
:class:`~.context.OpContext`: sequence number, deadline, header fields) on flat,
C-contiguous numpy arrays that the public API (or a torch ProcessGroup wrapper) has
already checked. The group chooses its backend once, at its first collective:

- :class:`TcpBackend` -- point-to-point algorithms over the TCP transport
  (:mod:`.algorithms`);
- :class:`ShmBackend` -- every member on this node: the group's shared-memory channel
  (:mod:`.shm_algorithms`); scatter, gather and all_to_all compare the calls on shared
  memory and then run over TCP;
- :class:`~.hierarchy.HierarchicalBackend` -- members on several nodes, some sharing one.

``native_ops``: the operations a backend runs without TCP messages under the group's
own id; after every other operation the group checks that no unexpected message of it
is left over (a rank that ran a different operation).
"""

from __future__ import annotations

import numpy as np

from . import algorithms as alg
from . import shm_algorithms as shm_alg
from .buffers import byte_view
from .context import Members, OpContext
from .ops import ReduceOp
from .shm import ShmChannel


def joined(blocks: np.ndarray | list) -> tuple[np.ndarray, bool]:
    """``blocks`` (n arrays, or one array of n blocks) as one array, and whether that
    array is a fresh copy the caller may overwrite."""
    if isinstance(blocks, np.ndarray):
        return blocks, False
    return (np.concatenate(blocks) if blocks else np.empty(0, np.uint8)), True


class Backend:
    """One method per collective; each blocks until this rank's part is done, raising
    what the context's waits raise (see :class:`~.context.OpContext`). Arrays are flat;
    roots are group ranks; inputs the docstrings call "not modified" may be read-only.
    """

    kind = "tcp"
    native_ops: frozenset = frozenset()
    channel: ShmChannel | None = None  # set as ctx.shm for every operation

    def barrier(self, ctx: OpContext) -> None:
        alg.barrier(ctx)

    def broadcast(self, ctx: OpContext, arr: np.ndarray, root: int) -> None:
        """``arr`` of ``root`` into ``arr`` everywhere (not modified on the root)."""
        alg.broadcast(ctx, arr, root)

    def all_reduce(self, ctx: OpContext, arr: np.ndarray, op: ReduceOp) -> None:
        alg.all_reduce(ctx, arr, op)

    def reduce(self, ctx: OpContext, arr: np.ndarray, op: ReduceOp, root: int) -> None:
        """The reduction into ``arr`` on ``root``; other ranks' ``arr`` is not modified."""
        alg.reduce(ctx, arr, op, root)

    def all_gather(self, ctx: OpContext, outs: list, inp: np.ndarray) -> None:
        """``outs``: n arrays of ``inp``'s size and dtype; ``outs[i]`` receives rank i's
        ``inp`` (not modified)."""
        views = [byte_view(o) for o in outs]
        views[ctx.group.rank][:] = byte_view(inp)
        alg.all_gather(ctx, views)

    def reduce_scatter(
        self, ctx: OpContext, out: np.ndarray, blocks: np.ndarray | list, op: ReduceOp
    ) -> None:
        """``blocks``: n arrays (or one array of n blocks) of ``out``'s size, not
        modified; ``out`` receives block r of their reduction over the ranks."""
        work, fresh = joined(blocks)
        alg.reduce_scatter(ctx, out, work if fresh else work.copy(), op)

    def scatter(self, ctx: OpContext, out: np.ndarray, ins: list | None, root: int) -> None:
        """``out`` on rank i receives ``ins[i]`` of ``root`` (``ins``: None elsewhere)."""
        alg.scatter(ctx, byte_view(out), None if ins is None else [byte_view(a) for a in ins], root)

    def gather(self, ctx: OpContext, inp: np.ndarray, outs: list | None, root: int) -> None:
        """``outs[i]`` on ``root`` receives rank i's ``inp`` (``outs``: None elsewhere)."""
        alg.gather(ctx, byte_view(inp), None if outs is None else [byte_view(a) for a in outs], root)

    def all_to_all(self, ctx: OpContext, outs: list, ins: list) -> None:
        """``ins[i]`` goes to rank i, ``outs[i]`` comes from rank i (one dtype)."""
        alg.all_to_all(ctx, [byte_view(a) for a in outs], [byte_view(a) for a in ins])

    def abort(self, reason: int) -> None:
        """Wake members blocked outside TCP after a failure (``reason``: wire ABORT_*)."""

    def children(self) -> list[Members]:
        """Internal sub-groups whose operations run inside the group's (none here)."""
        return []

    def close(self) -> None:
        """Release what the backend holds (shared memory, sub-groups)."""


class TcpBackend(Backend):
    """Every collective over the TCP transport (stateless: one instance serves all)."""


TCP = TcpBackend()


class ShmBackend(Backend):
    """The collectives of a group whose members share this node, on ``channel``.

    ``small``: bytes up to which blocking all_reduce and broadcast take the group's
    reused-context fast path (with ``small_all_reduce_plan`` / ``small_all_reduce``).
    """

    kind = "shm"
    native_ops = frozenset(
        {
            "barrier",
            "broadcast",
            "all_reduce",
            "reduce",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter",
            "reduce_scatter_tensor",
        }
    )
    small_all_reduce = staticmethod(shm_alg.small_all_reduce)

    channel: ShmChannel  # never None here

    def __init__(self, channel: ShmChannel):
        self.channel = channel
        self.small = channel.config.small
        self.small_all_reduce_plan = channel.small_all_reduce_plan

    def barrier(self, ctx: OpContext) -> None:
        shm_alg.barrier(ctx)

    def broadcast(self, ctx: OpContext, arr: np.ndarray, root: int) -> None:
        shm_alg.broadcast(ctx, arr.view(np.uint8), root)

    def all_reduce(self, ctx: OpContext, arr: np.ndarray, op: ReduceOp) -> None:
        shm_alg.all_reduce(ctx, arr, op)

    def reduce(self, ctx: OpContext, arr: np.ndarray, op: ReduceOp, root: int) -> None:
        shm_alg.all_reduce(ctx, arr, op, root)

    def all_gather(self, ctx: OpContext, outs: list, inp: np.ndarray) -> None:
        shm_alg.all_gather(ctx, [o.view(np.uint8) for o in outs], inp.view(np.uint8))

    def reduce_scatter(
        self, ctx: OpContext, out: np.ndarray, blocks: np.ndarray | list, op: ReduceOp
    ) -> None:
        shm_alg.reduce_scatter(ctx, out, joined(blocks)[0], op)

    def scatter(self, ctx: OpContext, out: np.ndarray, ins: list | None, root: int) -> None:
        shm_alg.preamble(ctx)
        super().scatter(ctx, out, ins, root)

    def gather(self, ctx: OpContext, inp: np.ndarray, outs: list | None, root: int) -> None:
        shm_alg.preamble(ctx)
        super().gather(ctx, inp, outs, root)

    def all_to_all(self, ctx: OpContext, outs: list, ins: list) -> None:
        shm_alg.preamble(ctx)
        super().all_to_all(ctx, outs, ins)

    def abort(self, reason: int) -> None:
        self.channel.abort(reason)

    def close(self) -> None:
        self.channel.close()
