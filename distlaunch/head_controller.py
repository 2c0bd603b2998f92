"""The head's side of every round (head mode): it shows the start-up status, reports
each round and its end (events), and executes the head-planned policy
(``policy.HeadPlanned``): publishes each next round's plan, reports drops, and has a lost
host's processes killed.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .config import LaunchConfig
from .errors import DistlaunchError, StoreTimeoutError
from .events import EventLog, round_end_event, round_event
from .hosts import Host, slots_of
from .rendezvous import Rendezvous
from .report import live, progress
from .rounds import Cause, Lost, Over

if TYPE_CHECKING:
    from .policy import HeadHistory, HeadPlanned
    from .store import StoreClient


class HeadController:
    """Runs on its own thread and store connection (``client``, closed at its end).

    Start-up status: "starting W workers on N hosts: k/W ready" through
    ``report.progress`` (only followed when the reporter is live). ``kill(host id)`` is called (on this
    thread) for a host whose agent was lost.

    ``agent_gone(id, status)`` (any thread): an agent ended before the job; its round is
    stopped and its part of the round's barriers is filled in, so the others go on.
    """

    def __init__(
        self,
        client: StoreClient,
        cfg: LaunchConfig,
        hosts: list[Host],
        min_nodes: int,
        events: EventLog,
        kill: Callable[[int], None],
    ) -> None:
        self.client, self.hosts = client, hosts
        self.events, self.kill = events, kill
        self._limits = (cfg.max_restarts, min_nodes)
        # the policy and the head's view of the job (policy.py) are built once a round
        # stops or an agent is gone: a job that succeeds needs neither (~4 ms of imports)
        self._policy: HeadPlanned | None = None
        self._history: HeadHistory | None = None
        self.rdzv = Rendezvous(client, cfg.run_id, 0, len(hosts))
        self.rnd = 0
        self.plans = {0: tuple(range(len(hosts)))}  # round -> member ids
        self.rdzv.publish_plan(0, list(self.plans[0]), 0)
        self._gone: queue.SimpleQueue[tuple[int, int | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="head-controller", daemon=True)
        self.thread.start()

    @property
    def policy(self) -> HeadPlanned:
        """The head-planned policy (``policy.HeadPlanned``) of this job, built at its
        first use: a job that succeeds never loads ``policy``. (The main thread, on a
        stop signal, and the controller's may both build it: equal frozen objects.)"""
        if self._policy is None:
            from .policy import HeadPlanned

            self._policy = HeadPlanned(*self._limits)
        return self._policy

    @property
    def history(self) -> HeadHistory:
        """The head's view of the job (``policy.HeadHistory``; the controller's thread)."""
        if self._history is None:
            from .policy import HeadHistory

            self._history = HeadHistory(self.plans[0])
        return self._history

    @history.setter
    def history(self, h: HeadHistory) -> None:
        self._history = h

    def agent_gone(self, node_id: int, status: int | None) -> None:
        self._gone.put((node_id, status))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(2.0)

    def _wait(self, key: str) -> bool:
        while not self._stop.is_set():
            self._handle_gone()
            try:
                self.client.wait([key], timeout=0.1)
                return True
            except StoreTimeoutError:
                pass
        return False

    def _handle_gone(self) -> None:
        while True:
            try:
                node_id, status = self._gone.get_nowait()
            except queue.Empty:
                return
            h = self.history
            self.history = dataclasses.replace(h, dead=h.dead | {node_id})
            if node_id in h.members:
                rank, host = h.members.index(node_id), self.hosts[node_id]
                self.rdzv.request_stop(
                    self.rnd, Lost(rank, (f"agent on {host.name} ended with status {status}"))
                )
                self.rdzv.stand_in(self.rnd, rank, slots_of(host), host.name)

    def _startup(self) -> None:
        total = sum(slots_of(h) for h in self.hosts)
        ready: set[int] = set()
        while not self._stop.is_set():
            ready |= self.rdzv.recorded(0, [k for k in range(len(self.hosts)) if k not in ready])
            done = len(ready) == len(self.hosts)
            progress(
                f"starting {total} workers on {len(self.hosts)} hosts: "
                f"{sum(slots_of(self.hosts[k]) for k in ready)}/{total} ready",
                done,
            )
            if done:
                return
            self._stop.wait(0.1)
            self._handle_gone()

    def _run(self) -> None:
        r = self.rdzv
        try:
            if live():
                self._startup()
            while self._wait(r.keys(self.rnd).master):
                r.num_nodes = len(self.plans[self.rnd])  # (the history's members)
                _, _, restarts = r.master(self.rnd)
                members = r.members(self.rnd, 30.0)
                workers = sum(m.slots for m in members)
                self.events.emit(round_event(self.rnd, restarts, members, len(members), workers))
                if not self._wait(r.keys(self.rnd).stop):
                    return
                cause = r.stop_cause(self.rnd)
                cause = None if isinstance(cause, Over) else cause
                self.events.emit(round_end_event(self.rnd, cause))
                if cause is None or not self._plan_next(cause):
                    return
        except DistlaunchError:
            pass  # the store went away: the job is over
        finally:
            self.client.close()

    def _plan_next(self, cause: Cause) -> bool:
        """Decide the next round after ``cause`` (the policy) and execute the decision:
        kill, report drops, publish the plan; False when the job ends."""
        from .policy import End

        decision = self.policy.decide(self.history, cause)
        if decision.kill is not None:
            self.kill(decision.kill)  # it may still run (e.g. stopped, or cut off from the store)
        for node_id, why in decision.drops:
            self.events.emit({"event": "drop", "host": self.hosts[node_id].name, "why": why})
        if isinstance(decision, End):
            if decision.note:
                self.events.emit({"event": "end", "why": decision.note})
            self.rdzv.publish_plan(self.rnd + 1, None)
            return False
        self.history = self.policy.next_history(self.history, cause, decision)
        self.rnd += 1
        self.plans[self.rnd] = self.history.members
        self.rdzv.publish_plan(self.rnd, list(self.history.members), self.history.restarts)
        return True

    def pgids(self, rdzv: Rendezvous, node_id: int) -> list[tuple[int, int]]:
        """The agent pid and worker process groups a host recorded most recently, read
        through ``rdzv`` (the caller's connection), as validated ``(pid, start time)``
        records (agent.kill); [] when none is valid."""
        from .agent.kill import parse_records

        for rnd in range(self.rnd, -1, -1):
            members = self.plans.get(rnd, ())
            raw = rdzv.pgids(rnd, members.index(node_id)) if node_id in members else None
            if raw is not None:
                try:
                    return parse_records(raw)
                except ValueError:
                    return []  # malformed or hostile: act on nothing
        return []
