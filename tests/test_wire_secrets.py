"""Issue 22, item 2: no secret ever crosses the wire. A real two-node job (two per-node
launchers on loopback, one rank each, a restart in between) runs collectives while
tcpdump records every byte on its address; then neither the job's token, nor the file
secret it comes from, nor either attempt's transport key may appear in the capture (raw,
hex or base64), and an outsider replaying the captured handshake to a rank is refused.

Before the fix, rank 0 published the transport secret as a store value, which crossed
the wire in clear on every other rank's store connection."""

import base64
import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys

import pytest
from conftest import dl_popen
from ports import free_port
from test_pernode import finish
from test_supervision import wait_for

from distlaunch.collectives.transport.tcp import _proof
from distlaunch.collectives.wire import HEADER_SIZE, HELLO, unpack_header

PROGRAM = """\
import json, os, pathlib, sys, time
import numpy as np
import distlaunch.collectives as dist
from distlaunch.collectives import runtime

out = pathlib.Path(sys.argv[1])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group()
rank = dist.get_rank()
x = np.full(4, rank + 1.0)
dist.all_reduce(x)
assert x.tolist() == [3.0] * 4, x
objs = [None, None]
dist.all_gather_object(objs, {"marker": f"wire-marker-{restart}-{rank}"})
sub = dist.new_group([0, 1])
box = [f"broadcast-marker-{restart}" if rank == 0 else None]
dist.broadcast_object_list(box, src=0, group=sub)
rt = runtime._runtime
key = rt.transport._secret  # the key the transport proves on the wire
info = {"token": os.environ["DISTLAUNCH_STORE_TOKEN"], "key": key.hex(), "port": rt.transport.address[1]}
(out / f"{restart}.{rank}.json").write_text(json.dumps(info))
if restart == 0 and rank == 1:
    sys.exit(3)  # the launchers restart the job: the next attempt must use another key
if restart == 1:
    (out / f"ready.{rank}").write_text("")
    while not (out / "done").exists():  # the test replays a captured handshake meanwhile
        time.sleep(0.02)
    dist.barrier()  # the outsider's attempt did not disturb the group
dist.destroy_process_group()
"""


