"""distlaunch.collectives send/recv/isend/irecv between ranks of one node, over shared
memory and over TCP (DISTLAUNCH_SHM=0), with the default ring and a tiny one (every
message wraps and streams in pieces): sizes around the ring's boundaries, any-source
receives, order per (source, tag), many outstanding isends, and a peer killed in the
middle of a message (the survivor raises PeerLostError within seconds)."""

import os

import pytest
from conftest import dl

WORKER = """
import os, sys, time
import numpy as np
import distlaunch.collectives as dist

dist.init_process_group(timeout=120)
rank, n = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % n, (rank - 1) % n


def payload(src, size, k=0):
    return ((np.arange(size, dtype=np.int64) * 31 + src * 7 + k) % 251).astype(np.float32)


for size in [0, 1, 15, 16, 17, 1007, 1008, 1009, 1024, 16383, 16384, 16385, (1 << 18) + 1, 3 << 18]:
    got = np.empty(size, np.float32)
    r = dist.irecv(got, src=left, tag=size % 1000)
    dist.send(payload(rank, size), dst=right, tag=size % 1000)
    r.wait()
    assert (got == payload(left, size)).all(), size
print(rank, "sizes ok", flush=True)

if rank == 0:  # any source: every other rank once
    srcs = []
    for _ in range(n - 1):
        buf = np.empty(100, np.float32)
        src = dist.recv(buf)
        assert (buf == payload(src, 100)).all()
        srcs.append(src)
    assert sorted(srcs) == list(range(1, n)), srcs
else:
    dist.send(payload(rank, 100), dst=0)

dist.barrier()
count, tags = 30, (3, 4)
if rank == 1:  # order per (source, tag): tags interleaved, received tag by tag
    sizes = [20000 if k % 7 == 0 else 4 for k in range(count)]
    works = [dist.isend(payload(k, sizes[k], t), dst=0, tag=t) for k in range(count) for t in tags]
    for w in works:
        w.wait()
elif rank == 0:
    for t in reversed(tags):
        for k in range(count):
            buf = np.empty(20000 if k % 7 == 0 else 4, np.float32)
            dist.recv(buf, src=1, tag=t)
            assert (buf == payload(k, buf.size, t)).all(), (t, k)
print(rank, "order ok", flush=True)

m = 150  # many outstanding isends and irecvs at once
ins = [np.empty(1 + k * 37, np.float32) for k in range(m)]
works = [dist.irecv(ins[k], src=left, tag=k) for k in range(m)]
works += [dist.isend(payload(rank, 1 + k * 37, k), dst=right, tag=k) for k in range(m)]
for w in works:
    w.wait()
assert all((ins[k] == payload(left, ins[k].size, k)).all() for k in range(m))
print(rank, "outstanding ok", flush=True)

if "die" in sys.argv and n == 2:
    big = np.ones(8 << 20, np.float32)
    dist.barrier()
    if rank == 1:
        dist.isend(big, dst=0)
        time.sleep(0.3)
        os._exit(0)
    t = time.monotonic()
    try:
        dist.recv(big, src=1)
        print("completed")
    except Exception as e:
        print("raised", type(e).__name__, round(time.monotonic() - t), flush=True)
    os._exit(0)
dist.destroy_process_group()
"""


