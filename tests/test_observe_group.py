"""distlaunch.observe.group on stacks built by hand: rank ranges, the library entry shown
before the user's frames, ops appended per group, and the hang's cause when ranks agree,
differ, or could not be read."""

from __future__ import annotations

import threading

from distlaunch.observe import group as G
from distlaunch.observe.stacks import Frame, RankStack, StackError, ThreadStack

LIB = threading.__file__  # a standard-library file


def rank(r, *frames):
    return RankStack(r, 100 + r, (ThreadStack(100 + r, "MainThread", True, tuple(frames)),))


STEP = [Frame("wait", LIB, 300), Frame("all_reduce", LIB, 10), Frame("step", "/job/train.py", 42)]
MAIN = Frame("main", "/job/train.py", 80)


def test_rank_ranges():
    assert G.rank_ranges([7, 0, 1, 2, 4, 5, 6, 2]) == "0-2,4-7"
    assert G.rank_ranges([3]) == "3" and G.rank_ranges([]) == ""
    assert G.ranks_label([3]) == "rank 3" and G.ranks_label([0, 1, 3]) == "ranks 0-1,3 (3)"


def test_eight_ranks_one_odd_out_with_ops():
    stacks = {r: rank(r, *STEP, MAIN) for r in range(8) if r != 3}
    stacks[3] = rank(3, Frame("load_batch", "/job/data.py", 17), Frame("main", "/job/train.py", 79))
    groups = G.group_stacks(stacks)
    ops = {r: "all_reduce #1834, 3.2 s, waiting for rank 3" for r in range(8) if r != 3}
    assert G.format_groups(groups, ops).splitlines() == [
        "ranks 0-2,4-7 (7): all_reduce <- step (train.py:42) <- main (train.py:80)"
        "  [all_reduce #1834, 3.2 s, waiting for rank 3]",
        "rank 3: load_batch (data.py:17) <- main (train.py:79)",
    ]
    assert G.hang_cause(groups, 300) == (
        "hang: 7 of 8 ranks in all_reduce (train.py:42) for 300 s; rank 3 in load_batch at data.py:17"
    )
    full = G.format_groups(G.group_stacks(stacks, full=True), full=True).splitlines()
    assert full[:5] == [
        "ranks 0-2,4-7 (7):",
        "    wait (threading.py:300)",
        "    all_reduce (threading.py:10)",
        "    step (train.py:42)",
        "    main (train.py:80)",
    ]


def test_all_agree_and_unreadable_ranks():
    stacks: dict[int, RankStack | StackError] = {r: rank(r, *STEP, MAIN) for r in range(3)}
    assert (
        G.hang_cause(G.group_stacks(stacks), 5.25)
        == "hang: 3 of 3 ranks in all_reduce (train.py:42) for 5.2 s"
    )
    stacks[3] = StackError(3, 103, "the process has exited")
    stacks[4] = StackError(4, 104, "the process has exited")
    groups = G.group_stacks(stacks)
    assert G.format_groups(groups).splitlines()[1] == "ranks 3-4 (2): no stack: the process has exited"
    assert G.hang_cause(groups, 60).endswith("; ranks 3-4 (2): no stack (the process has exited)")
    assert G.hang_cause(groups, 60).startswith("hang: 3 of 5 ranks in all_reduce")


def test_helper_thread_only_in_library_shows_its_innermost_frames():
    st = RankStack(
        0,
        1,
        (
            ThreadStack(1, "MainThread", True, (MAIN,)),
            ThreadStack(
                2,
                "pin_memory",
                False,
                (Frame("wait", LIB, 1), Frame("get", LIB, 2), Frame("run", LIB, 3), Frame("b", LIB, 4)),
            ),
        ),
    )
    lines = G.format_groups(G.group_stacks({0: st})).splitlines()
    assert lines == [
        "rank 0: main (train.py:80)",
        'rank 0, thread "pin_memory": wait (threading.py:1) <- get (threading.py:2) <- run (threading.py:3)',
    ]
