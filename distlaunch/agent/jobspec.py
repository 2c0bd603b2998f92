"""What the head sends one node's agent (``JobSpec``, one JSON line on the agent's stdin)
and round 0's seats as the head plans them (``PlannedSeat``, ``plan_first_round``).

Here, not in ``agent/entry.py``: the head builds them without the agent's entry, and
an agent under Slurm loads this module only once its head-planned workers are spawned
(named tuples of ``collections``: an agent loads no ``typing``, ~4 ms of CPU; the
type checker sees typing's).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import Any, NamedTuple

    from ..config import LaunchConfig
    from ..store.client import StoreAddress
    from ..topology import WorkerSlot

    class _Seat(NamedTuple):
        node_rank: int
        num_nodes: int
        first_rank: int
        world_size: int
        master_addr: str
        master_port: int

    class _Job(NamedTuple):
        config: LaunchConfig
        store: StoreAddress
        node: dict[str, Any]  # NodeOptions(**node)
        env: dict[str, str]  # --env-all: set in the agent, which its workers inherit
        master_addr: str
        first: PlannedSeat | None = None

else:  # the same records, without typing's NamedTuple (an agent loads this after its spawn)
    from collections import namedtuple

    _Seat = namedtuple("_Seat", "node_rank num_nodes first_rank world_size master_addr master_port")
    _Job = namedtuple("_Job", "config store node env master_addr first", defaults=(None,))


class PlannedSeat(_Seat):
    """Round 0's seat of one node as the head plans it (head mode: plan 0 has every host,
    in host order, so ranks follow from the hosts' slots), with node 0's address and the
    MASTER_PORT the head chose (free on node 0's machine, which the head found it runs
    on): the agent starts its round-0 workers from it before it meets the rendezvous
    (``specs.start_planned_round``), which then seats it the same (the node agent checks).
    Here, not in ``specs``: the head builds it without importing what starts workers."""

    __slots__ = ()

    def slots(self, count: int) -> list[WorkerSlot]:
        """This node's ``count`` worker slots in the planned seat."""
        from ..topology import seat_slots

        return seat_slots(self.first_rank, count, self.node_rank, self.world_size, self.num_nodes)


def plan_first_round(slots: list[int], master_addr: str, master_port: int) -> dict[int, PlannedSeat]:
    """Round 0 as the head plans it for hosts with ``slots`` workers each (host order =
    node rank, as plan 0 lists every host), MASTER_ADDR:PORT ``master_addr``:``master_port``
    for all. Pure."""
    from itertools import accumulate

    firsts = [0, *accumulate(slots)]
    world = firsts.pop()
    return {k: PlannedSeat(k, len(slots), f, world, master_addr, master_port) for k, f in enumerate(firsts)}


class JobSpec(_Job):
    """What the head sends one node's agent (it holds the store's secret: stdin only).
    As JSON (``to_dict``): ``{"config": LaunchConfig.to_dict(), "store": [host, port],
    "token": secret, "node": NodeOptions' keyword arguments (node_id set; the others
    default), "env": {variables for the agent and its workers}, "master_addr": the
    address to announce as MASTER_ADDR, "first": PlannedSeat's fields, or absent}``.
    ``node`` is kept as keyword arguments so that the head need not import the node
    agent's module to build a spec. ``first`` (head mode): round 0 as the head planned
    it; the agent starts its workers from it at once."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        d = {
            "config": self.config.to_dict(),
            "store": [self.store.host, self.store.port],
            "token": self.store.token,
            "node": dict(self.node),
            "env": self.env,
            "master_addr": self.master_addr,
        }
        if self.first is not None:
            d["first"] = self.first._asdict()
        return d

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> JobSpec:
        from ..config import LaunchConfig
        from ..store.client import StoreAddress

        host, port = spec["store"]
        first = spec.get("first")
        return cls(
            LaunchConfig.from_dict(spec["config"]),
            StoreAddress(host, port, spec["token"]),
            dict(spec["node"]),
            spec.get("env", {}),
            spec["master_addr"],
            PlannedSeat(**first) if first is not None else None,
        )
