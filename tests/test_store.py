"""The rendezvous store: real server, real sockets, real processes; no mocks.

Model-based: every client method is checked against a reference dict (hypothesis
stateful test). Hostile peers: garbage, half-sent, oversized frames and wrong secrets on
raw sockets, interleaved with a well-behaved client whose results must stay exact.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from distlaunch.errors import (
    StoreAuthError,
    StoreConnectionError,
    StoreError,
    StoreProtocolError,
    StoreTimeoutError,
)
from distlaunch.store import PrefixStore, StoreClient, StoreServer, serve_forever
from distlaunch.store import protocol as P

TOKEN = "test-secret-\u00e9"  # non-ASCII on purpose: str tokens are UTF-8
ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "store_worker.py"


# --- helpers ---------------------------------------------------------------------------------


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"peer closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def recv_frame(s: socket.socket):
    length, mtype = P.HEADER.unpack(recv_exact(s, P.HEADER_SIZE))
    return mtype, recv_exact(s, length)


def raw_connect(port: int, token=TOKEN) -> socket.socket:
    """A raw socket; authenticated by hand when ``token`` is given (else just connected)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if token is not None:
        mtype, body = recv_frame(s)
        assert mtype == P.HELLO and body.startswith(P.MAGIC)
        server_nonce = body[len(P.MAGIC) :]
        cn = os.urandom(32)
        s.sendall(P.frame(P.AUTH, cn + P.mac(P.secret_bytes(token), P.AUTH_LABEL_CLIENT, server_nonce, cn)))
        mtype, body = recv_frame(s)
        assert mtype == P.AUTH_OK
        assert body == P.mac(P.secret_bytes(token), P.AUTH_LABEL_SERVER, server_nonce, cn)
    return s


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True if the peer closes ``s`` within ``timeout`` (whatever it sent first)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def eventually(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def set_frame(key: bytes, value: bytes) -> bytes:
    return P.frame(P.SET, P.enc_key(key) + P.enc_value(value))


@pytest.fixture
def server():
    with StoreServer(token=TOKEN) as s:
        yield s
        assert s.stats["internal_errors"] == 0, s.last_internal_error


@pytest.fixture
def client(server):
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def garbage_env():
    """One server and one well-behaved client shared by all garbage examples."""
    with StoreServer(token=TOKEN) as s:
        with StoreClient("127.0.0.1", s.port, token=TOKEN, timeout=10) as good:
            yield s, good, {}


# --- model-based test of every method ---------------------------------------------------------

KEYS = st.sampled_from(["a", "b", "c/d", "pfx/a", "pfx/b", "\u043a\u043b\u044e\u0447", "k" * 50])
VALUES = st.one_of(
    st.sampled_from([b"", b"0", b"7", b"-3", b" 12 ", b"abc", b"x" * 64]),
    st.binary(max_size=40),
    st.text(max_size=10),
)
SHORT = 0.02  # timeout for calls expected to time out in the model test


def as_bytes(v) -> bytes:
    return v.encode() if isinstance(v, str) else v


class StoreModel(RuleBasedStateMachine):
    """Two clients and a prefixed view against a reference dict with c10d semantics.

    Client 0 acknowledges sets (``ack_set=True``); client 1 uses TCPStore's unacknowledged
    set, so after its sets the model pings it (the documented way to make a set visible
    to other clients) before another client may look.
    """

    def __init__(self):
        super().__init__()
        self.server = StoreServer(token=TOKEN).start()
        self.clients = [
            StoreClient("127.0.0.1", self.server.port, token=TOKEN, timeout=5, ack_set=(i == 0))
            for i in range(2)
        ]
        self.view = PrefixStore("pfx", self.clients[1])
        self.model: dict[str, bytes] = {}

    def teardown(self):
        for c in self.clients:
            c.close()
        self.server.stop()
        assert self.server.stats["internal_errors"] == 0, self.server.last_internal_error

    @rule(i=st.integers(0, 1), key=KEYS, value=VALUES)
    def set(self, i, key, value):
        self.clients[i].set(key, value)
        self.model[key] = as_bytes(value)
        if i == 1:
            self.clients[1].ping()

    @rule(i=st.integers(0, 1), key=KEYS)
    def get(self, i, key):
        if key in self.model:
            assert self.clients[i].get(key) == self.model[key]
        else:
            with pytest.raises(StoreTimeoutError, match=repr(key)):
                self.clients[i].get(key, timeout=SHORT)

    @rule(i=st.integers(0, 1), key=KEYS, amount=st.integers(-10, 10))
    def add(self, i, key, amount):
        old = self.model.get(key, b"0")
        try:
            expected = int(old) + amount
        except ValueError:
            with pytest.raises(StoreError, match="not an integer"):
                self.clients[i].add(key, amount)
            return
        assert self.clients[i].add(key, amount) == expected
        self.model[key] = str(expected).encode()

    @rule(i=st.integers(0, 1), key=KEYS, expected=VALUES, desired=VALUES)
    def compare_set(self, i, key, expected, desired):
        exp, des = as_bytes(expected), as_bytes(desired)
        got = self.clients[i].compare_set(key, expected, desired)
        if key not in self.model:
            if exp == b"":
                self.model[key] = des
                assert got == des
            else:
                assert got == exp  # torch: returns expected, stores nothing
        else:
            if self.model[key] == exp:
                self.model[key] = des
            assert got == self.model[key]

    @rule(i=st.integers(0, 1), keys=st.lists(KEYS, max_size=4))
    def check(self, i, keys):
        assert self.clients[i].check(keys) == all(k in self.model for k in keys)

    @rule(i=st.integers(0, 1), keys=st.lists(KEYS, max_size=4))
    def wait(self, i, keys):
        if all(k in self.model for k in keys):
            self.clients[i].wait(keys)
        else:
            missing = [k for k in keys if k not in self.model]
            with pytest.raises(StoreTimeoutError, match=repr(missing[0])):
                self.clients[i].wait(keys, timeout=SHORT)

    @rule(i=st.integers(0, 1), key=KEYS)
    def delete_key(self, i, key):
        assert self.clients[i].delete_key(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(i=st.integers(0, 1), key=KEYS, value=VALUES)
    def append(self, i, key, value):
        self.clients[i].append(key, value)
        self.model[key] = self.model.get(key, b"") + as_bytes(value)

    @rule(i=st.integers(0, 1), keys=st.lists(KEYS, max_size=4))
    def multi_get(self, i, keys):
        if all(k in self.model for k in keys):
            assert self.clients[i].multi_get(keys) == [self.model[k] for k in keys]
        else:
            with pytest.raises(StoreTimeoutError):
                self.clients[i].multi_get(keys, timeout=SHORT)

    @rule(i=st.integers(0, 1), items=st.lists(st.tuples(KEYS, VALUES), max_size=4))
    def multi_set(self, i, items):
        self.clients[i].multi_set([k for k, _ in items], [v for _, v in items])
        for k, v in items:
            self.model[k] = as_bytes(v)

    @rule(key=st.sampled_from(["a", "b"]), value=VALUES)
    def prefixed_set(self, key, value):
        self.view.set(key, value)
        self.model["pfx/" + key] = as_bytes(value)
        self.clients[1].ping()

    @rule(key=st.sampled_from(["a", "b"]), amount=st.integers(-5, 5))
    def prefixed_add_or_get(self, key, amount):
        full = "pfx/" + key
        if full in self.model:
            assert self.view.get(key) == self.model[full]
            assert self.view.check([key])
        else:
            assert not self.view.check([key])
            assert self.view.add(key, amount) == amount
            self.model[full] = str(amount).encode()

    @rule(key=st.sampled_from(["a", "b"]))
    def prefixed_delete(self, key):
        assert self.view.delete_key(key) == ("pfx/" + key in self.model)
        self.model.pop("pfx/" + key, None)

    @invariant()
    def num_keys(self):
        assert self.clients[0].num_keys() == len(self.model)
        assert self.view.num_keys() == len(self.model)  # torch: the whole store


StoreModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreModel = StoreModel.TestCase


# --- semantics beyond the model ------------------------------------------------------------------


def test_add_wraps_like_int64_and_stores_ascii(client):
    assert client.add("big", 2**63 - 1) == 2**63 - 1
    assert client.add("big", 1) == -(2**63)  # torch's TCPStore wraps the same way
    assert client.get("big") == str(-(2**63)).encode()
    client.set("n", "41")
    assert client.add("n", 1) == 42 and client.get("n") == b"42"


def test_str_values_utf8_and_arguments_checked(client):
    client.set("s", "h\u00e9")
    assert client.get("s") == "h\u00e9".encode()
    with pytest.raises(TypeError):
        client.set(b"bytes-key", b"v")
    with pytest.raises(TypeError):
        client.set("k", 3)
    with pytest.raises(TypeError):
        client.check("ab")  # a str is not a list of keys
    with pytest.raises(ValueError):
        client.set("", b"v")
    with pytest.raises(ValueError):
        client.set("k" * (P.MAX_KEY_BYTES + 1), b"v")
    with pytest.raises(ValueError):
        client.multi_set(["a", "b"], [b"1"])
    with pytest.raises(ValueError):
        client.get("k", timeout=0)
    assert client.num_keys() == 1  # nothing invalid reached the server


def test_prefix_views_nest_like_torch(client):
    inner = client.prefixed("job").prefixed("round1")
    inner.set("x", b"1")
    assert client.get("job/round1/x") == b"1"
    assert inner.multi_get(["x"]) == [b"1"]
    inner.multi_set(["y", "z"], [b"2", b"3"])
    assert client.multi_get(["job/round1/y", "job/round1/z"]) == [b"2", b"3"]
    inner.append("x", b"0")
    assert inner.compare_set("x", b"10", b"11") == b"11"
    inner.wait(["x", "y"], timeout=1)
    with pytest.raises(StoreTimeoutError, match="job/round1/nope"):
        inner.get("nope", timeout=0.05)


# --- blocking and timeouts -------------------------------------------------------------------------


def test_blocking_get_is_woken_by_another_clients_set(server, client):
    other = client.clone()
    got = []
    t = threading.Thread(target=lambda: got.append(client.get("late", timeout=20)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not got  # really blocked
    other.set("late", b"here")
    t.join(5)
    assert got == [b"here"]
    assert time.monotonic() - t0 < 5
    other.close()


def test_local_connection_shares_the_store_without_a_handshake(server, client):
    # The launcher's own agent talks to its server over a socketpair the server adopted
    # as authenticated: no greeting, no token; same store, blocking calls, clone.
    local = StoreClient("127.0.0.1", server.port, token=None, timeout=20, connect=server.connect_local)
    assert server.stats["accepted"] == 1  # only the TCP client: nothing was accepted for it
    got = []
    t = threading.Thread(target=lambda: got.append(local.get("from-tcp")))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not got  # really blocked, on the server
    client.set("from-tcp", b"1")
    t.join(5)
    assert got == [b"1"]
    other = local.clone()
    other.set("from-local", b"2")
    assert client.get("from-local") == b"2"
    assert local.add("n", 3) == 3 and client.add("n", 1) == 4
    other.close()
    local.close()


def test_wait_and_multi_get_need_every_key(server, client):
    other = client.clone()
    res = {}

    def waiter():
        client.wait(["k1", "k2"], timeout=20)
        res["vals"] = client.multi_get(["k1", "k2"])

    t = threading.Thread(target=waiter)
    t.start()
    other.set("k1", b"1")
    time.sleep(0.1)
    assert t.is_alive()  # k2 still missing
    other.set("k2", b"2")
    t.join(5)
    assert res["vals"] == [b"1", b"2"]
    other.close()


def test_key_deleted_before_waiter_completes_is_waited_for_again(server, client):
    other = client.clone()
    done = []
    t = threading.Thread(target=lambda: done.append(client.multi_get(["p", "q"], timeout=20)))
    t.start()
    time.sleep(0.1)
    other.set("p", b"1")
    other.delete_key("p")
    other.set("q", b"2")
    time.sleep(0.2)
    assert not done  # p is gone again: still blocked
    other.set("p", b"3")
    t.join(5)
    assert done == [[b"3", b"2"]]
    other.close()


def test_many_waiters_woken_by_one_set(server):
    clients = [StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=20) for _ in range(50)]
    got = []
    ts = [threading.Thread(target=lambda c=c: got.append(c.get("go"))) for c in clients]
    for t in ts:
        t.start()
    assert eventually(lambda: server.stats["requests"] >= 50)
    clients[0].clone().set("go", b"!")
    for t in ts:
        t.join(5)
    assert got == [b"!"] * 50
    for c in clients:
        c.close()


@pytest.mark.parametrize("call", ["get", "wait", "multi_get"])
def test_timeout_names_the_key_and_keeps_connection_in_step(client, call):
    client.set("present", b"yes")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError) as ei:
        if call == "get":
            client.get("absent-key", timeout=0.3)
        elif call == "wait":
            client.wait(["present", "absent-key"], timeout=0.3)
        else:
            client.multi_get(["present", "absent-key"], timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.29 <= elapsed < 2.0
    assert "'absent-key'" in str(ei.value) and "'present'" not in str(ei.value).split("for")[-1]
    assert isinstance(ei.value, TimeoutError)
    # the server answered the timeout, so the same connection is still exact
    assert client.get("present") == b"yes"
    assert client.add("ctr", 2) == 2


def test_default_timeout_applies(server):
    with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=0.2) as c:
        t0 = time.monotonic()
        with pytest.raises(StoreTimeoutError, match="'nothing'"):
            c.get("nothing")
        assert time.monotonic() - t0 < 2
        c.set_timeout(5)
        c.set("nothing", b"1")
        assert c.get("nothing") == b"1"


# --- authentication ------------------------------------------------------------------------------


def test_wrong_secret_is_refused_and_store_untouched(server, client):
    with pytest.raises(StoreAuthError, match="rejected the secret token"):
        StoreClient("127.0.0.1", server.port, token="not-the-secret", timeout=5)
    assert server.stats["auth_failures"] == 1
    assert client.num_keys() == 0
    client.set("k", b"v")
    assert client.get("k") == b"v"


def test_missing_secret_is_refused(server, monkeypatch):
    monkeypatch.delenv("DISTLAUNCH_STORE_TOKEN", raising=False)
    with pytest.raises(StoreAuthError, match="no token was given"):
        StoreClient("127.0.0.1", server.port, timeout=5)
    monkeypatch.setenv("DISTLAUNCH_STORE_TOKEN", TOKEN)
    with StoreClient("127.0.0.1", server.port, timeout=5) as c:  # env var is the default
        c.set("ok", b"1")


def test_unauthenticated_requests_are_never_served(server, client):
    # A well-formed SET sent instead of AUTH: dropped, nothing stored, nothing answered
    # beyond the greeting.
    s = raw_connect(server.port, token=None)
    mtype, _ = recv_frame(s)
    assert mtype == P.HELLO
    s.sendall(set_frame(b"evil", b"1"))
    assert closed_by_peer(s)
    # A wrong MAC followed by a pipelined SET: AUTH_FAIL, close, SET never read.
    s2 = raw_connect(server.port, token=None)
    recv_frame(s2)
    s2.sendall(P.frame(P.AUTH, os.urandom(64)) + set_frame(b"evil2", b"1"))
    assert recv_frame(s2)[0] == P.AUTH_FAIL
    assert closed_by_peer(s2)
    assert not client.check(["evil"]) and not client.check(["evil2"])
    assert client.num_keys() == 0
    s.close()
    s2.close()


def test_client_rejects_server_that_does_not_know_the_secret():
    # A fake "store" that greets correctly but cannot compute the server proof.
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def fake():
        conn, _ = lsock.accept()
        conn.sendall(P.frame(P.HELLO, P.MAGIC + os.urandom(32)))
        recv_frame(conn)
        conn.sendall(P.frame(P.AUTH_OK, os.urandom(32)))
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(StoreAuthError, match="could not prove"):
        StoreClient("127.0.0.1", port, token=TOKEN, timeout=5)
    t.join()
    lsock.close()


def test_non_store_peer_gives_protocol_error():
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def fake():
        conn, _ = lsock.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=fake)
    t.start()
    with pytest.raises(StoreProtocolError):
        StoreClient("127.0.0.1", port, token=TOKEN, timeout=5)
    t.join()
    lsock.close()


@pytest.mark.parametrize("host", ["\u00fc..x", "a" * 64 + "\u00fc"])
def test_a_host_name_idna_cannot_encode_is_one_line_at_once(host):
    """A non-ASCII name with an empty or over-long label: the resolver's UnicodeError
    (not an OSError) would escape as a traceback; it is a connection error naming the
    host, without retrying for connect_timeout."""
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match="not a valid host name") as info:
        StoreClient(host, 1, token=TOKEN, connect_timeout=30)
    assert host in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - start < 10


