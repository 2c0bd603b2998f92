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


def _apply(store, op, is_torch, prefix):
    name, *args = op
    k = lambda key: prefix + key  # noqa: E731  (fresh keys per example)
    if name == "set":
        return store.set(k(args[0]), args[1])
    if name == "get":
        return store.get(k(args[0]))
    if name == "add":
        return store.add(k(args[0]), args[1])
    if name == "compare_set":
        return store.compare_set(k(args[0]), args[1], args[2])
    if name == "check":
        return store.check([k(x) for x in args[0]])
    if name == "delete_key":
        return store.delete_key(k(args[0]))
    if name == "append":
        return store.append(k(args[0]), args[1])
    if name == "multi_get":
        return store.multi_get([k(x) for x in args[0]])
    if name == "multi_set":
        return store.multi_set([k(x) for x, _ in args[0]], [v for _, v in args[0]])
    if name == "num_keys":
        return store.num_keys()
    raise AssertionError(name)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, max_size=25))
def test_same_results_as_tcpstore(stores, ops):
    theirs, ours, counter = stores
    counter[0] += 1
    prefix = f"ex{counter[0]}/"
    base_theirs, base_ours = theirs.num_keys(), ours.num_keys()
    present: dict[str, bytes] = {}  # to stay clear of what blocks or crashes TCPStore
    for op in ops:
        name = op[0]
        if name in ("get",) and op[1] not in present:
            continue  # both would block until the timeout
        if name == "multi_get" and not all(x in present for x in op[1]):
            continue
        if name == "add" and op[1] in present:
            try:
                int(present[op[1]])
            except ValueError:
                continue  # TCPStore drops the connection here; ours raises StoreError
        got_theirs = _apply(theirs, op, True, prefix)
        got_ours = _apply(ours, op, False, prefix)
        if name == "num_keys":
            assert got_ours - base_ours == got_theirs - base_theirs, op
        else:
            assert got_ours == got_theirs, op
        # track which keys exist (via both stores, which agree)
        for key in "abcn":
            exists = theirs.check([prefix + key])
            assert ours.check([prefix + key]) == exists, (op, key)
            if exists:
                present[key] = theirs.get(prefix + key)
                assert ours.get(prefix + key) == present[key], (op, key)
            else:
                present.pop(key, None)
