"""CPU affinity blocks for a node's local ranks (``cpu_sets``). Standard library only:
the single-node fast lane (``quick.py``) binds its workers before it imports anything
else; ``topology`` re-exports it with the rest of the rank arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

BIND_MODES = ("auto", "core", "none")


def cpu_sets(mode: str, local_world_size: int, cpus: Iterable[int]) -> list[frozenset[int] | None]:
    """CPU affinity for local ranks ``0 .. local_world_size - 1`` (None: leave the
    inherited affinity alone), from the CPUs the launcher may use (``cpus``, e.g.
    ``os.sched_getaffinity(0)``, which already honours taskset / cgroup cpusets).

    - ``none``: nobody is bound (torchrun's behaviour);
    - ``core``: local rank i gets the single CPU ``cpus[i % len(cpus)]`` (mpirun's
      ``--bind-to core``, round robin when there are more workers than CPUs);
    - ``auto``: the CPUs are split into disjoint contiguous blocks, one per local rank
      (the first ``len(cpus) % L`` blocks one CPU larger), or round robin as ``core`` when
      there are more workers than CPUs; a single worker is not bound. Like DeepSpeed's
      ``--bind_cores_to_rank``: threads of a worker stay on its share of the node, and
      workers that sleep and wake in collectives are not migrated onto each other's CPUs.
    """
    if mode not in BIND_MODES:
        raise ValueError(f"unknown binding mode {mode!r}")
    ordered = sorted(cpus)
    n, c = local_world_size, len(ordered)
    if mode == "none" or not ordered or (mode == "auto" and n == 1):
        return [None] * n
    if mode == "core" or n >= c:
        return [frozenset({ordered[i % c]}) for i in range(n)]
    per, extra = divmod(c, n)
    out: list[frozenset[int] | None] = []
    start = 0
    for i in range(n):
        size = per + (i < extra)
        out.append(frozenset(ordered[start : start + size]))
        start += size
    return out
