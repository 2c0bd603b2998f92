"""Rendezvous rounds between node agents, built only on the store client.

One round = one attempt to run every node's workers together; the keys and stop causes
of a round are defined in ``rounds.py``, what follows a round in ``policy.py``, and the
agent's phases and the join's decisions in ``agent/phases.py``. This module is the only
one that reads or writes those keys, and holds only that store I/O: it executes the
decisions made there.

Ranks are contiguous per node in node-rank order (topology.assign_ranks), as torchrun's
static rendezvous assigns them.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .agent.phases import JoinAction, admitted_rank, closing_size, join_action
from .errors import LaunchInterrupted, RendezvousError, StoreTimeoutError
from .rounds import Cause, Lost, Over, RoundKeys, Signal, agent_exit_key, decode_cause, encode_cause

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:  # imported by the agent when it connects: not on this module's import path
    from typing import Any

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


@dataclass(frozen=True)
class Seat:
    """A node's place in a round: its workers' first global rank and the world size
    (ranks are contiguous per node in node-rank order, as topology.assign_ranks)."""

    first_rank: int
    world_size: int


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

    def _wait_key(
        self, key: str, what: str, timeout: float, rnd: int, awaited: str | Callable[[], str]
    ) -> Any:
        """The JSON value of ``key``, blocking until it exists (``timeout`` s) in
        SLICE-second gets. Raises LaunchInterrupted when round ``rnd`` was stopped by a
        signal, RendezvousError at the timeout. Says what it waits for
        (``awaited``, a text or a callable making it) through ``on_wait`` after 5 s,
        then at growing intervals."""
        end = time.monotonic() + timeout
        progress = WaitReport(5.0)
        while True:
            left = end - time.monotonic()
            try:
                return json.loads(self.store.get(key, timeout=max(0.001, min(left, SLICE))))
            except StoreTimeoutError:
                self.raise_if_signalled(rnd)
                if time.monotonic() >= end:
                    text = awaited if isinstance(awaited, str) else awaited()
                    raise RendezvousError(f"{what}: gave up waiting for {text} after {timeout:g} s") from None
                if self.on_wait is not None and (waited := progress.due()) is not None:
                    text = awaited if isinstance(awaited, str) else awaited()
                    self.on_wait(f"{what}: waiting for {text} ({waited:.0f} s of {timeout:g} s)")

    def _nodes_missing(
        self, rnd: int, counter: str, key: Callable[[int], str], lost: Collection[int] = ()
    ) -> Callable[[], str]:
        """What a wait for the ``key`` of every node of round ``rnd`` not in ``lost``
        still waits for: node 0 names the nodes (one look per node, only when it
        reports), the others count them from ``counter`` (one look), so a report costs
        the store O(1) per node."""

        def text() -> str:
            if self.node_rank == 0:
                return self._missing([key(k) for k in range(self.num_nodes) if k not in lost])
            n = self.store.add(counter, 0)
            return f"{max(self.num_nodes - len(lost) - n, 1)} of {self.num_nodes} nodes"

        return text

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

    def join(self, rnd: int, slots: int, host: str, addr: str) -> Seat:
        """Publish this node's slots for round ``rnd`` and block until every node has;
        returns this node's seat. Costs O(1) store requests and bytes per node whatever
        the number of nodes: its own key, one ``add`` on the round's counter, one
        awaited key (its seat); the node whose ``add`` completes the count reads every
        node's key once and publishes the members and every seat (torch elastic's c10d
        rendezvous instead re-reads and rewrites a state that grows with the nodes on
        every join)."""
        k = self.keys(rnd)
        self.store.set(k.node(self.node_rank), json.dumps({"slots": slots, "host": host, "addr": addr}))
        self._count_in(rnd)
        first, world = self._wait_key(
            k.seat(self.node_rank),
            f"rendezvous round {rnd}",
            self.join_timeout,
            rnd,
            self._nodes_missing(rnd, k.ready, k.node),
        )
        return Seat(first, world)

    def _count_in(self, rnd: int) -> None:
        """Count a node whose key ``r<R>/node/<K>`` is set; the last one publishes the
        members and the seats (if a node is counted twice -- the head stood in for it,
        then it came -- the publisher's multi_get still waits for every node's key)."""
        k = self.keys(rnd)
        if self.store.add(k.ready, 1) != self.num_nodes:
            return
        keys = [k.node(n) for n in range(self.num_nodes)]
        try:
            infos = self.store.multi_get(keys, timeout=self.join_timeout)
        except StoreTimeoutError:
            return  # the others' waits time out too, naming the nodes that never came
        self.store.compare_set(k.members, b"", b"[" + b",".join(infos) + b"]")
        firsts = list(itertools.accumulate((json.loads(v)["slots"] for v in infos), initial=0))
        world = firsts.pop()
        self.store.multi_set([k.seat(n) for n in range(self.num_nodes)], [f"[{f},{world}]" for f in firsts])

    def members(self, rnd: int, timeout: float) -> list[Member]:
        """Every node of round ``rnd`` (``num_nodes`` of them), in node-rank order; blocks
        until all have joined, at most ``timeout`` s."""
        k = self.keys(rnd)
        infos = self._wait_key(
            k.members, f"rendezvous round {rnd}", timeout, rnd, self._nodes_missing(rnd, k.ready, k.node)
        )
        return [Member(n, i["slots"], i["host"], i["addr"]) for n, i in enumerate(infos)]

    def join_dynamic(
        self, rnd: int, min_nodes: int, max_nodes: int, last_call: float, slots: int, host: str, addr: str
    ) -> Seat:
        """Dynamic membership (torchrun's c10d rendezvous with ``--nnodes MIN:MAX``): take
        a node rank by arrival order (one ``add``), wait until at least ``min_nodes``
        arrived (up to ``join_timeout`` s), then ``last_call`` more seconds for others (up
        to ``max_nodes``). A node whose arrival reaches the minimum closes the round
        after its last call, the one reaching the maximum at once (the first closer fixes
        the size); every other node blocks on the one ``closed`` key (no polling). Sets
        ``node_rank`` and ``num_nodes`` for this round and returns this node's seat. Raises
        RendezvousError when too few nodes arrive, LateJoin when this node came after
        the round closed. Who closes, with what size, and who is seated are decided by
        agent.phases (pure); this executes it against the store."""
        k = self.keys(rnd)
        arrived = self.store.add(k.joined, 1)
        action = join_action(arrived, min_nodes, max_nodes)
        if action is JoinAction.CLOSE or (
            action is JoinAction.LAST_CALL and not self._wait_closed(rnd, last_call, None)
        ):
            self.store.compare_set(k.closed, b"", str(closing_size(self.store.add(k.joined, 0), max_nodes)))
        if not self._wait_closed(rnd, self.join_timeout, f"at least {min_nodes}"):
            n = self.store.add(k.joined, 0)
            raise RendezvousError(
                f"rendezvous round {rnd}: only {n} of at least {min_nodes} "
                f"nodes arrived within {self.join_timeout:g} s"
            )
        size = int(self.store.get(k.closed))
        rank = admitted_rank(arrived, size)
        if rank is None:
            raise LateJoin(rnd, size)
        self.node_rank, self.num_nodes = rank, size
        return self.join(rnd, slots, host, addr)

    def _wait_closed(self, rnd: int, timeout: float, wanted: str | None) -> bool:
        """Block until round ``rnd`` of a dynamic launch is closed (True) or ``timeout``
        s pass (False), in SLICE-second waits that look for a stop signal and report
        how many nodes arrived (``wanted``: of how many; None: no reports) through
        ``on_wait``."""
        key = self.keys(rnd).closed
        progress = WaitReport(5.0)
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return self.store.check([key])
            try:
                self.store.wait([key], timeout=max(0.001, min(left, SLICE)))
                return True
            except StoreTimeoutError:
                self.raise_if_signalled(rnd)
                if wanted is not None and self.on_wait is not None and (waited := progress.due()) is not None:
                    n = self.store.add(self.keys(rnd).joined, 0)
                    self.on_wait(
                        f"rendezvous round {rnd}: {n} of {wanted} nodes arrived; waiting for "
                        f"more ({waited:.0f} s of {timeout:g} s)"
                    )

    def publish_plan(self, rnd: int, members: list[int] | None, restarts: int = 0) -> None:
        """Head mode: who takes part in round ``rnd`` (node ids: the host's index in the
        host list), or, with ``members=None``, that the job ends."""
        plan = {"end": True} if members is None else {"members": members, "restarts": restarts}
        self.store.set(self.keys(rnd).plan, json.dumps(plan))

    def follow_plan(self, rnd: int, node_id: int) -> int:
        """Head mode: block until the head's plan for round ``rnd`` (up to the join
        timeout); take this node's rank from it and return the restart count. Raises
        Dropped, PlanEnded, LaunchInterrupted (a node recorded a stop signal for the
        round) or RendezvousError (no plan within the join timeout)."""
        # in SLICE-second waits: a stop signal that lands on another of the agent's
        # threads is handled only when the main thread runs Python code again
        plan = self._wait_key(self.keys(rnd).plan, f"round {rnd}", self.join_timeout, rnd, "the head's plan")
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
        m = self._wait_key(
            self.keys(rnd).master,
            f"rendezvous round {rnd}",
            self.join_timeout,
            rnd,
            "node 0 to publish MASTER_ADDR",
        )
        return m["addr"], m["port"], m["restarts"]

    def wait_members_done(self, rnd: int, size: int, timeout: float) -> None:
        """Block until round ``rnd``'s ``size`` members passed their exit barrier."""
        k = self.keys(rnd)
        self._wait_key(k.alldone, f"end of round {rnd}", timeout, rnd, f"the {size} nodes of round {rnd}")

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
        info = json.dumps({"slots": slots, "host": host, "addr": "", "stand_in": True}).encode()
        if self.store.compare_set(k.node(node_rank), b"", info) == info:
            self._count_in(rnd)
        if self.store.compare_set(k.done(node_rank), b"", b"s") == b"s":
            self.store.add(k.ndone, 1)

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
        mine = self.store.compare_set(k.done(self.node_rank), b"", b"1") == b"1"  # else the head's
        n = self.store.add(k.ndone, 1 if mine else 0)
        what = f"exit barrier of round {rnd}"
        progress = WaitReport(10.0)
        end = time.monotonic() + timeout
        gone = lost()
        while n < self.num_nodes - len(gone):
            left = end - time.monotonic()
            try:
                self.store.wait([k.alldone], timeout=max(0.001, min(left, SLICE)))
                break
            except StoreTimeoutError:
                if abort is not None and abort():
                    raise RendezvousError(f"{what}: the store stopped answering") from None
                n, gone = self.store.add(k.ndone, 0), lost()
                waiting = self._nodes_missing(rnd, k.ndone, k.done, gone)
                if time.monotonic() >= end:
                    raise RendezvousError(
                        f"{what}: gave up waiting for {waiting()} after {timeout:g} s"
                    ) from None
                if self.on_wait is not None and (waited := progress.due()) is not None:
                    self.on_wait(f"{what}: waiting for {waiting()} ({waited:.0f} s of {timeout:g} s)")
        else:
            self.store.set(k.alldone, b"1")  # releases the others' waits
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
        k = self.keys(rnd)
        return self.store.add(k.joined if self.store.check([k.joined]) else k.ready, 0)

    def lost_nodes(self, rnd: int) -> set[int]:
        """The nodes some node's heartbeat found lost in round ``rnd`` (one look)."""
        k = self.keys(rnd).lost
        raw = self.store.get(k) if self.store.check([k]) else b""
        return {int(x) for x in raw.decode().split(",") if x}


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
    """Every ``interval`` seconds: set this node's counter for round ``rnd`` and look at
    the counter of the next node in the ring (node K watches K+1, the last watches 0). A
    node whose counter has not moved for ``timeout`` seconds is found lost: it is added
    to ``lost`` and to the round's ``lost`` key, reported once through
    ``on_lost(node_rank, seconds)`` (which stops the round), and its watcher moves on to
    the node after it. So a node costs the store two operations per interval whatever
    the number of nodes (watching every node cost each node N); the others learn of the
    loss from the round's stop key (Rendezvous.lost_nodes names the lost). A store that
    does not answer within ``timeout`` (frozen, or cut off while the connection stays
    up) or drops the connection is reported once through ``on_store_lost()``. Uses its
    own store connection; stops with ``stop()``."""

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

    def watched(self, watching: int) -> int:
        """The node after ``watching`` in the ring that is not known lost (this node's own
        rank when every other one is)."""
        r = self.rdzv
        k = watching
        for _ in range(r.num_nodes):
            k = (k + 1) % r.num_nodes
            if k not in self.lost:
                return k
        return r.node_rank

    def _run(self) -> None:
        from .errors import StoreError

        r = self.rdzv
        keys = r.keys(self.rnd)
        mine, beats = keys.hb(r.node_rank), 0
        watching = self.watched(r.node_rank)
        last: tuple[int, float] | None = None
        try:
            while not self._stop.wait(self.interval):
                beats += 1
                self.client.set(mine, str(beats))  # no reply awaited (as TCPStore's set)
                if watching == r.node_rank:
                    continue
                beat = self.client.add(keys.hb(watching), 0)
                now = time.monotonic()
                if last is None or last[0] != beat:
                    last = (beat, now)
                elif now - last[1] >= self.timeout:
                    self.lost.add(watching)
                    self.client.append(keys.lost, f"{watching},")
                    self.on_lost(watching, now - last[1])
                    watching, last = self.watched(watching), None
        except StoreError:
            if not self._stop.is_set():
                self.on_store_lost()
        finally:
            self.client.close()

    def stop(self) -> None:
        self._stop.set()
