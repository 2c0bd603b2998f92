"""The round protocol against a real store: what one node costs the store does not grow
with the number of nodes (issue 23: the rendezvous must stay linear at 1,000-4,000
nodes), and the ring heartbeat finds a lost node. Each simulated node is a thread with
its own authenticated StoreClient, counted by a thin wrapper (the store answers for
real; only the number of requests each node sends is recorded)."""

import collections
import threading
import time

import pytest

from distlaunch.errors import RendezvousError
from distlaunch.rendezvous import Heartbeat, Rendezvous
from distlaunch.rounds import Lost, Over
from distlaunch.store import StoreClient, StoreServer

TOKEN = "rdzv-test-token"


class Counting:
    """A StoreClient that counts the requests it sends, by method name, and the keys
    they name (``keys``: a request's work in the store grows with them)."""

    def __init__(self, client):
        self._c = client
        self.ops = collections.Counter()
        self.keys = 0

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        if not callable(attr) or name in ("close", "clone", "set_timeout"):
            return attr

        def call(*a, **kw):
            self.ops[name] += 1
            self.keys += len(a[0]) if a and isinstance(a[0], list) else 1
            return attr(*a, **kw)

        return call


@pytest.fixture
def server():
    with StoreServer(token=TOKEN) as s:
        yield s


