"""Differential test: the same random operations against torch's TCPStore and ours must
give the same results (c10d semantics). Skipped when torch is not installed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

td = pytest.importorskip("torch.distributed")

from distlaunch.store import StoreClient, StoreServer  # noqa: E402

KEYS = st.sampled_from(["a", "b", "c", "n"])


def store_ops(values: st.SearchStrategy[bytes]) -> list[st.SearchStrategy[tuple]]:
    """Strategies for one call of every store operation both stores have, on KEYS and
    ``values`` (tests/test_store_torch_protocol.py adds torch's queue calls)."""
    return [
        st.tuples(st.just("set"), KEYS, values),
        st.tuples(st.just("get"), KEYS),
        st.tuples(st.just("add"), KEYS, st.integers(-3, 3)),
        st.tuples(st.just("compare_set"), KEYS, values, values),
        st.tuples(st.just("check"), st.lists(KEYS, max_size=3)),
        st.tuples(st.just("delete_key"), KEYS),
        st.tuples(st.just("append"), KEYS, values),
        st.tuples(st.just("multi_get"), st.lists(KEYS, max_size=3)),
        st.tuples(st.just("multi_set"), st.lists(st.tuples(KEYS, values), max_size=3)),
        st.tuples(st.just("num_keys")),
    ]


OPS = st.one_of(store_ops(st.sampled_from([b"", b"0", b"5", b"-2", b"xy", b"\x00\xff"])))


@pytest.fixture(scope="module")
def stores():
    master = td.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    theirs = td.TCPStore(
        "127.0.0.1", master.port, None, False, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    with StoreServer(token="t") as srv:
        with StoreClient("127.0.0.1", srv.port, token="t", timeout=10) as ours:
            yield theirs, ours, [0]


def apply_op(s, op, prefix):
    """Make the call ``op`` (from ``store_ops``, or a queue op) on store ``s`` (a TCPStore or
    a StoreClient: same names and argument orders), its keys under ``prefix``."""
    name, *args = op
    k = lambda key: prefix + key  # noqa: E731  (fresh keys per example)
    if name in ("multi_get", "check"):
        return getattr(s, name)([k(x) for x in args[0]])
    if name == "multi_set":
        return s.multi_set([k(x) for x, _ in args[0]], [v for _, v in args[0]])
    if name == "num_keys":
        return s.num_keys()
    if name == "queue_pop":
        return s.queue_pop(k(args[0]), False)
    return getattr(s, name)(k(args[0]), *args[1:])


def compare_ops(theirs, mine, ops, prefix, skip, wrap=lambda fn: fn(), after=None):
    """Apply ``ops`` to both stores under ``prefix`` and assert the same results.
    ``skip(op)`` leaves out a call that would block or drop the connection; ``wrap(fn)`` is
    what a call gives (by default its result; an exception fails the test); ``after(op)``
    runs after each call made. ``num_keys`` is compared relative to the counts before the
    first op (earlier examples' keys are there too)."""
    base_theirs, base_mine = theirs.num_keys(), mine.num_keys()
    for op in ops:
        if skip(op):
            continue
        if op[0] == "num_keys":
            assert mine.num_keys() - base_mine == theirs.num_keys() - base_theirs, op
        else:
            assert wrap(lambda: apply_op(mine, op, prefix)) == wrap(lambda: apply_op(theirs, op, prefix)), op
        if after is not None:
            after(op)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=25))
def test_same_results_as_tcpstore(stores, ops):
    theirs, ours, counter = stores
    counter[0] += 1
    prefix = f"ex{counter[0]}/"
    present: dict[str, bytes] = {}  # to stay clear of what blocks or crashes TCPStore

    def skip(op) -> bool:
        name = op[0]
        if name == "get" and op[1] not in present:
            return True  # both would block until the timeout
        if name == "multi_get" and not all(x in present for x in op[1]):
            return True
        if name == "add" and op[1] in present:
            try:
                int(present[op[1]])
            except ValueError:
                return True  # TCPStore drops the connection here; ours raises StoreError
        return False

    def track(op) -> None:
        """Which keys exist, and their values (via both stores, which must agree)."""
        for key in "abcn":
            exists = theirs.check([prefix + key])
            assert ours.check([prefix + key]) == exists, (op, key)
            if exists:
                present[key] = theirs.get(prefix + key)
                assert ours.get(prefix + key) == present[key], (op, key)
            else:
                present.pop(key, None)

    compare_ops(theirs, ours, ops, prefix, skip, after=track)
