"""The agent's phases and the join's decisions (agent/phases.py) as tables: pure, no
processes, no store."""

import pytest

from distlaunch.agent.phases import (
    TRANSITIONS,
    AgentEvent,
    AgentPhase,
    JoinAction,
    admitted_rank,
    advance,
    closing_size,
    join_action,
    spreads_signal,
)

P, E = AgentPhase, AgentEvent

# Every transition there is; any other (phase, event) pair is refused.
TABLE = [
    (P.AFTER_ROUND, E.NEXT, P.JOINING),
    (P.JOINING, E.SEATED, P.ADMITTED),
    (P.JOINING, E.LATE, P.AFTER_ROUND),
    (P.ADMITTED, E.STARTED, P.RUNNING),
    (P.RUNNING, E.STOPPED, P.STOPPING),
    (P.STOPPING, E.AT_BARRIER, P.BARRIER),
    (P.BARRIER, E.PASSED, P.AFTER_ROUND),
    *[(p, E.END, P.DONE) for p in AgentPhase if p is not P.DONE],
]


@pytest.mark.parametrize("phase, event, after", TABLE)
def test_transition(phase, event, after):
    assert advance(phase, event) is after


def test_no_other_transition():
    allowed = {(p, e) for p, e, _ in TABLE}
    assert set(TRANSITIONS) == allowed
    for p in AgentPhase:
        for e in AgentEvent:
            if (p, e) not in allowed:
                with pytest.raises(ValueError, match=f"agent phase {p.value}: no transition on {e.value}"):
                    advance(p, e)


def walk(*events):
    phases, p = [], P.AFTER_ROUND  # where every agent starts
    for e in events:
        p = advance(p, e)
        phases.append(p)
    return phases


ROUND = [E.NEXT, E.SEATED, E.STARTED, E.STOPPED, E.AT_BARRIER, E.PASSED]


@pytest.mark.parametrize(
    "events, last",
    [
        ([*ROUND, E.END], P.DONE),  # one round that succeeded (or ended the job)
        ([*ROUND, *ROUND, E.END], P.DONE),  # a restart, then the end
        ([E.NEXT, E.LATE, *ROUND], P.AFTER_ROUND),  # a late node joins the next round
        ([E.NEXT, E.SEATED, E.END], P.DONE),  # a signal while preparing the workers
        ([E.END], P.DONE),  # dropped by the head, or a signal before round 0
    ],
)
def test_lives(events, last):
    assert walk(*events)[-1] is last


def test_done_is_final():
    for e in AgentEvent:
        with pytest.raises(ValueError):
            advance(P.DONE, e)


@pytest.mark.parametrize(
    "phase, spreads",
    [
        (P.AFTER_ROUND, False),  # between rounds (in head mode: waiting for the plan)
        (P.JOINING, True),
        (P.ADMITTED, True),
        (P.RUNNING, False),  # the worker group relays it; the round records it
        (P.STOPPING, False),
        (P.BARRIER, True),
        (P.DONE, False),
    ],
)
def test_which_phases_spread_a_stop_signal(phase, spreads):
    assert spreads_signal(phase) is spreads


@pytest.mark.parametrize(
    "arrived, min_nodes, max_nodes, action",
    [
        (1, 2, 4, JoinAction.AWAIT_CLOSE),
        (2, 2, 4, JoinAction.LAST_CALL),  # reaches the minimum: gives the others the last call
        (3, 2, 4, JoinAction.LAST_CALL),
        (4, 2, 4, JoinAction.CLOSE),  # reaches the maximum: closes at once
        (5, 2, 4, JoinAction.CLOSE),  # past it (late): closing again changes nothing
        (1, 1, 1, JoinAction.CLOSE),
        (1, 1, 3, JoinAction.LAST_CALL),
    ],
)
def test_join_action(arrived, min_nodes, max_nodes, action):
    assert join_action(arrived, min_nodes, max_nodes) is action


@pytest.mark.parametrize("joined, max_nodes, size", [(2, 4, 2), (4, 4, 4), (6, 4, 4)])
def test_closing_size(joined, max_nodes, size):
    assert closing_size(joined, max_nodes) == size


@pytest.mark.parametrize("arrived, size, rank", [(1, 3, 0), (3, 3, 2), (4, 3, None), (9, 3, None)])
def test_admitted_rank(arrived, size, rank):
    assert admitted_rank(arrived, size) == rank
