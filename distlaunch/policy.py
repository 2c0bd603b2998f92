"""What happens after a round: one pure decision per restart policy, from what is known
about the round that ended (its history) and the cause that stopped it, to restart /
continue with these members / end with this error (torch's dynamic rendezvous has the
same shape: state + pure decision, executed against the store by the agent).

- :class:`FixedSize`: a fixed ``--nnodes`` job (and a single node): restart after a
  worker failure while restarts remain; a lost node ends the job.
- :class:`DynamicMembership`: ``--nnodes MIN:MAX``: as fixed size, and a joining node or
  a lost node starts a new round (not a restart) while at least MIN nodes remain.
- :class:`HeadPlanned`: head mode: the head decides the next round's members, dropping
  a lost host, or one whose workers failed in two consecutive rounds, while at least
  ``--min-nodes`` hosts remain (Horovod's elastic driver).

Every policy returns one :data:`Decision` (:class:`Restart` | :class:`Continue` |
:class:`End`), which the per-node agents (agent/node.py) and the head's controller
(head_controller.py) execute. No store, no processes, no I/O: every decision is a value
(tests/test_rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import DistlaunchError, LaunchInterrupted, RendezvousError, WorkerFailedError
from .rounds import Cause, Failure, Join, Lost, Signal, WorkerFailure


@dataclass(frozen=True)
class _Effects:
    """What a head-planned decision does besides the next round (empty for the per-node
    policies): ``drops``, the hosts left out from now on (host id, why), and ``kill``, the
    host whose lost agent is killed (it may still run, e.g. stopped, or cut off from the
    store)."""

    drops: tuple[tuple[int, str], ...] = field(default=(), kw_only=True)
    kill: int | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Restart(_Effects):
    """Start a new round after a failure, with restart count ``restarts``; ``members``:
    the node ids taking part (head mode), None: whoever joins. ``note``: tell the user."""

    restarts: int
    members: tuple[int, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class Continue(_Effects):
    """Start a new round that is not a restart (membership changed): the restart count
    stays ``restarts``; ``members`` and ``note`` as for :class:`Restart`."""

    restarts: int
    members: tuple[int, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class End(_Effects):
    """The job ends. ``error``: what the agent raises (None in head mode, where the
    agents report the round's cause themselves); ``note``: why, when worth saying."""

    error: DistlaunchError | None = None
    note: str = ""


# The one decision type of every policy, per-node and head-planned alike: the per-node
# agents (agent/node.py) and the head's controller (head_controller.py) execute it.
Decision = Restart | Continue | End


def describe_failure(f: WorkerFailure) -> str:
    return f"rank {f.rank} (local rank {f.local_rank}) on node {f.node_rank} ({f.host}) {f.how}"


def error_for(cause: Cause) -> DistlaunchError:
    """The exception for the cause that ended the job, which the CLI maps to an exit code
    and a summary (a failure carries the root cause)."""
    if isinstance(cause, Signal):
        return LaunchInterrupted(cause.signum)
    if isinstance(cause, Lost):
        return RendezvousError(
            f"node {cause.node} was lost ({cause.why}); workers stopped on every other node"
        )
    if isinstance(cause, Failure):
        f = cause.failure
        return WorkerFailedError(describe_failure(f), f, f.exit_code)
    raise ValueError(f"{cause!r} does not end a job")


@dataclass(frozen=True)
class History:
    """A node's view of the round that ended: its number ``rnd``, the restart count it ran
    with, its size, and the node ranks this node found lost in it."""

    rnd: int
    restarts: int
    num_nodes: int = 1
    lost: frozenset[int] = frozenset()


def _restart_after_failure(h: History, cause: Cause, max_restarts: int) -> Restart | None:
    if isinstance(cause, Failure) and h.restarts < max_restarts:
        return Restart(
            h.restarts + 1,
            note=(
                f"worker group failed ({describe_failure(cause.failure)}); restarting "
                f"(restart {h.restarts + 1} of {max_restarts})"
            ),
        )
    return None


@dataclass(frozen=True)
class FixedSize:
    """A fixed number of nodes: every round has all of them."""

    max_restarts: int
    heartbeat_timeout: float  # seconds: named when a node was lost

    def decide(self, h: History, cause: Cause) -> Decision:
        if h.lost and not isinstance(cause, Signal):
            # Static membership cannot go on without a node, whatever stopped the round.
            return End(
                RendezvousError(
                    f"node {', '.join(map(str, sorted(h.lost)))} was lost (no heartbeat for "
                    f"{self.heartbeat_timeout:g} s); a fixed --nnodes job cannot continue without it"
                )
            )
        return _restart_after_failure(h, cause, self.max_restarts) or _join_or_end(h, cause)


@dataclass(frozen=True)
class DynamicMembership:
    """Between ``min_nodes`` and some maximum nodes; arrivals and losses change rounds."""

    max_restarts: int
    min_nodes: int

    def decide(self, h: History, cause: Cause) -> Decision:
        if restart := _restart_after_failure(h, cause, self.max_restarts):
            return restart
        if isinstance(cause, Lost):
            remaining = h.num_nodes - len(h.lost)
            if remaining >= self.min_nodes:
                return Continue(
                    h.restarts,
                    note=(
                        f"node {cause.node} was lost ({cause.why}); continuing with {remaining} "
                        f"node(s) in round {h.rnd + 1} (not a restart)"
                    ),
                )
            return End(
                RendezvousError(
                    f"node {cause.node} was lost ({cause.why}); {remaining} "
                    f"node(s) remain, fewer than the minimum {self.min_nodes}"
                )
            )
        return _join_or_end(h, cause)


def _join_or_end(h: History, cause: Cause) -> Decision:
    if isinstance(cause, Join):
        return Continue(h.restarts, note=f"a node joined: new rendezvous round {h.rnd + 1} (not a restart)")
    return End(error_for(cause))


@dataclass(frozen=True)
class HeadHistory:
    """The head's view of the job: this round's ``members`` (host ids, in node-rank
    order) and restart count, the hosts whose agents are ``dead``, and ``streak``: (host
    id, consecutive rounds its workers failed)."""

    members: tuple[int, ...]
    restarts: int = 0
    dead: frozenset[int] = frozenset()
    streak: tuple[int | None, int] = (None, 0)


def _streak(h: HeadHistory, cause: Failure) -> tuple[int, int]:
    """(host id, consecutive rounds its workers failed) once ``cause`` is counted."""
    bad = h.members[cause.failure.node_rank]
    return bad, h.streak[1] + 1 if h.streak[0] == bad else 1


@dataclass(frozen=True)
class HeadPlanned:
    """The head plans every round (``r<R>/plan``); agents follow."""

    max_restarts: int
    min_nodes: int

    def max_rounds(self, num_hosts: int) -> int:
        """More rounds than a job of ``num_hosts`` hosts can have: round 0, one per
        restart, one per dropped host, and one spare."""
        return self.max_restarts + num_hosts + 2

    def decide(self, h: HeadHistory, cause: Cause) -> Decision:
        """The next round's members and restart count, the hosts dropped and the host to
        kill; :meth:`next_history` is the head's view once it is executed."""
        members, restarts = h.members, h.restarts
        drop = set(h.dead)
        drops: list[tuple[int, str]] = []
        kill = None
        if isinstance(cause, Failure):
            if restarts >= self.max_restarts:
                return End()
            restarts += 1
            bad, n = _streak(h, cause)
            if n >= 2 and len(members) - 1 >= self.min_nodes:
                drop.add(bad)
                drops.append((bad, f"its workers failed in {n} consecutive rounds"))
        elif isinstance(cause, Lost):
            kill = lost = members[cause.node]
            drop.add(lost)
            drops.append((lost, cause.why))
        else:  # a stop signal
            return End()
        left = tuple(m for m in members if m not in drop)
        if len(left) < self.min_nodes:
            return End(
                note=f"{len(left)} host(s) left, fewer than --min-nodes {self.min_nodes}",
                drops=tuple(drops),
                kill=kill,
            )
        step = Restart if isinstance(cause, Failure) else Continue
        return step(restarts, left, drops=tuple(drops), kill=kill)

    def next_history(self, h: HeadHistory, cause: Cause, decision: Decision) -> HeadHistory:
        """The head's view after it executed ``decision`` (:meth:`decide`'s for ``h`` and
        ``cause``): the next round's members and restart count, a killed host among the
        dead, the failure streak counted. Unchanged when the job ends."""
        if isinstance(decision, End):
            return h
        assert decision.members is not None  # the head names every round's members
        dead = h.dead if decision.kill is None else h.dead | {decision.kill}
        streak = _streak(h, cause) if isinstance(cause, Failure) else h.streak
        return HeadHistory(decision.members, decision.restarts, dead, streak)
