"""Pure rank arithmetic: nodes x slots -> per-worker ranks.

Ranks are contiguous per node, in node-rank order (torchrun's static rendezvous and
mpirun's default ``--map-by slot`` both do this).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cpus import BIND_MODES as BIND_MODES  # re-exported: the rest of rank arithmetic is here
from .cpus import cpu_sets as cpu_sets

# Upper bounds on what one job may ask for: far above any real machine or cluster, low
# enough that a typo (an extra digit) is refused at once instead of exhausting memory.
MAX_SLOTS_PER_NODE = 4096  # workers on one node (-H host:N, --nproc-per-node, slots=N)
MAX_NODES = 65536  # nodes in one job (--nnodes, host lists)


@dataclass(frozen=True)
class WorkerSlot:
    """One worker's place in the job: its global and local rank and the sizes around it."""

    # (a docstring of its own also spares dataclass the signature it would make one from)
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    num_nodes: int


def assign_ranks(slots_per_node: list[int]) -> list[list[WorkerSlot]]:
    """Return, for each node in node-rank order, its workers' slots.

    ``slots_per_node[i]`` is the number of workers on node ``i`` (each >= 1). Raises
    ValueError for an empty list or a count below 1.
    """
    if not slots_per_node:
        raise ValueError("at least one node is needed")
    if any(n < 1 for n in slots_per_node):
        raise ValueError(f"every node needs at least one worker slot, got {slots_per_node}")
    return [node_slots(slots_per_node, k) for k in range(len(slots_per_node))]


def node_slots(slots_per_node: list[int], node_rank: int) -> list[WorkerSlot]:
    """The slots of node ``node_rank`` alone (as ``assign_ranks(...)[node_rank]``, without
    building every node's: a large job's launcher holds only its own workers)."""
    first = sum(slots_per_node[:node_rank])
    world_size = first + sum(slots_per_node[node_rank:])
    return seat_slots(first, slots_per_node[node_rank], node_rank, world_size, len(slots_per_node))


def seat_slots(first: int, count: int, node_rank: int, world_size: int, num_nodes: int) -> list[WorkerSlot]:
    """The ``count`` slots of node ``node_rank`` whose first global rank is ``first`` (its
    rendezvous seat), in a job of ``world_size`` workers on ``num_nodes`` nodes."""
    return [WorkerSlot(first + i, i, node_rank, world_size, count, num_nodes) for i in range(count)]


def format_cpus(cpus: frozenset[int] | None) -> str:
    """``{0, 1, 2, 5}`` -> ``0-2,5`` (taskset's list format); None -> ``all``."""
    if cpus is None:
        return "all"
    parts: list[list[int]] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            parts.append(run)
            run = []
        run.append(c)
    parts.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in parts)