def run(script, n, mode, ring, tmp_path, *args):
    """``script`` under distlaunch run at world size ``n``, shared memory or TCP, with
    the ring size ``ring`` (None: the default)."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "DISTLAUNCH_SHM": "1" if mode == "shm" else "0"}
    if ring:
        env["DISTLAUNCH_SHM_P2P_RING"] = ring
    return dl("run", "--nproc-per-node", str(n), path, *args, timeout=120, env=env)


CASES = [(2, "shm", None), (3, "shm", "4096"), (4, "shm", None), (2, "tcp", None)]


@pytest.mark.parametrize("n,mode,ring", CASES, ids=[f"{n}-{m}-{r or 'default'}" for n, m, r in CASES])
def test_p2p_correct_on_both_paths(n, mode, ring, tmp_path):
    res = run(WORKER, n, mode, ring, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for r in range(n):
        for what in ("sizes", "order", "outstanding"):
            assert f"[{r}]: {r} {what} ok" in res.stdout, res.stdout


def test_peer_dying_mid_message_raises(tmp_path):
    """32 MiB through a 64 KiB ring; the sender exits after the first pieces."""
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    env = {**os.environ, "DISTLAUNCH_SHM_P2P_RING": "65536"}
    res = dl("run", "--nproc-per-node", "2", path, "die", timeout=120, env=env)
    lines = [ln for ln in res.stdout.splitlines() if "raised" in ln or "completed" in ln]
    assert len(lines) == 1 and "raised PeerLostError" in lines[0], res.stdout + res.stderr[-3000:]
    assert int(lines[0].split()[-1]) < 20


# The fast paths of send/recv between ranks of one node (a message that fits the ring is
# written at once; a blocking recv with nothing else pending copies it straight from the
# ring): every case where taking the ring's next message could overtake something, run
# on shared memory and, for reference, on TCP (DISTLAUNCH_SHM=0), which has no fast path.
FAST = """
import os, sys, time
import numpy as np
import distlaunch.collectives as dist
from distlaunch.collectives import CollectiveArgumentError, CollectiveMismatchError

dist.init_process_group(timeout=60)
rank, n = dist.get_rank(), dist.get_world_size()
ring = int(os.environ.get("DISTLAUNCH_SHM_P2P_RING", 1 << 20))


def payload(size, k, dtype=np.uint8):
    return ((np.arange(size, dtype=np.int64) * 13 + k) % 251).astype(dtype)


def expect(buf, k):
    assert (buf == payload(buf.size, k, buf.dtype)).all(), (buf.size, k)


def ok(what):
    print(rank, what, "ok", flush=True)


# interleaved tags, all in the ring before the receiver starts, received tag by tag
if rank == 1:
    for k in range(12):
        dist.send(payload(8, k), dst=0, tag=k % 2)
dist.barrier()
if rank == 0:
    for k in [1, 3, 5, 7, 9, 11, 0, 2, 4, 6, 8, 10]:
        buf = np.empty(8, np.uint8)
        assert dist.recv(buf, src=1, tag=k % 2) == 1
        expect(buf, k)
ok("tags")

# an any-source receive of tag 8 while a tag-7 message of the same sender waits before
# it in the ring (now kept aside), then another tag-7 message comes: the kept one first
if rank == 1:
    dist.send(payload(5, 70), dst=0, tag=7)
    dist.send(payload(5, 80), dst=0, tag=8)
dist.barrier()
if rank == 0:
    a, b, c = np.empty(5, np.uint8), np.empty(5, np.uint8), np.empty(5, np.uint8)
    assert dist.recv(b, tag=8) == 1
dist.barrier()
if rank == 1:
    dist.send(payload(5, 71), dst=0, tag=7)
dist.barrier()
if rank == 0:
    assert dist.recv(a, src=1, tag=7) == 1
    assert dist.recv(c, src=1, tag=7) == 1
    expect(a, 70), expect(b, 80), expect(c, 71)
ok("anysource")

# a posted irecv is matched before a later blocking recv of the same source and tag,
# with both messages already in the ring when the recv starts
if rank == 0:
    first, second = np.empty(3, np.uint8), np.empty(3, np.uint8)
    w = dist.irecv(first, src=1, tag=5)
dist.barrier()
if rank == 1:
    works = [dist.isend(payload(3, k), dst=0, tag=5) for k in (50, 51)]
    assert all(w.is_completed() for w in works)  # written at once (TCP: handed to the OS)
dist.barrier()
if rank == 0:
    assert dist.recv(second, src=1, tag=5) == 1
    assert w.wait() and w.result() == 1
    expect(first, 50), expect(second, 51)
    # irecvs started with the messages already there: in order, complete at once
    bufs = [np.empty(3, np.uint8) for _ in range(3)]
dist.barrier()
if rank == 1:
    for k in range(3):
        dist.send(payload(3, 60 + k), dst=0, tag=6)
dist.barrier()
if rank == 0:
    works = [dist.irecv(b, src=1, tag=6) for b in bufs]
    for k, (b, w) in enumerate(zip(bufs, works)):
        w.wait()
        expect(b, 60 + k)
