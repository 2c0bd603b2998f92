"""Hierarchical collectives for a group that spans several nodes, some with more than one
member: within each node over shared memory, across nodes over TCP between one leader
per node (the node's lowest group rank), then within the node again.

- all_reduce with the same number of members on every node: the ranks with the same
  node-local index form a "column". Up to SMALL_ACROSS (64 KiB): node-local all_reduce (one
  shared-memory phase, bit-identical node sums on every rank), then every column
  all-reduces the node sums over TCP at once (same inputs, same order: same bits
  everywhere). Larger ("2D"): node-local reduce-scatter per chunk, each rank all-reduces
  its slice across nodes with its column (every rank carries 1/(ranks per node) of the
  inter-node traffic), node-local all-gather. Unequal nodes: node-local reduce to the
  leader, all_reduce among the leaders (TCP, :mod:`.tcp`), node-local broadcast. The result
  is computed once (by the leaders' fixed algorithm, on identical node sums) and copied,
  so every rank gets the same bits; AVG divides by the whole group size at the end;
- broadcast: the root's node first broadcasts locally (when the root is not its
  node's leader), then the leaders broadcast over TCP from the root's node leader, then
  every other node broadcasts locally;
- barrier: node-local barrier, leaders' barrier, node-local barrier.

Other operations run flat over TCP. The node-local, leader and column sub-groups are
internal :class:`~distlaunch.collectives.context.Members` (ids with bit 31 / 30 / 29
set) that run inside the parent operation: its deadline, its sequence number for
diagnosis; a failure in a sub-group fails the parent operation, whose ABORT (sent to
every parent member) also breaks the sub-groups.

Reference: the two-level scheme of MPICH's SMP-aware collectives (MPIR_Allreduce_intra_smp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..buffers import byte_view
from ..context import Members, OpContext, OpTimeout
from ..ops import ReduceOp, finalize
from ..optable import OpSpec, algorithm, implements
from ..transport.shm import ShmChannel, ShmConfig, ShmFullError, warn_full
from . import shm as shm_alg
from . import tcp as alg
from .backend import Backend

LOCAL_BIT, LEADER_BIT, COLUMN_BIT = 1 << 31, 1 << 30, 1 << 29
# all_reduce across nodes: whole node sums per column up to here, the 2D scheme above
# (every column then carries only its slice across nodes); at most one shared-memory slot
SMALL_ACROSS_MAX = 64 * 1024


class HierarchicalBackend(Backend):
    """Node-local, leader and column sub-groups of ``group`` (built on every member alike
    from the node ids all ranks published: ``node_keys``, one per group rank).
    ``shm_name(members)``: the segment name of the node-local sub-group."""

    kind = "hierarchical"

    def __init__(
        self,
        group: Members,
        node_keys: list[str],
        shm_name: Callable[[Members], str | None],
        config: ShmConfig,
    ) -> None:
        self.group = group
        self._shm_name = shm_name
        self._config = config
        self._local_channel: ShmChannel | None = None
        self._local_tcp = False  # the node-local segment could not be reserved
        self.small_across = min(SMALL_ACROSS_MAX, config.slot)
        by_node: dict[str, list[int]] = {}
        for grank, key in enumerate(node_keys):
            by_node.setdefault(key, []).append(grank)
        nodes = sorted(by_node.values())
        me = group.rank
        self.local = next(m for m in nodes if me in m)  # group ranks of my node
        self.leaders = [m[0] for m in nodes]  # group ranks
        self.node_of = {g: i for i, m in enumerate(nodes) for g in m}
        self.is_leader = self.local[0] == me
        rt = group.runtime
        self.local_pg: Members | None = None
        self.leader_pg: Members | None = None
        if len(self.local) > 1:
            self.local_pg = Members(
                rt,
                LOCAL_BIT | group.gid,
                [group.ranks[g] for g in self.local],
                group.timeout,
                f"{group.name} (node-local)",
            )
        if self.is_leader:
            self.leader_pg = Members(
                rt,
                LEADER_BIT | group.gid,
                [group.ranks[g] for g in self.leaders],
                group.timeout,
                f"{group.name} (node leaders)",
            )
        # equal node sizes: the ranks with the same index on every node form a "column"
        # that carries 1/(ranks per node) of a large all_reduce across nodes (2D scheme)
        self.column_pg: Members | None = None
        if len(self.local) > 1 and len({len(m) for m in nodes}) == 1:
            i = self.local.index(me)
            self.column_pg = Members(
                rt,
                COLUMN_BIT | group.gid,
                [group.ranks[m[i]] for m in nodes],
                group.timeout,
                f"{group.name} (column {i})",
            )

    def run(self, op: OpSpec, ctx: OpContext, *args: Any) -> None:
        """``op``'s hierarchical algorithm (a method below), else flat over TCP."""
        fn = algorithm(op, "hierarchical")
        if fn is None:
            super().run(op, ctx, *args)
        else:
            fn(self, ctx, *args)

    def native(self, op: OpSpec) -> bool:
        return algorithm(op, "hierarchical") is not None

    def children(self) -> list[Members]:
        return [c for c in (self.local_pg, self.leader_pg, self.column_pg) if c is not None]

    def _local_shm(self, local_pg: Members) -> ShmChannel | None:
        """The channel of ``local_pg`` (the node-local sub-group), created by its first
        operation; None when its segment cannot be reserved (a verdict alike on every
        member of the node, whose lowest rank warns): this node's steps then run over TCP
        (the other nodes see the same column and leader operations either way)."""
        if self._local_channel is None and not self._local_tcp:
            name = self._shm_name(local_pg)
            if name is not None:
                try:
                    self._local_channel = ShmChannel(local_pg, name, self._config)
                except ShmFullError as e:
                    self._local_tcp = True
                    if local_pg.rank == 0:
                        warn_full(e)
        return self._local_channel

    def _on_shm(self) -> bool:
        """Whether this node's local steps run on shared memory (decided at the first)."""
        return self.local_pg is not None and self._local_shm(self.local_pg) is not None

    def _local_all_reduce(
        self, ctx: OpContext, arr: np.ndarray, op: ReduceOp, root: int | None = None
    ) -> None:
        """Node-local all_reduce (``root`` None) or reduce to ``root`` of ``arr``."""
        assert self.local_pg is not None
        shm = self._on_shm()

        def run(c: OpContext) -> None:
            if shm:
                shm_alg.all_reduce(c, arr, op, root=root)
            elif root is None:
                alg.all_reduce(c, arr, op)
            else:
                alg.reduce(c, arr, op, root)

        self._run(self.local_pg, ctx, run, root=-1 if root is None else root)

    def _local_broadcast(self, ctx: OpContext, u8: np.ndarray, root: int) -> None:
        assert self.local_pg is not None
        bcast = shm_alg.broadcast if self._on_shm() else alg.broadcast
        self._run(self.local_pg, ctx, lambda c: bcast(c, u8, root), root=root)

    def _local_barrier(self, ctx: OpContext) -> None:
        assert self.local_pg is not None
        self._run(self.local_pg, ctx, shm_alg.barrier if self._on_shm() else alg.barrier)

    def _all_reduce_2d_tcp(
        self, ctx: OpContext, arr: np.ndarray, op: ReduceOp, across: Callable[[np.ndarray], None]
    ) -> None:
        """The 2D all_reduce of a node without shared memory: per chunk of the shared-memory
        form (``shm_algorithms.all_reduce`` with chunk = slot), the node sum over TCP, this
        rank's slice of it (the same bounds) across nodes, and every slice gathered."""
        local = self.local_pg
        assert local is not None
        n, r = local.size, local.rank
        per = max(n, (self._config.slot // arr.dtype.itemsize) // n * n)
        for a in range(0, arr.size, per):
            piece = arr[a : a + per]
            bounds = alg.block_bounds(piece.size, n)
            self._run(local, ctx, lambda c: alg.all_reduce(c, piece, op))  # noqa: B023 (run now)
            lo, hi = bounds[r]
            if hi > lo:
                across(piece[lo:hi])
            views = [byte_view(piece[x:y]) for x, y in bounds]
            self._run(local, ctx, lambda c: alg.ring_all_gather(c, views))  # noqa: B023

    def _sub(self, pg: Members, ctx: OpContext, root: int = -1) -> OpContext:
        """An OpContext of sub-group ``pg`` inside the parent operation ``ctx``."""
        sub = OpContext(
            pg,
            ctx.name,
            pg.next_seq(),
            dtype=ctx.dtype,
            count=ctx.count,
            root=root,
            redop=ctx.redop,
            timeout=ctx.timeout,
        )
        sub.deadline = ctx.deadline
        if pg is self.local_pg:
            sub.shm = self._local_shm(pg)
        return sub

    def _run(self, pg: Members, ctx: OpContext, fn: Callable[[OpContext], Any], root: int = -1) -> None:
        """Run ``fn(sub_ctx)`` on sub-group ``pg``; timeouts name parent group ranks."""
        sub = self._sub(pg, ctx, root)
        try:
            fn(sub)
            if sub.shm is None:
                sub.check_leftovers()
        except OpTimeout as e:
            if e.mapped:  # from a nested sub-operation: already mapped
                raise
            err = OpTimeout([self.group.group_rank(pg.ranks[p]) for p in e.peers])
            err.mapped = True
            raise err from None
        finally:
            sub.cancel_pending()

    @implements("all_reduce", "hierarchical")
    def all_reduce(self, ctx: OpContext, arr: np.ndarray, op: ReduceOp) -> None:
        opx = ReduceOp.SUM if op is ReduceOp.AVG else op  # divide once, by the whole group
        col, local = self.column_pg, self.local_pg
        if col is not None and local is not None and arr.nbytes > self.small_across:
            # (a column implies a node-local sub-group)
            # 2D: node-local reduce-scatter; each slice all-reduced across nodes by its
            # column, every column at once; node-local all-gather
            def across(piece: np.ndarray) -> None:
                self._run(col, ctx, lambda c: alg.all_reduce(c, piece, opx))

            def local_2d(c: OpContext) -> None:
                assert c.shm is not None  # the node-local sub-group runs on shared memory
                # whole buffers per chunk: every chunk costs one TCP operation's latency
                shm_alg.all_reduce(c, arr, opx, between=across, chunk=c.shm.slot)

            if self._on_shm():
                self._run(local, ctx, local_2d)
            else:
                self._all_reduce_2d_tcp(ctx, arr, opx, across)
            finalize(arr, op, self.group.size)
            return
        if col is not None and local is not None:
            # small: every rank holds the (bit-identical) node sum after the one-phase
            # node-local all_reduce; every column then combines the node sums in the
            # same order, so all ranks end with the same bits -- no leader, no broadcast
            self._local_all_reduce(ctx, arr, opx)
            self._run(col, ctx, lambda c: alg.all_reduce(c, arr, opx))
            finalize(arr, op, self.group.size)
            return
        if self.local_pg is not None:
            self._local_all_reduce(ctx, arr, opx, root=0)
        if self.leader_pg is not None and self.leader_pg.size > 1:
            self._run(self.leader_pg, ctx, lambda c: alg.all_reduce(c, arr, opx))
        if self.local_pg is not None:
            self._local_broadcast(ctx, arr.view(np.uint8), 0)
        finalize(arr, op, self.group.size)

    @implements("broadcast", "hierarchical")
    def broadcast(self, ctx: OpContext, arr: np.ndarray, root: int) -> None:
        u8 = arr.view(np.uint8)
        node = self.node_of[root]
        mine = self.node_of[self.group.rank]
        root_leader = self.leaders[node]
        if mine == node and self.local_pg is not None and root != root_leader:
            self._local_broadcast(ctx, u8, self.local.index(root))
        if self.leader_pg is not None and self.leader_pg.size > 1:
            self._run(self.leader_pg, ctx, lambda c: alg.broadcast(c, u8, node), root=node)
        if self.local_pg is not None and (mine != node or root == root_leader):
            self._local_broadcast(ctx, u8, 0)

    @implements("barrier", "hierarchical")
    def barrier(self, ctx: OpContext) -> None:
        if self.local_pg is not None:
            self._local_barrier(ctx)
        if self.leader_pg is not None and self.leader_pg.size > 1:
            self._run(self.leader_pg, ctx, alg.barrier)
        if self.local_pg is not None:
            self._local_barrier(ctx)

    def abort(self, reason: int) -> None:
        if self._local_channel is not None:
            self._local_channel.abort(reason)

    def close(self) -> None:
        if self._local_channel is not None:
            self._local_channel.close()
            self._local_channel = None