def test_silent_unauthenticated_connection_is_dropped_after_auth_timeout(monkeypatch):
    from distlaunch.store import protocol

    monkeypatch.setattr(protocol, "AUTH_TIMEOUT", 0.3)
    with StoreServer(token=TOKEN) as srv:
        s = raw_connect(srv.port, token=None)
        assert closed_by_peer(s, timeout=5)
        assert eventually(lambda: srv.num_connections == 0)
        s.close()


# --- hostile and broken peers next to a good client ----------------------------------------------

REQUEST_TYPES = st.sampled_from(sorted(P.REQUEST_NAMES))
GARBAGE = st.one_of(
    st.binary(max_size=300),
    # a correct header with a real request type and a random payload: reaches the
    # payload parser of every request
    st.builds(lambda t, body: P.HEADER.pack(len(body), t) + body, REQUEST_TYPES, st.binary(max_size=200)),
    # the same with a key that parses and a random rest
    st.builds(
        lambda t, key, body: P.HEADER.pack(2 + len(key) + len(body), t) + P.enc_key(key) + body,
        REQUEST_TYPES,
        st.binary(min_size=1, max_size=20),
        st.binary(max_size=40),
    ),
    # a header with an arbitrary type
    st.builds(
        lambda t, body: P.HEADER.pack(len(body), t) + body, st.integers(0, 255), st.binary(max_size=200)
    ),
    # a lying length
    st.builds(
        lambda n, t, body: P.HEADER.pack(n, t) + body,
        st.integers(0, 2**32 - 1),
        st.integers(0, 255),
        st.binary(max_size=50),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=GARBAGE, authed=st.booleans(), value=st.binary(max_size=100))
def test_garbage_never_disturbs_a_good_client(garbage_env, garbage, authed, value):
    srv, good, model = garbage_env
    s = raw_connect(srv.port, token=TOKEN if authed else None)
    try:
        key = f"good/{len(model)}"
        s.sendall(garbage[: len(garbage) // 2])
        good.set(key, value)  # interleaved with the garbage
        model[key] = value
        try:
            s.sendall(garbage[len(garbage) // 2 :])
        except OSError:
            pass  # the server may already have dropped it
        assert good.get(key) == value
        assert good.add("good/count", 1) == len(model)
        assert good.multi_get(list(model)) == list(model.values())
    finally:
        s.close()
    assert srv._thread.is_alive()
    assert srv.stats["internal_errors"] == 0, srv.last_internal_error
    # every raw connection is cleaned up (dropped by the server or closed by us)
    assert eventually(lambda: srv.num_connections == 1, 30)  # the server thread may wait its turn under load


def test_half_sent_frame_blocks_only_its_connection(server, client):
    s = raw_connect(server.port)
    frame = set_frame(b"half", b"x" * 100)
    s.sendall(frame[:50])
    client.set("other", b"1")
    assert client.get("other") == b"1"
    assert not client.check(["half"])
    s.sendall(frame[50:])  # a slow but correct sender is served once complete
    assert recv_frame(s)[0] == P.OK
    assert client.get("half") == b"x" * 100
    s.sendall(frame[:3])  # half a header, then the peer goes away
    s.close()
    assert eventually(lambda: server.num_connections == 1)
    client.set("after", b"2")
    assert client.get("after") == b"2"


@pytest.mark.parametrize(
    "bad",
    [
        P.HEADER.pack(P.MAX_FRAME_BYTES + 1, P.SET),  # frame too big
        P.frame(
            P.SET, P.U16.pack(P.MAX_KEY_BYTES + 1) + b"k" * (P.MAX_KEY_BYTES + 1) + P.enc_value(b"v")
        ),  # key too long
        P.frame(P.SET, P.enc_key(b"k") + P.U32.pack(P.MAX_VALUE_BYTES + 1)),  # value too big
        P.frame(P.CHECK, P.U32.pack(P.MAX_KEYS_PER_REQUEST + 1)),  # too many keys
        P.frame(P.SET, P.enc_key(b"")),  # empty key
        P.frame(P.SET, P.enc_key(b"k") + P.enc_value(b"v") + b"extra"),  # trailing bytes
        P.frame(P.GET, P.enc_key(b"k") + P.F64.pack(float("nan"))),  # NaN timeout
        P.frame(P.GET, P.enc_key(b"k") + P.F64.pack(-1.0)),  # negative timeout
        P.frame(0x7F, b""),  # unknown type
        P.frame(P.AUTH, os.urandom(64)),  # AUTH again
    ],
    ids=["frame", "key", "value", "nkeys", "emptykey", "trailing", "nan", "negative", "unknown", "reauth"],
)
def test_oversized_or_malformed_frame_drops_only_that_connection(server, client, bad):
    s = raw_connect(server.port)
    s.sendall(bad)
    assert closed_by_peer(s)
    assert server.stats["protocol_errors"] == 1
    s.close()
    client.set("still", b"fine")
    assert client.get("still") == b"fine"
    assert client.num_keys() == 1


def test_large_values_round_trip_and_append_limit(client):
    big = os.urandom(8 * 1024 * 1024)  # many partial sends/recvs on both sides
    client.set("big", big)
    assert client.get("big") == big
    assert client.multi_get(["big", "big"]) == [big, big]
    with pytest.raises(ValueError, match="exceeds"):
        client.set("huge", b"\0" * (P.MAX_VALUE_BYTES + 1))
    client.set("edge", b"\0" * (P.MAX_VALUE_BYTES - 1))
    with pytest.raises(StoreError, match="would exceed"):
        client.append("edge", b"12")
    client.append("edge", b"1")
    assert len(client.get("edge")) == P.MAX_VALUE_BYTES


def test_connection_churn(server, client):
    for i in range(300):
        with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c:
            c.add("churn", 1)
        if i % 3 == 0:  # and peers that vanish before or during the handshake
            s = socket.create_connection(("127.0.0.1", server.port))
            if i % 2:
                s.sendall(b"\0\0")
            s.close()
    assert client.get("churn") == b"300"
    assert eventually(lambda: server.num_connections == 1)


def test_thousand_concurrent_connections(server):
    clients = [StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=30) for _ in range(1000)]
    assert server.num_connections == 1000
    results = sorted(c.add("n", 1) for c in clients)
    assert results == list(range(1, 1001))
    assert all(c.get("n") == b"1000" for c in clients[::97])
    for c in clients:
        c.close()
    assert eventually(lambda: server.num_connections == 0)


def test_shared_client_is_thread_safe(client):
    out = []
    lock = threading.Lock()

    def work():
        mine = [client.add("shared", 1) for _ in range(200)]
        client.set(f"t/{threading.get_ident()}", b"x" * 50)
        with lock:
            out.extend(mine)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(out) == list(range(1, 1601))


# --- lifecycle -----------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [False, True], ids=["tcp", "connect_local"])
def test_server_stop_gives_connection_error_not_a_hang(local):
    srv = StoreServer(token=TOKEN).start()
    connect = srv.connect_local if local else None
    blocked = StoreClient("127.0.0.1", srv.port, token=TOKEN, timeout=60, connect=connect)
    idle = StoreClient("127.0.0.1", srv.port, token=TOKEN, timeout=60, connect=connect)
    errs = []

    def run():
        try:
            blocked.get("never")
        except Exception as e:
            errs.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    srv.stop()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert len(errs) == 1 and isinstance(errs[0], StoreConnectionError)
    with pytest.raises(StoreConnectionError):
        idle.ping()
    with pytest.raises(StoreConnectionError, match="closed"):  # and it stays broken
        idle.set("k", b"v")
    srv.stop()  # idempotent
    if local:
        with pytest.raises(StoreError, match="not running"):
            srv.connect_local()


def test_unacknowledged_set_failure_surfaces_by_the_next_reply():
    srv = StoreServer(token=TOKEN).start()
    c = StoreClient("127.0.0.1", srv.port, token=TOKEN, timeout=5)
    srv.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreConnectionError):
        c.set("k", b"v")  # may be written into the dead socket's buffer without error...
        c.get("k")  # ...but the next call that waits for a reply fails
    assert time.monotonic() - t0 < 5


def test_set_is_ordered_before_later_requests_of_the_same_client(server):
    """Unacknowledged sets are applied in order with the client's later requests, and
    ``ping`` makes them visible to every other client."""
    fast = StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=5)
    acked = StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=5, ack_set=True)
    for i in range(300):
        fast.set(f"o/{i}", str(i))
        assert fast.check([f"o/{i}"])  # no ping needed on the same connection
        assert fast.add("o/n", 1) == i + 1
        fast.set("o/last", str(i))
        fast.ping()
        assert acked.get("o/last", timeout=1) == str(i).encode()
        assert acked.check([f"o/{i}"])
        acked.set("o/back", str(i))
        assert fast.compare_set("o/back", str(i), "seen") == b"seen"  # acked: visible at once
    assert fast.num_keys() == 303


def test_client_retries_until_server_is_up():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    out = {}

    def connect():
        out["began"] = time.monotonic()
        c = StoreClient("127.0.0.1", port, token=TOKEN, timeout=10)
        out["value"] = c.get("k")
        c.close()

    t = threading.Thread(target=connect)
    t.start()
    assert eventually(lambda: "began" in out)
    time.sleep(0.3)  # several refused attempts
    up = time.monotonic()
    with StoreServer(port=port, token=TOKEN) as srv:
        StoreClient("127.0.0.1", srv.port, token=TOKEN).set("k", b"up")
        t.join(10)
    assert out["value"] == b"up" and out["began"] < up


def test_connect_timeout_when_nobody_listens():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="could not connect"):
        StoreClient("127.0.0.1", port, token=TOKEN, timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_port_in_use_is_a_store_error(server):
    with pytest.raises(StoreError, match="cannot listen"):
        StoreServer(port=server.port, token=TOKEN).start()


def test_start_raises_soft_fd_limit_to_hard():
    code = (
        "import resource\n"
        "from distlaunch.store import StoreServer\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "s = StoreServer(token='t').start()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20))\n"  # noqa: E501
        "s.stop()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_forever_returns_on_signal(sig):
    code = (
        "import sys\n"
        "from distlaunch.store.server import serve_forever\n"
        "serve_forever('127.0.0.1', 0, 'tok', on_ready=lambda s: print(s.port, flush=True))\n"
        "print('returned', flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        c = StoreClient("127.0.0.1", port, token="tok", timeout=10)
        c.set("k", b"v")
        assert c.get("k") == b"v"
        p.send_signal(sig)
        assert p.wait(10) == 0
        assert p.stdout.read().strip() == "returned"
        with pytest.raises(StoreConnectionError):
            c.get("k")
    finally:
        p.kill()
        p.wait()


# --- real processes --------------------------------------------------------------------------------


def _worker_env():
    env = dict(os.environ, DISTLAUNCH_STORE_TOKEN=TOKEN)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_concurrent_add_from_processes_is_exact(server, client):
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "add", "127.0.0.1", str(server.port), "300"],
            stdout=subprocess.PIPE,
            text=True,
            env=_worker_env(),
        )
        for _ in range(4)
    ]
    time.sleep(0.2)
    client.set("go", b"1")
    seen = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        seen.extend(map(int, out.split()))
    assert sorted(seen) == list(range(1, 1201))  # every add saw a distinct value
    assert client.get("count") == b"1200"


