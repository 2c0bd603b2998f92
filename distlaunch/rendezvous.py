"""Rendezvous rounds between node agents, built only on the store client.

One round = one attempt to run every node's workers together; the keys and stop causes
of a round are defined in ``rounds.py``, and what follows a round in ``policy.py``. This
module is the only one that reads or writes those keys.

Ranks are contiguous per node in node-rank order (topology.assign_ranks), as torchrun's
static rendezvous assigns them.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import LaunchInterrupted, RendezvousError, StoreTimeoutError
from .rounds import Cause, Lost, Over, RoundKeys, Signal, agent_exit_key, decode_cause, encode_cause

if TYPE_CHECKING:  # imported by the agent when it connects: not on this module's import path
    from .store import StoreClient

# Blocking rendezvous waits go in slices this long (seconds) to look for a stop signal
# recorded by another node, and to report a wait that lasts.
SLICE = 1.0


class WaitReport:
    """Schedules progress lines for a wait that lasts: ``due()`` returns the seconds
    waited when a line is due, else None. Lines fall due after ``first`` s, then each
    time the wait has doubled, then every ``cap`` s (2, 4, 8, ... 64, 124, ... for
    ``first`` = 2). Never blocks."""

    def __init__(self, first: float, cap: float = 60.0):
        self.start = time.monotonic()
        self.cap = cap
        self.next = self.start + first

    def due(self) -> float | None:
        now = time.monotonic()
        if now < self.next:
            return None
        waited = now - self.start
        self.next = now + min(waited, self.cap)
        return waited


class LateJoin(RendezvousError):
    """Dynamic membership: this node arrived after round ``rnd`` closed with ``size``
    nodes; it joins the next round."""

    def __init__(self, rnd: int, size: int):
        super().__init__(f"rendezvous round {rnd} closed with {size} nodes before this node arrived")
        self.rnd, self.size = rnd, size


class Dropped(RendezvousError):
    """Head mode: the head left this node out of the next round."""


class PlanEnded(RendezvousError):
    """Head mode: the head ended the job after the previous round."""


@dataclass(frozen=True)
class Member:
    node_rank: int
    slots: int
    host: str
    addr: str


class Rendezvous:
    """The round protocol for one agent (``node_rank``) of a ``num_nodes`` job.

    ``store`` is a StoreClient used only from the agent's main thread;
    blocking calls honour ``join_timeout`` (seconds). Raises RendezvousError when nodes
    do not arrive in time, naming them, and LaunchInterrupted when another node recorded
    a stop signal for the round being joined. ``on_wait(text)``, if given, hears what a
    wait longer than a few seconds waits for, repeatedly (at growing intervals).
    """

    def __init__(
        self,
        store: StoreClient,
        run_id: str,
        node_rank: int,
        num_nodes: int,
        join_timeout: float = 600.0,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.join_timeout = join_timeout
        self.on_wait = on_wait

    def keys(self, rnd: int) -> RoundKeys:
        """The key names of round ``rnd`` of this job."""
        return RoundKeys(self.run_id, rnd)

    def _wait_all(
        self,
        keys: list[str] | Callable[[], list[str]],
        what: str,
        timeout: float,
        abort: Callable[[], bool] | None = None,
        rnd: int | None = None,
        report: float = 5.0,
        awaited: str | None = None,
    ) -> list[dict[str, Any]]:
        """Block until every key exists (``timeout`` s), waiting in SLICE-second slices;
        ``keys`` may be a callable re-read each slice (nodes found lost meanwhile drop
        out). Raises RendezvousError as soon as ``abort()`` is true, LaunchInterrupted
        when round ``rnd`` (if given) was stopped by a signal. Says what it still waits
        for (``awaited``, else the missing node ranks) through ``on_wait`` after
        ``report`` s, then at growing intervals."""
        end = time.monotonic() + timeout
        progress = WaitReport(report)
        current = keys() if callable(keys) else keys
        while True:
            left = end - time.monotonic()
            try:
                self.store.wait(current, timeout=max(0.001, min(left, SLICE)))
                break
            except StoreTimeoutError:
                if abort is not None and abort():
                    raise RendezvousError(f"{what}: the store stopped answering") from None
                if rnd is not None:
                    self.raise_if_signalled(rnd)
                current = keys() if callable(keys) else keys
                if time.monotonic() >= end:
                    missing = awaited or self._missing(current)
                    raise RendezvousError(
                        f"{what}: gave up waiting for {missing} after {timeout:g} s"
                    ) from None
                if self.on_wait is not None and (waited := progress.due()) is not None:
                    missing = awaited or self._missing(current)
                    self.on_wait(f"{what}: waiting for {missing} ({waited:.0f} s of {timeout:g} s)")
        return [json.loads(v) for v in self.store.multi_get(current)]

    def _missing(self, keys: list[str]) -> str:
        """``node(s) 1, 3``: the node ranks of the keys (``.../<K>``) that do not exist yet."""
        return (
            f"node(s) {', '.join(k.rsplit('/', 1)[1] for k, ok in zip(keys, self._present(keys)) if not ok)}"
        )

    def raise_if_signalled(self, rnd: int) -> None:
        """Raise LaunchInterrupted if a node recorded a stop signal for round ``rnd``."""
        cause = self.stop_cause(rnd)
        if isinstance(cause, Signal):
            raise LaunchInterrupted(cause.signum)

    def _present(self, keys: list[str]) -> list[bool]:
        return [self.store.check([k]) for k in keys]

    def join(self, rnd: int, slots: int, host: str, addr: str) -> list[Member]:
        """Publish this node's slots for round ``rnd`` and block until every node has;
        returns all members in node-rank order."""
        self.store.set(
            self.keys(rnd).node(self.node_rank), json.dumps({"slots": slots, "host": host, "addr": addr})
        )
        return self.members(rnd, self.join_timeout)

    def members(self, rnd: int, timeout: float) -> list[Member]:
        """Every node of round ``rnd`` (``num_nodes`` of them), in node-rank order; blocks
        until all have joined, at most ``timeout`` s."""
        keys = [self.keys(rnd).node(k) for k in range(self.num_nodes)]
        infos = self._wait_all(keys, f"rendezvous round {rnd}", timeout, rnd=rnd)
        return [Member(k, i["slots"], i["host"], i["addr"]) for k, i in enumerate(infos)]

    def join_dynamic(
        self, rnd: int, min_nodes: int, max_nodes: int, last_call: float, slots: int, host: str, addr: str
    ) -> list[Member]:
        """Dynamic membership (torchrun's c10d rendezvous with ``--nnodes MIN:MAX``): take
        a node rank by arrival order, wait until at least ``min_nodes`` arrived (up to
        ``join_timeout`` s), then ``last_call`` more seconds for others (up to
        ``max_nodes``). The first node to close the round fixes its size; sets
        ``node_rank`` and ``num_nodes`` for this round and returns the members. Polls the
        counter every 20 ms (rendezvous is not a hot path). Raises RendezvousError when
        too few nodes arrive, LateJoin when this node came after the round closed."""
        joined = self.keys(rnd).joined
        arrived = self.store.add(joined, 1)
        me = arrived - 1
        count = lambda: self.store.add(joined, 0)  # noqa: E731
        progress = WaitReport(5.0)
        checked = time.monotonic()
        end = checked + self.join_timeout
        while (n := count()) < min_nodes:
            now = time.monotonic()
            if now >= end:
                raise RendezvousError(
                    f"rendezvous round {rnd}: only {n} of at least {min_nodes} "
                    f"nodes arrived within {self.join_timeout:g} s"
                )
            if now - checked >= SLICE:
                checked = now
                self.raise_if_signalled(rnd)
                if self.on_wait is not None and (waited := progress.due()) is not None:
                    self.on_wait(
                        f"rendezvous round {rnd}: {n} of at least {min_nodes} nodes "
                        f"arrived; waiting for more ({waited:.0f} s of "
                        f"{self.join_timeout:g} s)"
                    )
            time.sleep(0.02)
        end = time.monotonic() + last_call
        while count() < max_nodes and time.monotonic() < end:
            time.sleep(0.02)
        size = min(count(), max_nodes)
        size = int(self.store.compare_set(self.keys(rnd).closed, b"", str(size)))
        if me >= size:
            raise LateJoin(rnd, size)
        self.node_rank, self.num_nodes = me, size
        return self.join(rnd, slots, host, addr)

    def publish_plan(self, rnd: int, members: list[int] | None, restarts: int = 0) -> None:
        """Head mode: who takes part in round ``rnd`` (node ids: the host's index in the
        host list), or, with ``members=None``, that the job ends."""
        plan = {"end": True} if members is None else {"members": members, "restarts": restarts}
        self.store.set(self.keys(rnd).plan, json.dumps(plan))

    def follow_plan(self, rnd: int, node_id: int) -> int:
        """Head mode: block until the head's plan for round ``rnd``; take this node's rank
        from it and return the restart count. Raises Dropped or PlanEnded."""
        plan = json.loads(self.store.get(self.keys(rnd).plan, timeout=self.join_timeout))
        if plan.get("end"):
            raise PlanEnded(f"the head ended the job after round {rnd - 1}")
        if node_id not in plan["members"]:
            raise Dropped(f"the head left this node out of round {rnd}")
        self.node_rank, self.num_nodes = plan["members"].index(node_id), len(plan["members"])
        return plan["restarts"]

    def publish_master(self, rnd: int, addr: str, port: int, restarts: int) -> None:
        """Node 0: MASTER_ADDR/MASTER_PORT of round ``rnd`` and the job's restart count (a
        node that joined late learns it here)."""
        self.store.set(self.keys(rnd).master, json.dumps({"addr": addr, "port": port, "restarts": restarts}))

    def master(self, rnd: int) -> tuple[str, int, int]:
        """Round ``rnd``'s MASTER_ADDR, MASTER_PORT and restart count; blocks until node 0
        published them (``join_timeout`` s)."""
        (m,) = self._wait_all(
            [self.keys(rnd).master],
            f"rendezvous round {rnd}",
            self.join_timeout,
            rnd=rnd,
            awaited="node 0 to publish MASTER_ADDR",
        )
        return m["addr"], m["port"], m["restarts"]

    def wait_members_done(self, rnd: int, size: int, timeout: float) -> None:
        """Block until round ``rnd``'s ``size`` members passed their exit barrier."""
        self._wait_all([self.keys(rnd).done(k) for k in range(size)], f"end of round {rnd}", timeout, rnd=rnd)

    def publish_pgids(self, rnd: int, pgids: list[list[int]]) -> None:
        """Record this node's agent pid and worker process groups (the head kills them over
        a fresh SSH exec if the agent stops answering)."""
        self.store.set(self.keys(rnd).pgids(self.node_rank), json.dumps(pgids))

    def pgids(self, rnd: int, node_rank: int) -> bytes | None:
        """Head mode: what node ``node_rank`` of round ``rnd`` recorded with
        :meth:`publish_pgids` (raw: the reader validates it), None if nothing."""
        key = self.keys(rnd).pgids(node_rank)
        return self.store.get(key) if self.store.check([key]) else None

    def request_stop(self, rnd: int, cause: Cause) -> Cause:
        """Stop round ``rnd`` for ``cause`` unless another cause came first; returns the
        cause that stands."""
        return decode_cause(self.store.compare_set(self.keys(rnd).stop, b"", encode_cause(cause)))

    def stop_rounds(self, first: int, end: int, cause: Cause) -> None:
        """Head mode: stop rounds ``first`` to ``end - 1`` for ``cause``: the one running
        and any the head may still plan."""
        raw = encode_cause(cause)
        for rnd in range(first, end):
            self.store.compare_set(self.keys(rnd).stop, b"", raw)

    def stop_cause(self, rnd: int) -> Cause | None:
        k = self.keys(rnd).stop
        return decode_cause(self.store.get(k)) if self.store.check([k]) else None

    def stand_in(self, rnd: int, node_rank: int, slots: int, host: str) -> None:
        """Head mode: node ``node_rank``'s agent is gone; fill in its part of round
        ``rnd``'s join (unless it joined) and of its exit barrier, so the others go on."""
        k = self.keys(rnd)
        self.store.compare_set(k.node(node_rank), b"", json.dumps({"slots": slots, "host": host, "addr": ""}))
        self.store.set(k.done(node_rank), b"1")

    def recorded(self, rnd: int, node_ranks: list[int]) -> set[int]:
        """Those of ``node_ranks`` that recorded their processes in round ``rnd`` (their
        workers started)."""
        return {k for k in node_ranks if self.store.check([self.keys(rnd).pgids(k)])}

    def outcome(self) -> tuple[int, Cause | None]:
        """Head mode: the restart count of the last round that was stopped and its cause
        (None: success). Before any round stopped: (0, a Lost cause saying no agent
        joined)."""
        rnd = 0
        last: Cause | None = Lost(0, "no agent joined the job")
        while (cause := self.stop_cause(rnd)) is not None:
            last = None if isinstance(cause, Over) else cause
            rnd += 1
        plan = self.keys(max(rnd - 1, 0)).plan
        restarts = json.loads(self.store.get(plan)).get("restarts", 0) if self.store.check([plan]) else 0
        return restarts, last

    def record_agent_exit(self, node_id: int) -> None:
        """Head mode: this agent (host ``node_id``) ends normally."""
        self.store.set(agent_exit_key(self.run_id, node_id), b"1")

    def agent_exited(self, node_id: int) -> bool:
        """Head mode: whether host ``node_id``'s agent recorded a normal end."""
        return self.store.check([agent_exit_key(self.run_id, node_id)])

    def finish(
        self,
        rnd: int,
        timeout: float,
        lost: Callable[[], Collection[int]] = frozenset,
        abort: Callable[[], bool] | None = None,
    ) -> Cause | None:
        """Exit barrier: say this node's workers are done, wait (up to ``timeout`` s, or
        until ``abort()``) for every node not in ``lost()`` (re-read while waiting: a node
        can be found lost meanwhile), and return the cause that stopped the round (None:
        every worker succeeded)."""
        k = self.keys(rnd)
        self.store.set(k.done(self.node_rank), b"1")
        keys = lambda: [
            k.done(n)
            for n in range(self.num_nodes)  # noqa: E731
            if n not in lost()
        ]
        self._wait_all(keys, f"exit barrier of round {rnd}", timeout, abort or (lambda: False), report=10.0)
        cause = self.request_stop(rnd, Over())  # also releases every watcher
        return None if isinstance(cause, Over) else cause

    def leave(self, rnd: int) -> int:
        return self.store.add(self.keys(rnd).left, 1)

    def wait_left(
        self, rnd: int, count: int, timeout: float, abort: Callable[[], bool] = lambda: False
    ) -> None:
        """The store's host: block until ``count`` agents read the outcome, ``timeout``
        seconds pass, or ``abort()`` is true (polled every 10 ms)."""
        end = time.monotonic() + timeout
        while self.store.add(self.keys(rnd).left, 0) < count and time.monotonic() < end and not abort():
            time.sleep(0.01)

    def arrived(self, rnd: int) -> int:
        """How many nodes announced themselves in round ``rnd`` so far (with dynamic
        membership, late ones included)."""
        joined = self.keys(rnd).joined
        if self.store.check([joined]):
            return self.store.add(joined, 0)
        return sum(self._present([self.keys(rnd).node(k) for k in range(self.num_nodes)]))