def _capture(addr: str, pcap) -> subprocess.Popen:
    """tcpdump on lo, every byte to or from ``addr``; returns once it listens (skips the
    test when it cannot capture: tcpdump absent, or no CAP_NET_RAW)."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        pytest.skip("tcpdump is not installed (apt-get install tcpdump)")
    proc = subprocess.Popen(
        # snap length: lo's MTU (65536) and the Ethernet header, not tcpdump's 262144, whose
        # frames let a 16 MiB ring hold 64 packets (it dropped packets under load); the ring
        # (-B, KiB) holds ~2000 such frames; `_streams` checks that no packet was cut
        [tcpdump, "-i", "lo", "-s", "65552", "-U", "--immediate-mode", "-B", "131072", "-Z", "root",
         "-w", str(pcap), f"host {addr}"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "listening on lo, ..." once it captures
    if "listening on" not in line:
        proc.kill()
        proc.wait()
        pytest.skip(f"tcpdump cannot capture on lo here: {line.strip()}")
    return proc


def _streams(pcap) -> dict:
    """The TCP byte streams in a pcap file (Ethernet link, IPv4), keyed by (source port,
    destination port) of the sending side, in sequence order; retransmitted bytes are
    kept once."""
    data = pcap.read_bytes()
    magic = data[:4]
    end = "<" if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
    assert struct.unpack(end + "I", data[20:24])[0] == 1, "expected an Ethernet (EN10MB) capture"
    streams: dict = {}
    pos = 24
    while pos + 16 <= len(data):
        incl, orig = struct.unpack(end + "II", data[pos + 8 : pos + 16])
        assert incl == orig, f"a packet of {orig} bytes was captured cut to {incl}"
        pkt = data[pos + 16 : pos + 16 + incl]
        pos += 16 + incl
        if len(pkt) < 14 + 20 or pkt[12:14] != b"\x08\x00" or pkt[14 + 9] != 6:
            continue  # not IPv4 TCP
        ip = pkt[14:]
        ihl = (ip[0] & 15) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ihl:total]
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        flows = streams.setdefault((sport, dport), [])
        if tcp[13] & 2:  # SYN: a new connection on this port pair
            flows.append([seq + 1, bytearray()])
            continue
        if not flows or not payload:
            continue
        flow = flows[-1]
        skip = (flow[0] - seq) % (1 << 32)
        if skip < len(payload):  # the part not seen before
            flow[1] += payload[skip:]
            flow[0] = (seq + len(payload)) % (1 << 32)
    return {k: [bytes(f[1]) for f in v] for k, v in streams.items()}


def _forms(secret: str) -> list:
    """``secret`` as it could appear on the wire: text, and if hex, its raw bytes, and
    the base64 of both."""
    forms = [secret.encode()]
    try:
        forms.append(bytes.fromhex(secret))
    except ValueError:
        pass
    return forms + [base64.b64encode(f) for f in list(forms)]


def _replay(addr: str, port: int, captured: bytes, key: bytes) -> bytes:
    """Connect to a rank's transport listener as an outsider holding a captured
    connection: send its first HELLO, check the listener's reply with ``key`` (so the key
    the test holds is the one used on the wire), send its captured proof; returns what
    the listener sends back before it closes the connection (b"": refused)."""
    hello = HEADER_SIZE + 16
    proof_end = hello + HEADER_SIZE + 32
    h0, h2 = unpack_header(captured[:HEADER_SIZE]), unpack_header(captured[hello : hello + HEADER_SIZE])
    assert (h0.kind, h0.step, h2.kind, h2.step) == (HELLO, 0, HELLO, 2), "not a captured handshake"
    with socket.create_connection((addr, port), timeout=5) as s:
        s.sendall(captured[:hello])
        reply = b""
        while len(reply) < HEADER_SIZE + 48:
            chunk = s.recv(HEADER_SIZE + 48 - len(reply))
            assert chunk, "the listener closed before answering the first HELLO"
            reply += chunk
        na = reply[HEADER_SIZE : HEADER_SIZE + 16]
        nc = captured[HEADER_SIZE:hello]
        assert reply[-32:] == _proof(key, b"acceptor", h0.src, h0.root, nc, na), "not the job's key"
        s.sendall(captured[hello:proof_end])
        s.settimeout(3.0)  # well below the 5 s handshake timeout: a refusal is at once
        try:
            return s.recv(4096)
        except ConnectionResetError:
            return b""


def test_no_secret_crosses_the_wire_and_a_capture_does_not_authenticate(tmp_path):
    addr = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    port = free_port(addr)
    (tmp_path / "prog.py").write_text(PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLAUNCH_STORE_TOKEN")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "cfg")  # a fresh per-user secret file
    env["DISTLAUNCH_COLL_HOST"] = addr  # transport sockets on the captured address too
    capture = _capture(addr, tmp_path / "job.pcap")
    try:
        nodes = [
            dl_popen(
                "run",
                "--nnodes",
                2,
                "--node-rank",
                k,
                "--master-addr",
                addr,
                "--master-port",
                port,
                "--nproc-per-node",
                1,
                "--max-restarts",
                1,
                "--no-prefix",
                tmp_path / "prog.py",
                out,
                env=env,
            )  # fmt: skip
            for k in range(2)
        ]
        try:
            if not wait_for(lambda: (out / "ready.0").exists() and (out / "ready.1").exists(), 30):
                pytest.fail(f"the job never got ready: {finish(nodes, 5)}")
            infos = {(a, r): json.loads((out / f"{a}.{r}.json").read_text()) for a in (0, 1) for r in (0, 1)}
            # an outsider replays rank 1's captured connection to rank 0's listener
            rank0, to_rank0 = infos[1, 0]["port"], []

            def captured() -> bool:
                streams = _streams(tmp_path / "job.pcap")
                # a connection's handshake (HELLO + nonce, HELLO + proof) is in the file
                whole = 2 * HEADER_SIZE + 48
                to_rank0[:] = [b for (_, d), fl in streams.items() if d == rank0 for b in fl]
                to_rank0[:] = [b for b in to_rank0 if len(b) >= whole]
                return bool(to_rank0)

            assert wait_for(captured, 5), "no connection to rank 0's transport was captured"
            answer = _replay(addr, rank0, to_rank0[-1], bytes.fromhex(infos[1, 0]["key"]))
            assert answer == b"", f"rank 0 answered a replayed handshake: {answer!r}"
        finally:
            (out / "done").write_text("")
            results = finish(nodes)
    finally:
        capture.terminate()
        _, err = capture.communicate(timeout=10)
    assert [r[2] for r in results] == [0, 0], results
    assert re.search(r"^0 packets dropped by kernel", err, re.M), err  # the capture is complete
    streams = _streams(tmp_path / "job.pcap")
    wire = b"\0".join(b for flows in streams.values() for b in flows)
    # the capture holds the job's plain traffic: store keys and values, object payloads
    assert [b for (_, d), flows in streams.items() if d == port for b in flows if b"distlaunch/coll/" in b]
    for a in (0, 1):
        assert f"broadcast-marker-{a}".encode() in wire and f"wire-marker-{a}-1".encode() in wire
    # the two attempts' keys differ, every rank of one attempt holds the same
    assert infos[0, 0]["key"] == infos[0, 1]["key"] != infos[1, 0]["key"] == infos[1, 1]["key"]
    file_secret = (tmp_path / "cfg" / "distlaunch" / "secret").read_text().strip()
    secrets = {file_secret} | {i["token"] for i in infos.values()} | {i["key"] for i in infos.values()}
    for secret in secrets:
        for form in _forms(secret):
            assert form not in wire, f"a secret crossed the wire as {form!r}"


MISMATCH = """\
import sys
import distlaunch.collectives as dist
try:
    dist.init_process_group(init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2, timeout=600)
except Exception as e:
    print(type(e).__name__, e)
"""


def test_a_rank_with_another_secret_fails_at_init_in_one_line(tmp_path):
    """file:// ranks derive the key from their own secret (DISTLAUNCH_STORE_TOKEN here):
    a rank holding another one is told so at init (it matches rank 0's public check
    value), and rank 0 learns it at once and names it (not after its 600 s init timeout),
    instead of failing at its first connection."""
    init = f"file://{tmp_path}/store"
    ranks = []
    for r, token in enumerate(("the-first-secret-0123456789", "another-secret-0123456789")):
        env = dict(os.environ, DISTLAUNCH_STORE_TOKEN=token)
        ranks.append(subprocess.Popen([sys.executable, "-c", MISMATCH, init, str(r)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    (out0, err0), (out1, err1) = (p.communicate(timeout=30) for p in ranks)
    assert out1.startswith("ConfigError rank 1 holds a different secret from rank 0's"), (out1, err1)
    assert "DISTLAUNCH_STORE_TOKEN" in out1 and len(out1.splitlines()) == 1
    assert out0.startswith("ConfigError"), (out0, err0)  # at once: communicate()'s 30 s bound
    assert "ranks [1] hold a different secret from rank 0's" in out0, out0
