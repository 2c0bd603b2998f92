"""A small or full /dev/shm: shared-memory segments reserve their pages when they are
created, and when that fails every rank of the node uses TCP instead, with one warning
line naming /dev/shm, its size and the fix (it was SIGBUS, exit 135, no message). The
jobs run in a private mount namespace (``unshare --mount``) with a tiny tmpfs on
/dev/shm; the verdict every process reaches on one segment is tested on a tmpfs of its
own."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
from conftest import dl_cmd
from ports import free_port

WORKER = """
import numpy as np
import distlaunch.collectives as dist

dist.init_process_group(timeout=60)
rank, n = dist.get_rank(), dist.get_world_size()
a = np.full(1 << 20, rank + 1, np.float32)  # 4 MiB: every phase of the shared-memory channel
dist.all_reduce(a)
assert (a == n * (n + 1) / 2).all()
b = np.full(1 << 19, rank, np.float32)  # 2 MiB through the point-to-point inboxes
got = np.empty_like(b)
r = dist.irecv(got, src=(rank - 1) % n)
dist.send(b, dst=(rank + 1) % n)
r.wait()
assert (got == (rank - 1) % n).all()
print(rank, "ok", flush=True)
"""


def unshare_reason() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    cp = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True
    )
    if cp.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {cp.stderr.decode().strip()}"
    return None


@pytest.fixture(scope="module")
def can_unshare():
    reason = unshare_reason()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize(
    "size, full",
    # 1 MiB: the channel (32 MiB for 4 ranks) and the inboxes (4 MiB each) do not fit;
    # 40 MiB: the channel does, the four inboxes after it do not all fit (mixed verdicts)
    [("1m", "32.1 MiB"), ("40m", "4.1 MiB")],
)
def test_small_dev_shm_falls_back_to_tcp_with_one_warning(can_unshare, tmp_path, size, full):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run = " ".join(dl_cmd("run", "--nproc-per-node", "4", script))
    inner = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {run}"
    cp = subprocess.run(
        ["unshare", "--mount", "sh", "-c", inner], capture_output=True, text=True, timeout=120
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert sorted(line.split()[1] for line in cp.stdout.splitlines()) == ["0", "1", "2", "3"], cp.stdout
    warnings = [line for line in cp.stderr.splitlines() if "/dev/shm" in line]
    assert len(warnings) == 1, cp.stderr
    assert f"/dev/shm ({size[:-1]}.0 MiB" in warnings[0] and f"a {full} shared-memory segment" in warnings[0]
    assert "--shm-size" in warnings[0] and "DISTLAUNCH_SHM=0" in warnings[0]


HIERARCHICAL = """
import numpy as np
import distlaunch.collectives as dist

dist.init_process_group(timeout=60)
rank, n = dist.get_rank(), dist.get_world_size()
for size in [(1 << 20) + 1, 1000, 3]:  # 2D (its last chunk: one element), small, tiny
    a = np.full(size, rank + 1, np.float32)
    dist.all_reduce(a)
    assert (a == n * (n + 1) / 2).all(), size
    a = np.full(size, rank + 1, np.float64)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    assert (a == (n + 1) / 2).all(), size
b = np.full(1 << 18, rank, np.int32)
dist.broadcast(b, src=1)  # a root that is not its node's leader
assert (b == 1).all()
dist.barrier()
print(rank, "ok", flush=True)
"""


@pytest.mark.parametrize("sizes", [("1m", "100m"), ("1m", "1m")], ids=["one-node-small", "both-small"])
def test_small_dev_shm_on_a_node_of_a_hierarchical_group(can_unshare, tmp_path, sizes):
    """Two nodes of 2 ranks (two per-node launchers, each with its own /dev/shm): a node
    whose node-local segment does not fit runs its node-local steps over TCP, the other
    node on shared memory, and the column and leader steps between them still meet
    (all_reduce in both forms, broadcast from a non-leader, barrier)."""
    script = tmp_path / "worker.py"
    script.write_text(HIERARCHICAL)
    port = str(free_port())
    procs = []
    for k, size in enumerate(sizes):
        run = dl_cmd(
            "run", "--nnodes", "2", "--node-rank", k, "--master-port", port, "--nproc-per-node", "2", script
        )
        inner = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {' '.join(run)}"
        procs.append(
            subprocess.Popen(
                ["unshare", "--mount", "sh", "-c", inner],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    assert sorted(line.split()[1] for o, _ in outs for line in o.splitlines()) == ["0", "1", "2", "3"]
    for size, (_, err) in zip(sizes, outs):
        warnings = [line for line in err.splitlines() if "/dev/shm" in line]
        assert len(warnings) == (size == "1m"), err


# --- one verdict per segment ---------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path):
    """A 1 MiB tmpfs of its own."""
    d = tmp_path / "shm"
    d.mkdir()
    cp = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True)
    if cp.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill(d, name="filler") -> None:
    """Take every free byte of ``d`` (a tmpfs)."""
    fd = os.open(d / name, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


MAP_AND_TOUCH = """
import sys
from distlaunch.collectives.transport.shm import ShmFullError, map_segment
try:
    mm = map_segment(sys.argv[1], int(sys.argv[2]))
except ShmFullError as e:
    print("full:", e)
    sys.exit(0)
mm[:] = b"y" * len(mm)  # every page: a missing one would be SIGBUS
print("mapped")
"""


def map_in_process(path, size: int) -> str:
    cp = subprocess.run(
        [sys.executable, "-c", MAP_AND_TOUCH, str(path), str(size)], capture_output=True, text=True
    )
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.strip()


def test_a_segment_that_failed_stays_failed_for_every_process(tiny):
    """The first process cannot reserve the segment; a later one, with room by then,
    gets the same answer (it would otherwise use shared memory that the first one does
    not read), and no data file is left."""
    fill(tiny)
    seg = tiny / "seg"
    assert map_in_process(seg, 512 << 10).startswith("full: ")
    os.unlink(tiny / "filler")
    assert map_in_process(seg, 512 << 10).startswith("full: ")
    assert sorted(os.listdir(tiny)) == ["seg-ok"]


def test_a_reserved_segment_maps_in_every_process_even_when_the_disk_is_full(tiny):
    """The first process reserves every page; a later one maps the segment although the
    tmpfs is full by then, and can write every page."""
    seg = tiny / "seg"
    assert map_in_process(seg, 512 << 10) == "mapped"
    fill(tiny)
    assert map_in_process(seg, 512 << 10) == "mapped"


def test_a_verdict_removed_while_it_is_read_is_voted_again(tmp_path):
    # a rank that maps a peer's segment while the peer, ending right after its last
    # send, unlinks the segment and its verdict: the vote must not fail (it raised
    # FileNotFoundError between symlink's EEXIST and readlink)
    import threading

    from distlaunch.collectives.transport.shm import _VERDICT, _vote

    path = str(tmp_path / "seg")
    link = path + _VERDICT
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            try:
                os.symlink("1", link)
                os.unlink(link)
            except OSError:
                pass

    t = threading.Thread(target=churn)
    t.start()
    try:
        assert all(_vote(path, True) for _ in range(20000))
    finally:
        stop.set()
        t.join()
