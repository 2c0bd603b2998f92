"""The backend seam: how one group runs each collective.

A :class:`Backend` runs an operation of the op table (:mod:`distlaunch.collectives.optable`) with its
transport's algorithm, called by :meth:`~distlaunch.collectives.group.ProcessGroup.run` inside the operation
(with its :class:`~distlaunch.collectives.context.OpContext`: sequence number, deadline, header fields) on
flat, C-contiguous numpy arrays that the public API (or a torch ProcessGroup wrapper)
has already checked. The group chooses its backend once, at its first collective:

- :class:`TcpBackend` -- point-to-point algorithms over the TCP transport
  (:mod:`.tcp`);
- :class:`ShmBackend` -- every member on this node: the group's shared-memory channel
  (:mod:`.shm`), which has an algorithm for every collective; an operation without
  one would compare the calls on shared memory and then run over TCP;
- :class:`~.hierarchy.HierarchicalBackend` -- members on several nodes, some sharing one.

``native(op)``: whether a backend runs ``op`` without TCP messages under the group's
own id (it has its own algorithm for it); after every other operation the group checks
that no unexpected message of it is left over (a rank that ran a different operation).
"""

from __future__ import annotations

from typing import Any

from ..context import Members, OpContext
from ..optable import OpSpec, algorithm
from ..transport.shm import ShmChannel
from . import shm as shm_alg
from . import tcp as alg  # noqa: F401  (registers the TCP algorithms in the op table)


class Backend:
    """Runs a group's collectives: :meth:`run` blocks until this rank's part of one
    operation is done, raising what the context's waits raise (see
    :class:`~distlaunch.collectives.context.OpContext`). Arrays are flat; roots are group ranks; inputs the
    algorithms call "not modified" may be read-only. This one (``kind`` "tcp") runs every
    operation's TCP algorithm from the op table."""

    kind = "tcp"
    channel: ShmChannel | None = None  # set as ctx.shm for every operation

    def run(self, op: OpSpec, ctx: OpContext, *args: Any) -> None:
        """Operation ``op`` (an op-table entry) with its arguments (as
        :meth:`~distlaunch.collectives.group.ProcessGroup.collective` passes them)."""
        fn = algorithm(op, "tcp")
        assert fn is not None, f"{op.name} has no TCP algorithm"
        fn(ctx, *args)

    def native(self, op: OpSpec) -> bool:
        """Whether ``op`` runs here without TCP messages under the group's own id."""
        return False

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
    """The collectives of a group whose members share this node, on ``channel``: an
    operation's shared-memory algorithm, else the calls compared on the channel and the
    TCP algorithm.

    ``small``: bytes up to which blocking all_reduce, broadcast, all_gather and gather
    (their input) and reduce_scatter (its input) take the group's reused-context fast
    path (with ``small_all_reduce_plan`` / ``small_all_reduce``, ``small_plan`` /
    ``small_broadcast``, ``small_all_gather``, ``small_gather``, ``small_reduce_scatter``);
    scatter's blocks take it up to ``scatter_spread`` bytes (``small_scatter``), all_to_all's
    blocks of one size up to ``all_to_all_width`` bytes (``small_all_to_all``). Those
    with a ``small_plan`` take it from a call's second time on (the first: the general
    path; broadcast: its shared-memory algorithm, still on the fast path).
    """

    kind = "shm"
    small_all_reduce = staticmethod(shm_alg.small_all_reduce)
    small_broadcast = staticmethod(shm_alg.small_broadcast)
    small_all_gather = staticmethod(shm_alg.small_all_gather)
    small_reduce_scatter = staticmethod(shm_alg.small_reduce_scatter)
    small_gather = staticmethod(shm_alg.small_gather)
    small_scatter = staticmethod(shm_alg.small_scatter)
    small_all_to_all = staticmethod(shm_alg.small_all_to_all)

    channel: ShmChannel  # never None here

    def __init__(self, channel: ShmChannel):
        self.channel = channel
        self.small = channel.config.small
        self.small_all_reduce_plan = channel.small_all_reduce_plan
        self.small_plan = channel.small_plan
        self.scatter_spread = shm_alg.scatter_spread(channel)  # scatter's fast path: blocks up to it
        self.all_to_all_width = shm_alg.all_to_all_width(channel)  # all_to_all's: blocks up to it

    def run(self, op: OpSpec, ctx: OpContext, *args: Any) -> None:
        fn = algorithm(op, "shm")
        if fn is None:
            shm_alg.preamble(ctx)
            super().run(op, ctx, *args)
        else:
            fn(ctx, *args)

    def native(self, op: OpSpec) -> bool:
        return algorithm(op, "shm") is not None

    def abort(self, reason: int) -> None:
        self.channel.abort(reason)

    def close(self) -> None:
        self.channel.close()
