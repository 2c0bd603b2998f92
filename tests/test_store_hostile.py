"""The store server against hostile or pipelining peers: real server, real sockets.

* Idle unauthenticated connections (a flood, or enough to exhaust the server's file
  descriptors) must not lock a real client out, and must not make the server spin.
* Pipelined requests are answered in request order and byte-exact, also when an earlier
  request is blocked (GET/WAIT on a missing key) or its large reply is only half sent,
  and a peer that floods frames behind a blocked request cannot make the server buffer
  them without bound.

Raw connections reuse tests/test_store.py's helpers (authentication by the protocol
module's own ``mac``/``frame``).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import pytest
from test_store import (
    TOKEN,
    client,
    eventually,
    raw_connect,
    recv_frame,  # noqa: F401 (fixtures)
    server,
    set_frame,
)

from distlaunch.store import StoreClient, StoreServer
from distlaunch.store import protocol as P

CLK_TCK = os.sysconf("SC_CLK_TCK")


def get_frame(key: bytes, timeout: float) -> bytes:
    return P.frame(P.GET, P.enc_key(key) + P.enc_timeout(timeout))


PING = P.frame(P.PING)


def nothing_to_read(s: socket.socket, seconds: float) -> bool:
    return not select.select([s], [], [], seconds)[0]


def cpu_seconds(stat_path: str) -> float:
    """utime + stime of a process or thread, from /proc/.../stat."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def busy_fraction(stat_path: str, window: float = 1.0) -> float:
    before = cpu_seconds(stat_path)
    time.sleep(window)
    return (cpu_seconds(stat_path) - before) / window


def idle_sockets(port: int, n: int) -> list:
    """``n`` connections that never authenticate (they do not even read the greeting)."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def closed_soon(s: socket.socket, timeout: float = 5.0) -> bool:
    """True if the server closes ``s`` within ``timeout`` (after its HELLO, if any)."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def use(c: StoreClient) -> None:
    c.set("real", b"client")
    assert c.get("real", timeout=5) == b"client"
    assert c.add("n", 1) >= 1


# --- unauthenticated connections ---------------------------------------------------------------


def test_idle_unauthenticated_flood_cannot_lock_out_a_real_client():
    cap = 32
    with StoreServer(token=TOKEN, max_unauthenticated=cap) as srv:
        flood = idle_sockets(srv.port, 200)
        try:
            # The oldest pending connections made room for the newer ones.
            assert eventually(lambda: srv.num_connections == cap)
            assert closed_soon(flood[0])
            assert not closed_soon(flood[-1], timeout=0.2)
            t0 = time.monotonic()
            with StoreClient("127.0.0.1", srv.port, token=TOKEN, timeout=10, connect_timeout=10) as c:
                use(c)
                assert time.monotonic() - t0 < 5.0
                # Holding `cap` idle connections costs no CPU (no polling, no spinning).
                assert busy_fraction(f"/proc/self/task/{srv._thread.native_id}/stat") < 0.3
            assert srv.stats["unauthenticated_dropped"] >= 200 - cap
            assert srv.stats["internal_errors"] == 0, srv.last_internal_error
        finally:
            for s in flood:
                s.close()


def test_max_unauthenticated_is_checked():
    with pytest.raises(ValueError, match="max_unauthenticated"):
        StoreServer(token=TOKEN, max_unauthenticated=0)


SERVER_WITH_FEW_FDS = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))
from distlaunch.store import serve_forever
serve_forever(token=sys.argv[1], on_ready=lambda s: print(s.port, flush=True))
"""


def test_idle_connections_exhausting_descriptors_cannot_lock_out_a_real_client():
    """With the default cap above the server's descriptor limit, idle connections run it
    out of descriptors: it must then close the oldest unauthenticated one to accept."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_WITH_FEW_FDS, TOKEN], stdout=subprocess.PIPE, text=True
    )
    flood = []
    try:
        port = int(proc.stdout.readline())
        flood = idle_sockets(port, 150)  # more than the server's 96 descriptors
        with StoreClient("127.0.0.1", port, token=TOKEN, timeout=10, connect_timeout=8) as c:
            use(c)
            assert busy_fraction(f"/proc/{proc.pid}/stat") < 0.3
    finally:
        for s in flood:
            s.close()
        proc.terminate()
        proc.wait(10)


# --- pipelining -------------------------------------------------------------------------------


def test_ping_behind_a_blocked_get_is_answered_after_it(server, client):
    s = raw_connect(server.port)
    s.sendall(get_frame(b"later", 10.0))
    time.sleep(0.2)  # the GET is parked on the server
    s.sendall(PING)
    assert nothing_to_read(s, 0.3), "the PING was answered before the blocked GET"
    client.set("later", b"v")
    assert recv_frame(s) == (P.VALUE, P.enc_value(b"v"))
    assert recv_frame(s) == (P.OK, b"")
    s.close()


