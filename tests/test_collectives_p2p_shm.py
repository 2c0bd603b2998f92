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

CASES = [(2, "shm", None), (3, "shm", "4096"), (4, "shm", None), (2, "tcp", None)]


@pytest.mark.parametrize("n,mode,ring", CASES, ids=[f"{n}-{m}-{r or 'default'}" for n, m, r in CASES])
def test_p2p_correct_on_both_paths(n, mode, ring, tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    env = {**os.environ, "DISTLAUNCH_SHM": "1" if mode == "shm" else "0"}
    if ring:
        env["DISTLAUNCH_SHM_P2P_RING"] = ring
    res = dl("run", "--nproc-per-node", str(n), path, timeout=120, env=env)
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