class StopWatcher:
    """A thread that waits on round ``rnd``'s stop key over its own store connection and
    calls ``wake(reason)`` once: "stop" when the key appears, "lost" when the store
    connection drops (the head or the store's node died)."""

    def __init__(self, client: StoreClient, rdzv: Rendezvous, rnd: int, wake: Callable[[str], None]) -> None:
        self.client = client
        self.key = rdzv.keys(rnd).stop
        self.wake = wake
        self.thread = threading.Thread(target=self._run, name=f"stop-watcher-r{rnd}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from .errors import StoreError

        try:
            self.client.wait([self.key], timeout=math.inf)
            self.wake("stop")
        except StoreError:
            self.wake("lost")


class Heartbeat:
    """Every ``interval`` seconds: bump this node's counter for round ``rnd`` and check the
    others'. A node whose counter has not moved for ``timeout`` seconds is reported once
    through ``on_lost(node_rank, seconds)``. A store that does not answer within
    ``timeout`` (frozen, or cut off while the connection stays up) or drops the
    connection is reported once through ``on_store_lost()``. Uses its own store
    connection; stops with ``stop()``."""

    def __init__(
        self,
        client: StoreClient,
        rdzv: Rendezvous,
        rnd: int,
        interval: float,
        timeout: float,
        on_lost: Callable[[int, float], object],
        on_store_lost: Callable[[], object],
    ) -> None:
        self.client, self.rdzv, self.rnd = client, rdzv, rnd
        self.interval, self.timeout, self.on_lost = interval, timeout, on_lost
        self.on_store_lost = on_store_lost
        client.set_timeout(timeout)
        self.lost: set[int] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from .errors import StoreError

        r = self.rdzv
        keys = [r.keys(self.rnd).hb(k) for k in range(r.num_nodes)]
        last: dict[int, tuple[int, float]] = {}
        try:
            while not self._stop.wait(self.interval):
                self.client.add(keys[r.node_rank], 1)
                now = time.monotonic()
                for k, key in enumerate(keys):
                    if k == r.node_rank or k in self.lost:
                        continue
                    beat = self.client.add(key, 0)
                    if k not in last or last[k][0] != beat:
                        last[k] = (beat, now)
                    elif now - last[k][1] >= self.timeout:
                        self.lost.add(k)
                        self.on_lost(k, now - last[k][1])
        except StoreError:
            if not self._stop.is_set():
                self.on_store_lost()
        finally:
            self.client.close()

    def stop(self) -> None:
        self._stop.set()
