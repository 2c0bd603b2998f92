"""distlaunch.observe.dedup: identical lines of several ranks within the window come out
once with their ranks; a rank's lines keep their order, none is lost, duplicated or held
past the window (a hypothesis property over arbitrary interleavings)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distlaunch.observe.dedup import OutputDedup, dedup_prefix

WINDOW = 0.5


def test_same_line_of_every_rank_comes_out_once():
    d: OutputDedup[str] = OutputDedup(WINDOW)
    out = []
    for r in range(8):
        out += d.add(r, "epoch 3 done", 10.0 + r * 0.01)
    assert out == []
    assert d.next_deadline() == 10.0 + WINDOW
    assert d.due(10.0 + WINDOW - 0.01) == []
    got = d.due(10.0 + WINDOW)
    assert got == [((0, 1, 2, 3, 4, 5, 6, 7), "epoch 3 done")]
    assert dedup_prefix(got[0][0]) + got[0][1] == "[0-7]: epoch 3 done"
    assert d.next_deadline() is None


def test_different_lines_come_out_per_rank_in_arrival_order():
    d: OutputDedup[bytes] = OutputDedup(WINDOW)
    d.add(0, b"loss 0.5", 0.0)
    d.add(1, b"loss 0.7", 0.1)
    d.add(2, b"loss 0.5", 0.2)
    assert d.add(3, b"late", 0.6) == [((0, 2), b"loss 0.5"), ((1,), b"loss 0.7")]
    assert d.flush() == [((3,), b"late")]
    assert dedup_prefix((3,)) == "[3]: "


def test_merging_never_reorders_a_rank():
    """Rank 1 printed B then A; rank 0's A group is older than rank 1's B, so rank 1's A
    must not join it (that would print rank 1's A before its B)."""
    d: OutputDedup[str] = OutputDedup(WINDOW)
    d.add(0, "A", 0.0)
    d.add(1, "B", 0.0)
    d.add(1, "A", 0.0)
    d.add(2, "A", 0.0)  # joins the newest A group, which rank 2 may
    assert d.flush() == [((0,), "A"), ((1,), "B"), ((1, 2), "A")]


def test_zero_window_holds_nothing_and_bad_window_is_refused():
    d: OutputDedup[str] = OutputDedup(0)
    assert d.add(0, "x", 1.0) == [((0,), "x")]
    with pytest.raises(ValueError, match="window must be >= 0 seconds, got -1"):
        OutputDedup(-1)


events = st.lists(
    st.tuples(
        st.integers(0, 4),  # rank
        st.sampled_from(["a", "b", "c"]),  # few texts: many merges
        st.floats(0, 0.4),  # time since the previous line
        st.booleans(),  # whether the caller calls due() before this line
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_order_kept_nothing_lost_or_duplicated_nothing_held_past_window(evs):
    d: OutputDedup[str] = OutputDedup(WINDOW)
    sent: dict[int, list[tuple[str, float]]] = {}
    got: dict[int, list[tuple[str, float]]] = {}  # rank -> (line, time it came out)
    now = 0.0

    def take(groups, at):
        for ranks, line in groups:
            assert len(set(ranks)) == len(ranks)
            for r in ranks:
                got.setdefault(r, []).append((line, at))

    for rank, line, dt, poll in evs:
        nxt = now + dt
        # the caller's timer: due() at each deadline passed before this line (or skipped: then late)
        dl = d.next_deadline()
        while poll and dl is not None and dl <= nxt:
            take(d.due(dl), dl)
            dl = d.next_deadline()
        now = nxt
        sent.setdefault(rank, []).append((line, now))
        take(d.add(rank, line, now), now)
    while (dl := d.next_deadline()) is not None:
        take(d.due(dl), max(dl, now))
    assert d.flush() == []
    assert {r: [ln for ln, _ in v] for r, v in got.items()} == {
        r: [ln for ln, _ in v] for r, v in sent.items()
    }
    if all(poll for *_, poll in evs):
        for r in sent:
            for (_, t_in), (_, t_out) in zip(sent[r], got[r]):
                assert t_out <= t_in + WINDOW + 1e-9
