"""The store's socket-free cores, driven directly: distlaunch's key space
(``store.core.KeyValueCore``: values, counters, compare_set, waiters and their missing
keys, deadlines) and the byte budget of torch clients' key space
(``store.torch_protocol.TorchKeySpace``). No sockets, no threads: each case is a table
of calls and what they must return or leave behind."""

from __future__ import annotations

import math

import pytest

from distlaunch.store import torch_protocol as T
from distlaunch.store.core import KeyValueCore, Waiter, wrap_int64


class Recorder:
    """A core whose wake-ups and timeouts are recorded, in order."""

    def __init__(self, max_value: int = 1 << 20) -> None:
        self.ready: list[Waiter] = []
        self.timed_out: list[tuple[Waiter, list[bytes]]] = []
        self.core = KeyValueCore(self.ready.append, self._timeout, max_value)

    def _timeout(self, w: Waiter) -> None:
        self.timed_out.append((w, list(self.core.missing(w.keys))))


# (calls, expected results, data afterwards); a call is (method, *args)
WRITES = [
    pytest.param([("put", b"k", b"v"), ("put", b"k", b"w")], [None, None], {b"k": b"w"}, id="set-overwrites"),
    pytest.param([("add", b"n", 5), ("add", b"n", -7)], [5, -2], {b"n": b"-2"}, id="add-from-missing"),
    pytest.param(
        [("put", b"n", b"9223372036854775807"), ("add", b"n", 1)],
        [None, -(1 << 63)],
        {b"n": b"-9223372036854775808"},
        id="add-wraps-int64",
    ),
    pytest.param(
        [("compare_set", b"k", b"", b"new")],
        [b"new"],
        {b"k": b"new"},
        id="compare_set-missing-empty-expected",
    ),
    pytest.param([("compare_set", b"k", b"old", b"new")], [b"old"], {}, id="compare_set-missing-quirk"),
    pytest.param(
        [("put", b"k", b"a"), ("compare_set", b"k", b"a", b"b")],
        [None, b"b"],
        {b"k": b"b"},
        id="compare_set-match",
    ),
    pytest.param(
        [("put", b"k", b"a"), ("compare_set", b"k", b"x", b"b")],
        [None, b"a"],
        {b"k": b"a"},
        id="compare_set-mismatch",
    ),
    pytest.param(
        [("append", b"k", b"ab"), ("append", b"k", b"cd")], [True, True], {b"k": b"abcd"}, id="append-creates"
    ),
    pytest.param(
        [("append", b"k", b"12345"), ("append", b"k", b"6789")],
        [True, False],
        {b"k": b"12345"},
        id="append-over-max-value-refused",
    ),
    pytest.param(
        [("put", b"k", b"v"), ("delete", b"k"), ("delete", b"k")], [None, True, False], {}, id="delete"
    ),
    pytest.param(
        [("multi_set", [(b"a", b"1"), (b"b", b"2"), (b"a", b"3")])],
        [None],
        {b"a": b"3", b"b": b"2"},
        id="multi_set-in-order",
    ),
]


@pytest.mark.parametrize("calls, results, data", WRITES)
def test_writes(calls, results, data):
    r = Recorder(max_value=8)
    got = [getattr(r.core, name)(*args) for name, *args in calls]
    assert got == results
    assert r.core.data == data


def test_add_on_a_value_that_is_not_an_integer_raises_and_stores_nothing():
    core = KeyValueCore()
    core.put(b"k", b"abc")
    with pytest.raises(ValueError):
        core.add(b"k", 1)
    assert core.data == {b"k": b"abc"}


def test_check_and_missing():
    core = KeyValueCore()
    core.multi_set([(b"a", b""), (b"c", b"x")])
    assert core.check([b"a", b"c"]) and core.check([])
    assert not core.check([b"a", b"b"])
    assert list(core.missing([b"d", b"a", b"b", b"c"])) == [b"d", b"b"]


def test_wrap_int64_table():
    for n, want in [
        (0, 0),
        ((1 << 63) - 1, (1 << 63) - 1),
        (1 << 63, -(1 << 63)),
        (-(1 << 63) - 1, (1 << 63) - 1),
    ]:
        assert wrap_int64(n) == want


