"""Pure rank arithmetic: nodes x slots -> per-worker ranks.

Ranks are contiguous per node, in node-rank order (torchrun's static rendezvous and
mpirun's default ``--map-by slot`` both do this).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSlot:
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
    world_size = sum(slots_per_node)
    nodes, first = [], 0
    for node_rank, count in enumerate(slots_per_node):
        nodes.append([
            WorkerSlot(first + i, i, node_rank, world_size, count, len(slots_per_node))
            for i in range(count)
        ])
        first += count
    return nodes
