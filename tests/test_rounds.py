"""The round protocol's pure parts: key names, the stop-cause codec, and every restart
policy's decision as a table (no processes, no sockets)."""

import dataclasses
import json
import signal

import pytest

from distlaunch.errors import LaunchInterrupted, RendezvousError, WorkerFailedError
from distlaunch.events import describe_cause, one_line, round_end_event
from distlaunch.policy import (
    Continue,
    DynamicMembership,
    End,
    FixedSize,
    HeadHistory,
    HeadPlanned,
    History,
    Restart,
    error_for,
)
from distlaunch.rounds import (
    Failure,
    Join,
    Lost,
    Over,
    RoundKeys,
    Signal,
    WorkerFailure,
    agent_exit_key,
    cause_from_dict,
    cause_to_dict,
    decode_cause,
    encode_cause,
)


def failure(node_rank=0, rank=1, rc=3):
    return Failure(
        WorkerFailure(
            rank=rank,
            local_rank=rank % 2,
            node_rank=node_rank,
            host="h",
            pid=42,
            returncode=rc,
            timestamp=1.5,
            stderr_tail="boom",
        )
    )


def test_keys():
    k = RoundKeys("job", 3)
    assert (k.plan, k.master, k.stop, k.left, k.joined, k.closed) == (
        "job/r3/plan",
        "job/r3/master",
        "job/r3/stop",
        "job/r3/left",
        "job/r3/joined",
        "job/r3/closed",
    )
    assert (k.node(1), k.pgids(2), k.done(0), k.hb(4)) == (
        "job/r3/node/1",
        "job/r3/pgids/2",
        "job/r3/done/0",
        "job/r3/hb/4",
    )
    assert agent_exit_key("job", 2) == "job/agent_exit/2"


@pytest.mark.parametrize(
    "cause, wire",
    [
        (Signal(15), {"kind": "signal", "signum": 15}),
        (Lost(1, "no heartbeat for 15 s"), {"kind": "lost", "node": 1, "why": "no heartbeat for 15 s"}),
        (Join(), {"kind": "join"}),
        (Over(), {"kind": "over"}),
    ],
)
def test_cause_codec(cause, wire):
    assert cause_to_dict(cause) == wire
    assert decode_cause(encode_cause(cause)) == cause == cause_from_dict(json.loads(json.dumps(wire)))


def test_failure_codec_keeps_the_root_cause_record():
    f = failure()
    d = cause_to_dict(f)
    assert d["kind"] == "failure" and d["failure"]["rank"] == 1 and d["failure"]["stderr_tail"] == "boom"
    assert decode_cause(encode_cause(f)) == f


def test_round_end_lines():
    assert describe_cause(None) == "every worker succeeded"
    assert (
        one_line(round_end_event(0, failure(rc=-9)))
        == "round 0 ended: rank 1 (local rank 1) on node 0 (h) killed by SIGKILL"
    )
    assert one_line(round_end_event(2, Lost(1, "x"))) == "round 2 ended: node 1 lost (x)"
    assert describe_cause(Signal(signal.SIGTERM)) == "stopped by SIGTERM"


FIXED = FixedSize(max_restarts=2, heartbeat_timeout=15.0)


@pytest.mark.parametrize(
    "history, cause, expected",
    [
        (History(0, 0, 2), failure(), Restart(1)),
        (History(1, 1, 2), failure(), Restart(2)),
        (History(2, 2, 2), failure(), WorkerFailedError),
        (History(0, 0, 2), Signal(15), LaunchInterrupted),
        (History(0, 0, 2, frozenset({1})), Signal(15), LaunchInterrupted),
        (History(0, 0, 2, frozenset({1})), failure(), RendezvousError),  # lost: no restart
        (History(0, 0, 2), Lost(1, "x"), RendezvousError),
        (History(0, 1, 2), Join(), Continue(1)),
    ],
)
def test_fixed_size(history, cause, expected):
    check(FIXED.decide(history, cause), expected)


DYNAMIC = DynamicMembership(max_restarts=1, min_nodes=2)


@pytest.mark.parametrize(
    "history, cause, expected",
    [
        (History(0, 0, 3), failure(), Restart(1)),
        (History(0, 0, 3, frozenset({2})), failure(), Restart(1)),  # a lost node does not end it
        (History(1, 1, 3), failure(), WorkerFailedError),
        (History(4, 1, 3), Join(), Continue(1)),
        (History(0, 0, 3, frozenset({2})), Lost(2, "x"), Continue(0)),
        (History(0, 0, 2, frozenset({1})), Lost(1, "x"), RendezvousError),  # below the minimum
        (History(0, 0, 3), Signal(2), LaunchInterrupted),
    ],
)
def test_dynamic_membership(history, cause, expected):
    check(DYNAMIC.decide(history, cause), expected)