def run_nodes(server, n, body):
    """Run ``body(rdzv, k)`` on n threads (node ranks 0..n-1); return each node's
    request counts and results."""
    clients = [Counting(StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=30)) for _ in range(n)]
    results, errors = [None] * n, []

    def node(k):
        try:
            results[k] = body(Rendezvous(clients[k], "job", k, n, join_timeout=30), k)
        except BaseException as e:  # reported below
            errors.append((k, e))

    threads = [threading.Thread(target=node, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.close()
    assert not errors, errors
    return clients, results


def static_round(rdzv, k):
    seat = rdzv.join(0, k % 3 + 1, f"host{k}", "10.0.0.1")  # 1, 2, 3, 1, 2, ... workers
    if k == 0:
        rdzv.publish_master(0, "10.0.0.1", 29500, 0)
    master = rdzv.master(0)
    cause = rdzv.finish(0, 30)
    return seat, master, cause


@pytest.mark.parametrize("n", [2, 8, 32])
def test_static_round_costs_each_node_a_constant_number_of_requests(server, n):
    nodes, results = run_nodes(server, n, static_round)
    counts = [k % 3 + 1 for k in range(n)]
    for k, (seat, master, cause) in enumerate(results):
        assert (seat.first_rank, seat.world_size) == (sum(counts[:k]), sum(counts))
        assert master == ("10.0.0.1", 29500, 0)
        assert cause is None
    # join: set, add, get of its seat; master: get; barrier: compare_set, add, (get);
    # the end: compare_set. The node completing the count of joins reads every node's
    # key and writes the members and the seats (one multi_get, one multi_set): the only
    # per-node work, done once.
    assert max(sum(c.ops.values()) for c in nodes) <= 14, [c.ops for c in nodes]
    keys = sorted(c.keys for c in nodes)
    assert keys[-2] <= 14, keys  # every node but the publisher names O(1) keys
    assert keys[-1] <= 14 + 2 * n, keys
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
        members = Rendezvous(c, "job", 0, n).members(0, 5)  # for node 0's round line
    assert [(m.node_rank, m.slots, m.host) for m in members] == [(k, counts[k], f"host{k}") for k in range(n)]


@pytest.mark.parametrize("n", [2, 8, 32])
def test_dynamic_round_costs_each_node_a_constant_number_of_requests(server, n):
    def body(rdzv, k):
        seat = rdzv.join_dynamic(0, n, n, 0.2, 1, f"h{k}", "a")
        return rdzv.node_rank, seat.first_rank, seat.world_size

    nodes, results = run_nodes(server, n, body)
    assert sorted(r for r, _, _ in results) == list(range(n))
    assert all(first == rank for rank, first, _ in results)  # one worker each
    assert {size for _, _, size in results} == {n}
    assert max(sum(c.ops.values()) for c in nodes) <= 12, [c.ops for c in nodes]  # no polling
    assert sorted(c.keys for c in nodes)[-2] <= 14, [c.keys for c in nodes]


def test_dynamic_round_closes_after_the_last_call_with_the_nodes_there(server):
    # 3 of MIN:MAX = 2:4 arrive: the round closes last_call after the second, with 3
    def body(rdzv, k):
        time.sleep(0.05 * k)
        rdzv.join_dynamic(0, 2, 4, 0.5, 1, f"h{k}", "a")
        return rdzv.num_nodes

    _, sizes = run_nodes(server, 3, body)
    assert sizes == [3, 3, 3]


def test_too_few_nodes_for_a_dynamic_round_is_one_clear_error(server):
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
        rdzv = Rendezvous(c, "job", 0, 1, join_timeout=0.5)
        with pytest.raises(RendezvousError, match="only 1 of at least 2 nodes arrived within 0.5 s"):
            rdzv.join_dynamic(0, 2, 3, 0.1, 1, "h", "a")


def test_static_join_names_the_missing_node_on_node_zero(server):
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
        heard = []
        rdzv = Rendezvous(c, "job", 0, 3, join_timeout=1.5, on_wait=heard.append)
        other = Rendezvous(c, "job", 2, 3)
        other.store.set(other.keys(0).node(2), '{"slots": 1, "host": "h2", "addr": ""}')
        other.store.add(other.keys(0).ready, 1)
        with pytest.raises(RendezvousError, match=r"gave up waiting for node\(s\) 1 after 1.5 s"):
            rdzv.join(0, 1, "h0", "a")


def test_exit_barrier_goes_on_without_a_node_found_lost(server):
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
        rdzv = Rendezvous(c, "job", 0, 3, join_timeout=5)
        rdzv.store.append(rdzv.keys(0).lost, "2,")  # node 2's watcher found it lost
        Rendezvous(c, "job", 1, 3).store.compare_set(rdzv.keys(0).done(1), b"", b"1")
        rdzv.store.add(rdzv.keys(0).ndone, 1)
        start = time.monotonic()
        assert rdzv.finish(0, 10, lambda: rdzv.lost_nodes(0)) is None
        assert time.monotonic() - start < 5  # not the barrier's timeout
        assert rdzv.lost_nodes(0) == {2}


def test_ring_heartbeat_finds_a_lost_node_and_stops_the_round(server):
    # 4 nodes beat every 0.1 s; node 2 stops: node 1 (its watcher) finds it lost within
    # the 0.5 s timeout (+ an interval), records it, and stops the round for everyone
    n = 4
    clients = [StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) for _ in range(n)]
    rdzvs = [Rendezvous(clients[k], "job", k, n) for k in range(n)]
    found = []
    beats = [
        Heartbeat(
            clients[k].clone(),
            rdzvs[k],
            0,
            0.1,
            0.5,
            lambda lost, secs, k=k: (found.append((k, lost)), rdzvs[k].request_stop(0, Lost(lost, "test"))),
            lambda: found.append("store lost"),
        )
        for k in range(n)
    ]
    try:
        time.sleep(0.4)
        beats[2].stop()
        deadline = time.monotonic() + 5
        while not found and time.monotonic() < deadline:
            time.sleep(0.02)
        assert found == [(1, 2)]
        assert rdzvs[3].lost_nodes(0) == {2}
        cause = rdzvs[0].stop_cause(0)
        assert isinstance(cause, Lost) and cause.node == 2
        assert beats[1].watched(2) == 3  # node 1 now watches the node after the lost one
    finally:
        for b in beats:
            b.stop()
        for c in clients:
            c.close()
    assert not isinstance(cause, Over)
