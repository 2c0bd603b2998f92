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

No store, no processes, no I/O: every decision is a value (tests/test_rounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DistlaunchError, LaunchInterrupted, RendezvousError, WorkerFailedError
from .rounds import Cause, Failure, Join, Lost, Signal, WorkerFailure


@dataclass(frozen=True)
class Restart:
    """Start a new round after a failure, with restart count ``restarts``; ``members``:
    the node ids taking part (head mode), None: whoever joins. ``note``: tell the user."""

    restarts: int
    members: tuple[int, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class Continue:
    """Start a new round that is not a restart (membership changed): the restart count
    stays ``restarts``; ``members`` and ``note`` as for :class:`Restart`."""

    restarts: int
    members: tuple[int, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class End:
    """The job ends. ``error``: what the agent raises (None in head mode, where the
    agents report the round's cause themselves); ``note``: why, when worth saying."""

    error: DistlaunchError | None = None
    note: str = ""


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


@dataclass(frozen=True)
class HeadStep:
    """A head-planned decision, the history it leads to, the hosts ``drops`` left out
    from now on (host id, why) and the host to ``kill`` (its agent was lost but may still
    run, e.g. stopped or cut off from the store)."""

    decision: Decision
    history: HeadHistory
    drops: tuple[tuple[int, str], ...] = ()
    kill: int | None = None


@dataclass(frozen=True)
class HeadPlanned:
    """The head plans every round (``r<R>/plan``); agents follow."""

    max_restarts: int
    min_nodes: int

    def max_rounds(self, num_hosts: int) -> int:
        """More rounds than a job of ``num_hosts`` hosts can have: round 0, one per
        restart, one per dropped host, and one spare."""
        return self.max_restarts + num_hosts + 2

    def decide(self, h: HeadHistory, cause: Cause) -> HeadStep:
        members, restarts = h.members, h.restarts
        drop, dead, streak = set(h.dead), h.dead, h.streak
        drops: list[tuple[int, str]] = []
        kill = None
        if isinstance(cause, Failure):
            if restarts >= self.max_restarts:
                return HeadStep(End(), h)
            restarts += 1
            bad = members[cause.failure.node_rank]
            streak = (bad, streak[1] + 1 if streak[0] == bad else 1)
            if streak[1] >= 2 and len(members) - 1 >= self.min_nodes:
                drop.add(bad)
                drops.append((bad, f"its workers failed in {streak[1]} consecutive rounds"))
        elif isinstance(cause, Lost):
            kill = lost = members[cause.node]
            drop.add(lost)
            dead = dead | {lost}
            drops.append((lost, cause.why))
        else:  # a stop signal
            return HeadStep(End(), h)
        left = tuple(m for m in members if m not in drop)
        history = HeadHistory(left, restarts, dead, streak)
        if len(left) < self.min_nodes:
            return HeadStep(
                End(note=f"{len(left)} host(s) left, fewer than --min-nodes {self.min_nodes}"),
                history,
                tuple(drops),
                kill,
            )
        step = Restart if isinstance(cause, Failure) else Continue
        return HeadStep(step(restarts, left), history, tuple(drops), kill)