# irecvs started before their messages: matched in call order, whichever is waited
# first, an any-source irecv after a specific one included; a test() loop completes one
for tags in ((3, 3), (4, 4), (3, None)):  # None: any-source irecv
    if rank == 0:
        a, b = np.empty(3, np.uint8), np.empty(3, np.uint8)
        w1 = dist.irecv(a, src=1, tag=tags[0])
        w2 = dist.irecv(b, src=tags[1] and 1, tag=3)
    dist.barrier()
    if rank == 1:
        dist.send(payload(3, 30), dst=0, tag=tags[0])
        dist.send(payload(3, 31), dst=0, tag=3)
    dist.barrier()
    if rank == 0:
        assert w2.result() == 1 and w1.result() == 1
        expect(a, 30), expect(b, 31)
if rank == 0:
    e = np.empty(3, np.uint8)
    w5 = dist.irecv(e, src=1, tag=2)
dist.barrier()
if rank == 1:
    dist.send(payload(3, 20), dst=0, tag=2)
elif rank == 0:
    end = time.monotonic() + 30
    while not w5.is_completed():
        assert time.monotonic() < end, "irecv never completed"
    assert w5.result() == 1
    expect(e, 20)
ok("irecv")

# around the ring's size (a message takes a 64-byte record and its payload): the
# largest that is written at once, one byte more, the ring's size, one byte more
sizes = [ring - 65, ring - 64, ring - 63, ring, ring + 1]
for k, size in enumerate(sizes):
    got = np.empty(size, np.uint8)
    if rank == 0:
        dist.send(payload(size, k), dst=1, tag=size % 100)
        dist.recv(got, src=1, tag=size % 100)
    elif rank == 1:
        dist.recv(got, src=0, tag=size % 100)
        dist.send(payload(size, k + 1), dst=0, tag=size % 100)
    if rank < 2:
        expect(got, k + (rank == 0))
if rank == 1:  # all sent before the receiver looks: written at once or queued behind
    works = [dist.isend(payload(size, k), dst=0) for k, size in enumerate(sizes)]
    for w in works:
        w.wait()
elif rank == 0:
    for k, size in enumerate(sizes):
        got = np.empty(size, np.uint8)
        dist.recv(got, src=1)
        expect(got, k)
ok("ringsize")

# a non-contiguous buffer is refused before anything is sent; the pair goes on
if rank < 2:
    strided = np.zeros(8, np.float32)[::2]
    for call in (lambda: dist.send(strided, dst=1 - rank), lambda: dist.recv(strided, src=1 - rank)):
        try:
            call()
            raise SystemExit("non-contiguous buffer accepted")
        except CollectiveArgumentError:
            pass
    got = np.empty(4, np.float32)
    if rank == 0:
        dist.send(np.ascontiguousarray(payload(8, 3, np.float32)[::2]), dst=1)
    else:
        dist.recv(got, src=0)
        assert (got == payload(8, 3, np.float32)[::2]).all()
ok("strided")

# another dtype (same byte count) or element count: CollectiveMismatchError (what then
# becomes of the message differs between the paths, as before), and messages of
# another tag still arrive in order
if rank == 1:
    dist.send(payload(4, 90, np.float32), dst=0, tag=9)
    dist.send(payload(4, 91, np.float32), dst=0, tag=11)
    dist.send(payload(4, 92, np.float32), dst=0, tag=10)
    dist.send(payload(4, 93, np.float32), dst=0, tag=10)
dist.barrier()
if rank == 0:
    for wrong, tag in ((np.empty(4, np.int32), 9), (np.empty(3, np.float32), 11)):
        try:
            dist.recv(wrong, src=1, tag=tag)
            raise SystemExit("mismatch not detected")
        except CollectiveMismatchError as e:
            print("mismatch:", str(e).split("but ")[-1].strip(), flush=True)
    for k in (92, 93):
        got = np.empty(4, np.float32)
        dist.recv(got, src=1, tag=10)
        expect(got, k)
dist.barrier()
ok("mismatch")

