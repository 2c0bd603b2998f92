"""The agent's life as a state machine: its phases, the events that move it between
them, and the pure decisions of the joining phase. No store, no processes, no I/O:
``agent/node.py`` (and ``rendezvous.py`` for the join) execute what is decided here,
as torch elastic's agent keeps a ``WorkerState`` and its dynamic rendezvous turns the
observed state into an ``_Action`` that an executor carries out.

One round, seen from one node::

    after-round --next--> joining --seated--> admitted --started--> running
         ^                   |                                         |
         |                 late                                     stopped
         |                   v                                         v
         +--------------- after-round  <--passed-- barrier <--at-barrier-- stopping

An agent starts in ``after-round`` (before round 0, as between rounds: in head mode it
waits there for the head's plan), and any phase ends in ``done`` (the job ended: a
decision, success, a signal or an error).
"""

from __future__ import annotations

import enum


class AgentPhase(enum.Enum):
    """Where one node's agent is in the job."""

    JOINING = "joining"  # in round R's rendezvous: its slots published, waiting for the others
    ADMITTED = "admitted"  # has its seat: reads MASTER_ADDR, prepares its workers
    RUNNING = "running"  # workers run; the worker group relays signals to them
    STOPPING = "stopping"  # the round stopped and every worker exited; recording why
    BARRIER = "barrier"  # the exit barrier: waiting for every node's workers to be gone
    AFTER_ROUND = "after-round"  # between rounds: the policy (or the head's plan) says what follows
    DONE = "done"  # the job ended for this agent


class AgentEvent(enum.Enum):
    """What moves an agent from one phase to the next."""

    NEXT = "next"  # a next round: the first, a Restart or Continue decision, the head's plan
    SEATED = "seated"  # the rendezvous gave this node its seat (first rank, world size)
    LATE = "late"  # the round closed before this node arrived: it waits for the next one
    STARTED = "started"  # no signal since joining: the workers start
    STOPPED = "stopped"  # the worker group returned: every worker of the round has exited
    AT_BARRIER = "at-barrier"  # this node's workers are done: it enters the exit barrier
    PASSED = "passed"  # every node not lost passed the barrier: the round's cause is known
    END = "end"  # the job ends here: an End decision, success, a signal, an error


P, E = AgentPhase, AgentEvent

# (phase, event) -> next phase; END leads to DONE from every phase but DONE.
TRANSITIONS: dict[tuple[AgentPhase, AgentEvent], AgentPhase] = {
    (P.AFTER_ROUND, E.NEXT): P.JOINING,
    (P.JOINING, E.SEATED): P.ADMITTED,
    (P.JOINING, E.LATE): P.AFTER_ROUND,
    (P.ADMITTED, E.STARTED): P.RUNNING,
    (P.RUNNING, E.STOPPED): P.STOPPING,
    (P.STOPPING, E.AT_BARRIER): P.BARRIER,
    (P.BARRIER, E.PASSED): P.AFTER_ROUND,
    **{(p, E.END): P.DONE for p in AgentPhase if p is not P.DONE},
}


def advance(phase: AgentPhase, event: AgentEvent) -> AgentPhase:
    """The phase ``event`` leads to from ``phase``. Raises ValueError for an event the
    phase does not take (a bug in the agent, never a user's error)."""
    try:
        return TRANSITIONS[phase, event]
    except KeyError:
        raise ValueError(f"agent phase {phase.value}: no transition on {event.value}") from None


def spreads_signal(phase: AgentPhase) -> bool:
    """Whether a stop signal that ends ``phase`` must be written as the round's stop
    cause by this agent: while it is a member of the round and no workers run (joining,
    admitted, at the exit barrier). While workers run the group relays the signal and
    the round records it; between rounds, or as a late node, this node stops nobody."""
    return phase in (P.JOINING, P.ADMITTED, P.BARRIER)


# --- the joining phase with dynamic membership (--nnodes MIN:MAX) ---------------------------


class JoinAction(enum.Enum):
    """What a node does once it has taken its arrival number in a dynamic round."""

    CLOSE = "close"  # its arrival reached the maximum: close the round at once
    LAST_CALL = "last-call"  # it reached the minimum: wait the last call, then close unless closed
    AWAIT_CLOSE = "await-close"  # below the minimum: wait for a closer


def join_action(arrived: int, min_nodes: int, max_nodes: int) -> JoinAction:
    """The action of the node that arrived ``arrived``-th (1-based) in a round of
    ``min_nodes`` to ``max_nodes`` nodes, as torchrun's c10d rendezvous with its last
    call: the first closer fixes the size, everyone else waits on the one closed key."""
    if arrived >= max_nodes:
        return JoinAction.CLOSE
    if arrived >= min_nodes:
        return JoinAction.LAST_CALL
    return JoinAction.AWAIT_CLOSE


def closing_size(joined: int, max_nodes: int) -> int:
    """The size a closing node gives the round: everyone who joined so far, at most
    ``max_nodes`` (the first closer's size stands)."""
    return min(joined, max_nodes)


def admitted_rank(arrived: int, size: int) -> int | None:
    """This node's rank in a round that closed with ``size`` nodes (arrival order), or
    None when it arrived after the round closed (it joins the next one)."""
    return arrived - 1 if arrived <= size else None