def test_request_behind_a_blocked_wait_is_answered_after_its_timeout(server, client):
    client.set("there", b"1")
    s = raw_connect(server.port)
    s.sendall(P.frame(P.WAIT, P.enc_keys([b"never"]) + P.enc_timeout(0.5)))
    time.sleep(0.1)
    s.sendall(get_frame(b"there", 5.0))
    assert recv_frame(s) == (P.TIMEOUT, P.enc_keys([b"never"]))
    assert recv_frame(s) == (P.VALUE, P.enc_value(b"1"))
    s.close()


@pytest.mark.parametrize("together", [False, True], ids=["ping-sent-later", "one-send"])
def test_ping_behind_a_half_sent_32mib_reply_keeps_the_value_exact(server, client, together):
    value = os.urandom(32 << 20)
    client.set("big", value)
    s = raw_connect(server.port)
    if together:
        s.sendall(get_frame(b"big", 5.0) + PING)
    else:
        s.sendall(get_frame(b"big", 5.0))
        time.sleep(0.2)  # we do not read: the server's reply stops part-way
        s.sendall(PING)
    mtype, body = recv_frame(s)
    assert mtype == P.VALUE and len(body) == 4 + len(value)
    assert body[4:] == value
    assert recv_frame(s) == (P.OK, b"")
    s.close()


def test_frames_pipelined_behind_a_blocked_get_are_served_in_order(server, client):
    value = os.urandom(60_000)
    sets = 70  # about 4 MiB: more than the socket buffers hold, so the server reads on
    s = raw_connect(server.port)
    s.sendall(get_frame(b"gate", 30.0))
    time.sleep(0.1)
    s.sendall(b"".join(set_frame(b"queued/%d" % i, value) for i in range(sets)) + PING)
    assert nothing_to_read(s, 0.3), "a frame behind the blocked GET was answered first"
    assert not client.check(["queued/0"]), "a frame behind the blocked GET was applied"
    client.set("gate", b"open")
    assert recv_frame(s) == (P.VALUE, P.enc_value(b"open"))
    for _ in range(sets):
        assert recv_frame(s) == (P.OK, b"")
    assert recv_frame(s) == (P.OK, b"")  # the PING
    assert client.multi_get([f"queued/{i}" for i in range(sets)]) == [value] * sets
    s.close()


def test_flood_behind_a_blocked_get_is_not_buffered_without_bound(server, client):
    """Past one maximum frame kept behind a blocked request, the server closes the
    connection (a client that pipelines sends at most one frame ahead)."""
    chunk = P.frame(P.SET_NOREPLY, P.enc_key(b"flood") + P.enc_value(bytes(1 << 20)))
    limit = 4 * P.MAX_FRAME_BYTES
    s = raw_connect(server.port)
    s.sendall(get_frame(b"gate", 30.0))
    s.settimeout(10)
    sent = 0
    try:
        while sent < limit:
            s.sendall(chunk * 8)
            sent += 8 * len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert sent < limit, "the server kept buffering behind a blocked request"
    assert sent > P.MAX_FRAME_BYTES
    assert eventually(lambda: server.num_connections == 1)
    assert server.stats["protocol_errors"] == 1
    assert not client.check(["flood"])  # nothing behind the GET was handled
    client.set("gate", b"1")
    assert client.get("gate") == b"1"
    s.close()


def test_blocked_flooding_peer_that_goes_away_is_cleaned_up(server, client):
    s = raw_connect(server.port)
    s.sendall(get_frame(b"gate", float("inf")))
    s.setblocking(False)
    try:
        for _ in range(1000):  # bounded: the old server read without end
            if not select.select([], [s], [], 0.3)[1]:
                break
            s.send(PING * 10_000)
    except BlockingIOError:
        pass
    assert server.num_connections == 2
    s.close()
    assert eventually(lambda: server.num_connections == 1)
    client.set("gate", b"1")  # nobody is woken (the waiter was retired with its connection)
    assert client.get("gate") == b"1"


FLOODER = """
import collections, socket, sys
held = collections.deque()
port, hold = int(sys.argv[1]), int(sys.argv[2])
print("flooding", flush=True)
while True:
    try:
        held.append(socket.create_connection(("127.0.0.1", port)))
    except OSError:
        pass
    if len(held) > hold:
        held.popleft().close()
"""


def test_real_client_gets_in_during_a_connection_flood():
    """Idle connections keep arriving (more than the cap) while a real client connects:
    the oldest unauthenticated ones make room, and the client's handshake completes."""
    cap = 1024
    with StoreServer(token=TOKEN, max_unauthenticated=cap) as srv:
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, str(srv.port), str(2 * cap)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert flooder.stdout.readline() == "flooding\n"
            assert eventually(lambda: srv.stats["unauthenticated_dropped"] > cap, 20)
            for _ in range(3):
                with StoreClient("127.0.0.1", srv.port, token=TOKEN, timeout=10, connect_timeout=10) as c:
                    use(c)
                    assert srv.num_connections <= cap + 1  # the cap, and this client
            assert srv.stats["internal_errors"] == 0, srv.last_internal_error
        finally:
            flooder.kill()
            flooder.wait(10)