def test_a_waiter_wakes_on_its_last_missing_key_only():
    r = Recorder()
    core = r.core
    core.put(b"a", b"1")
    w = core.block("conn", 7, [b"a", b"b", b"c"])
    assert w.registered == {b"b", b"c"}  # the missing keys only
    assert set(core.waiters) == {b"b", b"c"}
    core.put(b"b", b"2")
    assert r.ready == [] and w.registered == {b"c"}
    core.put(b"x", b"?")  # another key: not looked at
    assert r.ready == []
    core.put(b"c", b"3")
    assert r.ready == [w] and w.done and w.owner == "conn" and w.op == 7
    assert core.waiters == {} and w.registered == set()
    core.put(b"c", b"4")  # answered once
    assert r.ready == [w]


def test_a_key_deleted_before_the_last_write_parks_the_waiter_again():
    r = Recorder()
    core = r.core
    w = core.block(None, 0, [b"a", b"b"])
    core.put(b"a", b"1")
    core.delete(b"a")
    core.put(b"b", b"2")  # its count reached zero, but "a" is gone again
    assert r.ready == [] and w.registered == {b"a"} and not w.done
    core.put(b"a", b"1")
    assert r.ready == [w]


def test_waiters_of_one_key_wake_in_registration_order():
    r = Recorder()
    ws = [r.core.block(i, 0, [b"k"]) for i in range(3)]
    r.core.add(b"k", 1)
    assert r.ready == ws


def test_deadlines_time_out_in_order_and_name_the_missing_keys():
    r = Recorder()
    core = r.core
    assert core.next_deadline() == math.inf
    late = core.block("late", 0, [b"x"], deadline=20.0)
    early = core.block("early", 0, [b"a", b"b", b"c"], deadline=10.0)
    forever = core.block("forever", 0, [b"a"])
    assert core.next_deadline() == 10.0
    core.put(b"b", b"1")
    core.expire(9.999)
    assert r.timed_out == []
    core.expire(10.0)
    assert r.timed_out == [(early, [b"a", b"c"])] and early.done
    assert set(core.waiters) == {b"x", b"a"} and list(core.waiters[b"a"]) == [forever]
    assert core.next_deadline() == 20.0
    core.put(b"x", b"1")  # answered before its deadline: never timed out
    assert r.ready == [late]
    core.expire(100.0)
    assert r.timed_out == [(early, [b"a", b"c"])] and core.next_deadline() == math.inf
    core.put(b"a", b"1")
    assert r.ready == [late, forever]


def test_retired_and_cleared_waiters_are_never_answered():
    r = Recorder()
    core = r.core
    gone = core.block("closed", 0, [b"k"], deadline=1.0)
    core.retire(gone)  # its connection closed
    assert core.waiters == {}
    core.put(b"k", b"v")
    core.expire(2.0)
    assert r.ready == [] and r.timed_out == []
    core.block("x", 0, [b"y"], deadline=1.0)
    core.clear_waiters()
    assert core.waiters == {} and core.next_deadline() == math.inf
    core.put(b"y", b"v")
    core.expire(2.0)
    assert r.ready == [] and r.timed_out == []


# --- torch clients' key space: the byte budget ---------------------------------------------


def torch_space(budget: int = 1 << 20) -> tuple[T.TorchKeySpace, T.TorchConn, list[bytes]]:
    sent: list[bytes] = []
    space = T.TorchKeySpace(lambda st, data: sent.append(data), budget)
    st = T.TorchConn(None)
    return space, st, sent


def entry(k: bytes, v: bytes) -> int:
    return len(k) + len(v) + T.ENTRY_OVERHEAD