def test_thousand_client_barrier_across_processes(server, client):
    nproc, per = 4, 250
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "barrier",
                "127.0.0.1",
                str(server.port),
                str(per),
                str(nproc * per),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=_worker_env(),
        )
        for _ in range(nproc)
    ]
    client.wait(["connected"], timeout=60)
    assert eventually(lambda: client.get("connected") == str(nproc * per).encode(), 60)
    assert server.num_connections == nproc * per + 1
    client.set("go", b"1")
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert out.startswith("ok ")
    assert client.get("arrived") == b"1000"


# --- hygiene -------------------------------------------------------------------------------------


def test_import_is_stdlib_only_and_has_no_pickle():
    code = (
        "import sys; before = set(sys.modules); import distlaunch.store; "
        "new = set(sys.modules) - before; "
        "print(sorted(m for m in new if m.split('.')[0] not in sys.stdlib_module_names "
        "and not m.startswith('distlaunch'))); print('pickle' in sys.modules, "
        "'asyncio' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.stdout.split("\n")[:2] == ["[]", "False False"], out.stderr
    for f in (ROOT / "distlaunch" / "store").glob("*.py"):
        assert not re.search(r"import\s+pickle|from\s+pickle|pickle\.", f.read_text()), f


def test_reader_rejects_overruns():
    with pytest.raises(StoreProtocolError):
        P.Reader(P.U16.pack(10) + b"abc").key()
    with pytest.raises(StoreProtocolError):
        P.Reader(b"\x00").i64()
    r = P.Reader(P.enc_key(b"ab") + b"x")
    assert r.key() == b"ab"
    with pytest.raises(StoreProtocolError):
        r.done()


def test_docs_table_lists_every_message_type():
    doc = (ROOT / "docs" / "store.md").read_text()
    names = [
        "HELLO",
        "AUTH",
        "AUTH_OK",
        "AUTH_FAIL",
        *(n.upper() for n in P.REQUEST_NAMES.values()),
        "OK",
        "VALUE",
        "INT",
        "BOOL",
        "VALUES",
        "TIMEOUT",
        "ERROR",
    ]
    for name in names:
        code = getattr(P, name)
        assert f"`{name}`" in doc and f"0x{code:02X}" in doc, name
    for limit in ("MAX_KEY_BYTES", "MAX_VALUE_BYTES", "MAX_KEYS_PER_REQUEST", "MAX_FRAME_BYTES"):
        assert limit in doc


def test_hung_server_gives_timeout_not_a_hang(monkeypatch):
    """A peer that authenticates and then never answers: the client's own reply limit
    (timeout + grace) fires, and the out-of-step connection is not reused."""
    from distlaunch.store import client as client_mod

    monkeypatch.setattr(client_mod, "_REPLY_GRACE", 0.2)
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    secret = P.secret_bytes(TOKEN)

    def mute_server():
        conn, _ = lsock.accept()
        nonce = os.urandom(32)
        conn.sendall(P.frame(P.HELLO, P.MAGIC + nonce))
        mtype, body = recv_frame(conn)
        if mtype == P.CLIENT_HELLO:  # the client's optional first frame
            mtype, body = recv_frame(conn)
        conn.sendall(P.frame(P.AUTH_OK, P.mac(secret, P.AUTH_LABEL_SERVER, nonce, body[:32])))
        time.sleep(3)
        conn.close()

    t = threading.Thread(target=mute_server)
    t.start()
    c = StoreClient("127.0.0.1", port, token=TOKEN, timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="get\\('k'\\)"):
        c.get("k")
    assert 0.45 <= time.monotonic() - t0 < 2.5
    with pytest.raises(StoreConnectionError):
        c.set("k", b"v")
    t.join()
    lsock.close()


def test_close_wakes_a_call_blocked_in_another_thread(client):
    errs = []

    def run():
        try:
            client.get("never", timeout=30)
        except Exception as e:
            errs.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    client.close()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(errs[0], StoreConnectionError)
    with pytest.raises(StoreConnectionError, match="closed by the client"):
        client.ping()
    client.close()  # idempotent


def test_prefix_store_rejects_a_str_for_a_key_list(client):
    view = client.prefixed("p")
    with pytest.raises(TypeError):
        view.check("ab")
    with pytest.raises(TypeError):
        view.wait("ab")
    assert view.check(k for k in ["x"]) is False  # any iterable of keys works


def test_listen_backlog_is_large(server):
    import shutil

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) not installed")
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, timeout=10
    ).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert out and out[0] == "LISTEN"
    assert int(out[2]) == min(4096, somaxconn)  # Send-Q of a listener = its backlog
    assert int(out[2]) >= min(1024, somaxconn)