# group ranks vs global ranks: a group of the last two ranks
if n == 3:
    g = dist.new_group([1, 2])
    if rank == 2:
        dist.send(payload(6, 20), group=g, group_dst=0, tag=2)
        dist.send(payload(6, 21), dst=1, group=g, tag=2)
    elif rank == 1:
        a, b = np.empty(6, np.uint8), np.empty(6, np.uint8)
        assert dist.recv(a, group=g, group_src=1, tag=2) == 1  # its group rank
        assert dist.recv(b, src=2, group=g, tag=2) == 2  # its global rank
        expect(a, 20), expect(b, 21)
ok("groups")

if "die" in sys.argv:  # a small blocking recv from a rank that exits
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        os._exit(0)
    if rank == 0:
        t = time.monotonic()
        try:
            dist.recv(np.empty(4, np.uint8), src=1)
            print("completed", flush=True)
        except Exception as e:
            print("raised", type(e).__name__, round(time.monotonic() - t), flush=True)
    os._exit(0)
dist.destroy_process_group()
"""

FAST_CASES = [(3, "shm", "4096"), (2, "shm", None), (3, "tcp", "4096")]


@pytest.mark.parametrize(
    "n,mode,ring", FAST_CASES, ids=[f"{n}-{m}-{r or 'default'}" for n, m, r in FAST_CASES]
)
def test_fast_path_keeps_the_semantics(n, mode, ring, tmp_path):
    res = run(FAST, n, mode, ring, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(n):
        for what in ("tags", "anysource", "irecv", "ringsize", "strided", "mismatch", "groups"):
            assert f"[{r}]: {r} {what} ok" in res.stdout, res.stdout + res.stderr[-3000:]
    mismatches = [ln.split("mismatch: ", 1)[1] for ln in res.stdout.splitlines() if "mismatch: " in ln]
    assert mismatches == ["rank 0 receives 4 x int32", "rank 0 receives 3 x float32"], mismatches


def test_small_recv_from_exited_peer_raises(tmp_path):
    path = tmp_path / "fast.py"
    path.write_text(FAST)
    res = dl("run", "--nproc-per-node", "2", path, "die", timeout=120)
    lines = [ln for ln in res.stdout.splitlines() if "raised" in ln or "completed" in ln]
    assert len(lines) == 1 and "raised PeerLostError" in lines[0], res.stdout + res.stderr[-3000:]
    assert int(lines[0].split()[-1]) < 20


def test_waiting_recv_busy_polls_once(tmp_path, monkeypatch):
    """DISTLAUNCH_SHM_P2P_BUSY_US bounds a blocking recv's busy-poll as a whole: with
    200 ms configured, a recv waiting 1.5 s spins once (the fast path's try), then
    sleeps on the links (~0.2 s of CPU); it spun a second time in the posted receive's
    wait (~0.4 s)."""
    monkeypatch.setenv("DISTLAUNCH_SHM_P2P_BUSY_US", "200000")
    path = tmp_path / "late.py"
    path.write_text(
        "import time\nimport numpy as np\nimport distlaunch.collectives as dist\n"
        "dist.init_process_group(timeout=60)\n"
        "buf = np.zeros(8, np.uint8)\n"
        "for _ in range(3):  # the links know both ranks' processes: busy-polling is on\n"
        "    dist.send(buf, dst=1, tag=0) if dist.get_rank() == 0 else dist.recv(buf, src=0, tag=0)\n"
        "dist.barrier()\n"
        "if dist.get_rank() == 0:\n"
        "    time.sleep(1.5)\n"
        "    dist.send(buf, dst=1, tag=1)\n"
        "else:\n"
        "    cpu, t = time.process_time(), time.monotonic()\n"
        "    dist.recv(buf, src=0, tag=1)\n"
        "    print('waited', round(time.monotonic() - t, 2), 'cpu', round(time.process_time() - cpu, 3))\n"
        "dist.destroy_process_group()\n"
    )
    res = dl("run", "--nproc-per-node", "2", path, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    words = next(ln for ln in res.stdout.splitlines() if "waited" in ln).split()
    assert float(words[-3]) >= 1.4
    assert float(words[-1]) < 0.3, res.stdout  # 0.40 when it spun twice, 0.21 now