# (queries, bytes charged afterwards)
CHARGES = [
    pytest.param([(T.SET, [b"/k", b"vvv"])], entry(b"/k", b"vvv"), id="set"),
    pytest.param(
        [(T.SET, [b"/k", b"vvv"]), (T.SET, [b"/k", b"v"])], entry(b"/k", b"v"), id="overwrite-releases"
    ),
    pytest.param([(T.SET, [b"/k", b"vvv"]), (T.DELETE_KEY, [b"/k"])], 0, id="delete-releases"),
    pytest.param(
        [(T.APPEND, [b"/k", b"ab"]), (T.APPEND, [b"/k", b"cd"])], entry(b"/k", b"abcd"), id="append"
    ),
    pytest.param([(T.ADD, [b"/n", 12])], entry(b"/n", b"12"), id="add"),
    pytest.param(
        [(T.SET, [b"/a", b"old value"]), (T.MULTI_SET, [[b"/a", b"1", b"/b", b"22", b"/a", b"333"]])],
        entry(b"/a", b"333") + entry(b"/b", b"22"),
        id="multi_set-as-sets-in-order",
    ),
    pytest.param(
        [(T.QUEUE_PUSH, [b"/q", b"x"]), (T.QUEUE_PUSH, [b"/q", b"yy"])],
        entry(b"/q", b"x") + entry(b"/q", b"yy"),
        id="queue",
    ),
    pytest.param([(T.QUEUE_PUSH, [b"/q", b"x"]), (T.QUEUE_POP, [b"/q"])], 0, id="queue-pop-releases"),
    pytest.param(
        [(T.WAIT, [[b"/a", b"/bb", b"/a"]])], len(b"/a/bb") + 2 * T.WAIT_OVERHEAD, id="wait-once-per-key"
    ),
    pytest.param([(T.WAIT, [[b"/a"]]), (T.CANCEL_WAIT, [])], 0, id="cancel-releases"),
    pytest.param([(T.WAIT, [[b"/a"]]), (T.SET, [b"/a", b""])], entry(b"/a", b""), id="fired-wait-releases"),
]


@pytest.mark.parametrize("queries, used", CHARGES)
def test_torch_charges(queries, used):
    space, st, _ = torch_space()
    for q, args in queries:
        space.handle(st, q, args)
    assert space.used == used


def test_torch_multi_set_charges_what_the_same_sets_charge():
    pairs = [(b"/a", b"x" * 10), (b"/b", b""), (b"/a", b"y" * 3), (b"/c", b"z" * 100)]
    one, st1, _ = torch_space()
    for k, v in pairs:
        one.handle(st1, T.SET, [k, v])
    bulk, st2, _ = torch_space()
    bulk.handle(st2, T.MULTI_SET, [[x for kv in pairs for x in kv]])
    assert bulk.used == one.used and bulk.data == one.data and bulk.key_bytes == one.key_bytes


@pytest.mark.parametrize(
    "query, args",
    [
        pytest.param(T.SET, [b"/big", b"x" * 1000], id="set"),
        pytest.param(T.MULTI_SET, [[b"/small", b"1", b"/big", b"x" * 1000]], id="multi_set-all-or-nothing"),
        pytest.param(T.APPEND, [b"/k", b"x" * 1000], id="append"),
        pytest.param(T.QUEUE_PUSH, [b"/q", b"x" * 1000], id="queue_push"),
        pytest.param(T.WAIT, [[b"/w%d" % i for i in range(10)]], id="wait"),
    ],
)
def test_torch_budget_refuses_what_would_exceed_it_and_keeps_nothing(query, args):
    budget = 1000
    space, st, _ = torch_space(budget)
    space.handle(st, T.SET, [b"/k", b"v"])
    before = (space.used, dict(space.data), dict(space.queues), dict(space.waiting))
    with pytest.raises(T.TorchLimitError):
        space.handle(st, query, args)
    assert (space.used, space.data, space.queues, space.waiting) == before


def test_torch_replies_past_the_budget_are_refused_before_they_are_built():
    space, st, _ = torch_space(budget=1900)
    space.handle(st, T.SET, [b"/v", b"x" * 600])
    assert space.handle(st, T.GET, [b"/v"]) == b"\x58\x02" + b"\x00" * 6 + b"x" * 600
    with pytest.raises(T.TorchLimitError):
        space.handle(st, T.MULTI_GET, [[b"/v", b"/v"]])  # 1216 bytes on top of the 730 held


def test_torch_account_charges_and_releases_a_connections_buffers():
    space, st, _ = torch_space(budget=100)
    space.account(st, 60)
    assert space.used == 60
    space.account(st, 10)  # less held: the difference released
    assert space.used == 10
    with pytest.raises(T.TorchLimitError):
        space.account(st, 101)
    space.drop(st)
    assert space.used == 0