def test_close_waits_until_unacknowledged_sets_are_applied(server, client):
    """set, close, then another client looks without blocking (the exit-then-check
    pattern of a worker and its launcher): the value must be there."""
    for i in range(200):
        w = StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=5)
        w.set(f"exit/{i}", b"x" * 1000)
        w.close()
        assert client.check([f"exit/{i}"])


def test_worker_process_set_then_exit_is_visible(server, client):
    code = (
        "import os, sys\n"
        "from distlaunch.store import StoreClient\n"
        "with StoreClient('127.0.0.1', int(sys.argv[1]), timeout=10) as c:\n"
        "    for i in range(50):\n"
        "        c.set(f'w/{i}', os.urandom(100))\n"
        "    c.set('w/last', b'1')\n"
    )
    for _ in range(3):
        client.delete_key("w/last")
        subprocess.run(
            [sys.executable, "-c", code, str(server.port)], check=True, env=_worker_env(), timeout=30
        )
        assert client.check(["w/last"])


def test_pipelined_requests_behind_a_timed_out_get_are_answered(server, client):
    """A raw client pipelines GET(missing, 0.2 s) + SET + GET: the server answers TIMEOUT,
    then the queued requests, in order (replies never get out of step)."""
    s = raw_connect(server.port)
    s.sendall(
        P.frame(P.GET, P.enc_key(b"nope") + P.F64.pack(0.2))
        + set_frame(b"after", b"1")
        + P.frame(P.GET, P.enc_key(b"after") + P.F64.pack(5.0))
    )
    s.settimeout(5)
    assert recv_frame(s)[0] == P.TIMEOUT
    assert recv_frame(s)[0] == P.OK
    assert recv_frame(s) == (P.VALUE, P.enc_value(b"1"))
    s.close()
    assert client.get("after") == b"1"