def check(decision, expected):
    if isinstance(expected, type):
        assert isinstance(decision, End) and type(decision.error) is expected, decision
    else:
        assert type(decision) is type(expected) and decision.restarts == expected.restarts
        assert decision.members is None and decision.note


def test_notes_say_what_happens():
    assert FIXED.decide(History(0, 0, 2), failure()).note == (
        "worker group failed (rank 1 (local rank 1) on node 0 (h) exit code 3); restarting (restart 1 of 2)"
    )
    assert (
        DYNAMIC.decide(History(3, 0, 3), Join()).note
        == "a node joined: new rendezvous round 4 (not a restart)"
    )
    assert (
        FIXED.decide(History(0, 0, 3, frozenset({2, 1})), Over())
        .error.args[0]
        .startswith("node 1, 2 was lost (no heartbeat for 15 s)")
    )


HEAD = HeadPlanned(max_restarts=3, min_nodes=1)


@pytest.mark.parametrize(
    "history, cause, decision, after, drops, kill",
    [
        # a failure: the same hosts, one restart more
        (
            HeadHistory((0, 1)),
            failure(node_rank=1),
            Restart(1, (0, 1)),
            HeadHistory((0, 1), 1, streak=(1, 1)),
            (),
            None,
        ),
        # the same host fails twice in a row: dropped
        (
            HeadHistory((0, 1), 1, streak=(1, 1)),
            failure(node_rank=1),
            Restart(2, (0,)),
            HeadHistory((0,), 2, streak=(1, 2)),
            ((1, "its workers failed in 2 consecutive rounds"),),
            None,
        ),
        # another host failed in between: the streak starts again
        (
            HeadHistory((0, 1), 1, streak=(1, 1)),
            failure(node_rank=0),
            Restart(2, (0, 1)),
            HeadHistory((0, 1), 2, streak=(0, 1)),
            (),
            None,
        ),
        # a lost host: dropped and killed, not a restart
        (
            HeadHistory((0, 2), 1),
            Lost(1, "gone"),
            Continue(1, (0,)),
            HeadHistory((0,), 1, frozenset({2})),
            ((2, "gone"),),
            2,
        ),
        # a host whose agent ended earlier is left out of the next round
        (
            HeadHistory((0, 1, 2), 0, frozenset({2})),
            failure(node_rank=0),
            Restart(1, (0, 1)),
            HeadHistory((0, 1), 1, frozenset({2}), (0, 1)),
            (),
            None,
        ),
        # restarts exhausted, a signal: the job ends as the agents report it
        (HeadHistory((0, 1), 3), failure(), End(), HeadHistory((0, 1), 3), (), None),
        (HeadHistory((0, 1)), Signal(15), End(), HeadHistory((0, 1)), (), None),
    ],
)
def test_head_planned(history, cause, decision, after, drops, kill):
    step = HEAD.decide(history, cause)
    assert (step, HEAD.next_history(history, cause, step), step.drops, step.kill) == (
        dataclasses.replace(decision, drops=drops, kill=kill),
        after,
        drops,
        kill,
    )


def test_head_planned_ends_below_min_nodes():
    step = HeadPlanned(max_restarts=3, min_nodes=2).decide(HeadHistory((0, 1)), Lost(0, "gone"))
    assert step == End(note="1 host(s) left, fewer than --min-nodes 2", drops=((0, "gone"),), kill=0)
    assert step.drops == ((0, "gone"),) and step.kill == 0
    # a repeatedly failing host is not dropped below the minimum: the job restarts with it
    step = HeadPlanned(3, 2).decide(HeadHistory((0, 1), 1, streak=(1, 1)), failure(node_rank=1))
    assert step == Restart(2, (0, 1)) and step.drops == ()


def test_head_round_bound():
    assert HEAD.max_rounds(4) == 3 + 4 + 2


def test_error_for():
    e = error_for(failure(rc=7))
    assert isinstance(e, WorkerFailedError) and e.exit_code == 7 and e.failure.rank == 1
    assert error_for(Signal(2)).signum == 2
    assert "node 1 was lost (x)" in str(error_for(Lost(1, "x")))
    with pytest.raises(ValueError):
        error_for(Over())
