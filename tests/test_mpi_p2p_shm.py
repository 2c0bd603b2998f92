"""distlaunch.mpi point-to-point over shared memory (ranks of one node) and over TCP
(DISTLAUNCH_SHM=0): the stress program of tests/mpi_programs compared line by line with
MPICH, also with a tiny ring (every message wraps and streams in pieces); a peer that
dies in the middle of a message; a worker thread failing as mpiexec reports it."""

import os
import subprocess
import sys
import time

import pytest
from conftest import dl
from mpi_run import MPIEXEC, have_mpich, program, run

CASES = [(2, "shm", None), (4, "shm", "4096"), (3, "tcp", None)]


@pytest.mark.parametrize("n,mode,ring", CASES, ids=[f"{n}-{m}-{r or 'default'}" for n, m, r in CASES])
def test_stress_program_matches_mpich(n, mode, ring, tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if mode == "shm" else "0")
    if ring:
        monkeypatch.setenv("DISTLAUNCH_SHM_P2P_RING", ring)
    rc, mine, err = run("p2p_stress", n, tmp_path, ours=True, timeout=120)
    assert rc == 0, err[-3000:]
    assert not [ln for ln in mine if "BAD" in ln or "False" in ln], mine
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    rc2, theirs, err2 = run("p2p_stress", n, tmp_path, ours=False, timeout=120)
    assert rc2 == 0, err2[-3000:]
    assert mine == theirs


@pytest.mark.parametrize("name,n", [("osu_bibw", 2), ("osu_multi_lat", 4)])
def test_osu_programs_print_mpichs_rows(name, n, tmp_path):
    args = ("4096", "3") if name == "osu_bibw" else ("1024", "5", "1")
    rc, mine, err = run(name, n, tmp_path, ours=True, args=args)
    assert rc == 0, err[-3000:]
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    rc2, theirs, err2 = run(name, n, tmp_path, ours=False, args=args)
    assert rc2 == 0, err2[-3000:]
    assert [ln.split()[0] for ln in mine] == [ln.split()[0] for ln in theirs]


def _script(tmp_path, body):
    path = tmp_path / "prog.py"
    path.write_text("import os, time\nimport numpy as np\nfrom distlaunch import mpi as MPI\n" + body)
    return path


def _assert_survivor_raises_peer_lost(tmp_path, setup: str, call: str) -> None:
    """Run ``setup`` then time ``call`` (one statement) on 2 ranks; exactly one rank
    reaches the call's end and it must have raised PeerLostError within 20 s."""
    prog = _script(
        tmp_path,
        setup + "t = time.monotonic()\n"
        "try:\n"
        f"    {call}\n"
        "    print('completed', flush=True)\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__, round(time.monotonic() - t), flush=True)\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    lines = [ln for ln in res.stdout.splitlines() if "raised" in ln or "completed" in ln]
    assert len(lines) == 1 and "raised PeerLostError" in lines[0], res.stdout + res.stderr[-3000:]
    assert int(lines[0].split()[-1]) < 20


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_peer_dying_mid_message_raises_within_seconds(side, tmp_path, monkeypatch):
    """A 32 MiB message through a 64 KiB ring: the peer exits after the first pieces
    (sender), or without receiving (receiver); the survivor, waiting for the rest or for
    room to write it, raises PeerLostError long before the group timeout (1800 s)."""
    monkeypatch.setenv("DISTLAUNCH_SHM_P2P_RING", "65536")
    dying = 1 if side == "sender" else 0
    _assert_survivor_raises_peer_lost(
        tmp_path,
        "comm = MPI.COMM_WORLD\n"
        "big = np.ones(32 << 20, np.uint8)\n"
        "comm.Barrier()\n"
        f"if comm.rank == {dying}:\n"
        "    if comm.rank == 1:\n"
        "        comm.Isend(big, dest=0)\n"
        "    time.sleep(0.5)\n"
        "    os._exit(0)\n",
        "comm.Recv(big, source=1) if comm.rank == 0 else comm.Send(big, dest=0)",
    )


def test_failing_worker_thread_exits_as_mpiexec_does(tmp_path):
    """thread_failure.py: rank 1's worker thread raises, then its main thread dies while
    rank 0 waits for it. mpiexec running `python -m mpi4py` (which turns an unhandled
    exception into MPI_Abort) exits 1; so does `distlaunch run`, naming rank 1, at
    once. When the main thread survives the thread's failure, both exit 0."""
    t = time.monotonic()
    rc, mine, err = run("thread_failure", 2, tmp_path, ours=True, args=("dies",), timeout=60)
    assert rc == 1, err[-3000:]
    assert time.monotonic() - t < 30
    assert "rank 1" in err and "worker thread failed" in err
    rc_ok, mine_ok, err_ok = run("thread_failure", 2, tmp_path, ours=True, args=("survives",))
    assert rc_ok == 0, err_ok[-3000:]
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    path = program("thread_failure", tmp_path, ours=False)
    res = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(path), "dies"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    )
    assert res.returncode == rc
    assert "rank 0 waits for rank 1" in res.stdout and "rank 0 waits for rank 1" in mine
    rc2, theirs, _ = run("thread_failure", 2, tmp_path, ours=False, args=("survives",))
    assert (rc2, theirs) == (rc_ok, mine_ok)


@pytest.mark.parametrize("n,ring", [(2, None), (4, "4096")])
def test_blocking_shapes_match_mpich(n, ring, tmp_path, monkeypatch):
    """p2p_blocking.py (blocking Send/Recv as programs write them: the receive fast path
    that takes a message straight from the peer's ring) gives MPICH's output, also with
    a 4 KiB ring where messages wrap around its end."""
    if ring:
        monkeypatch.setenv("DISTLAUNCH_SHM_P2P_RING", ring)
    rc, mine, err = run("p2p_blocking", n, tmp_path, ours=True, timeout=120)
    assert rc == 0, err[-3000:]
    assert not [ln for ln in mine if "False" in ln], mine
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    rc2, theirs, err2 = run("p2p_blocking", n, tmp_path, ours=False, timeout=120)
    assert rc2 == 0, err2[-3000:]
    assert mine == theirs


def _late_recv(tmp_path, delay: float) -> tuple[float, float]:
    """Rank 1 Recvs a message rank 0 sends ``delay`` s after a barrier: (seconds waited,
    seconds of CPU rank 1's process used meanwhile)."""
    prog = _script(
        tmp_path,
        "comm = MPI.COMM_WORLD\n"
        "buf = np.zeros(8, np.uint8)\n"
        "comm.Barrier()\n"
        "if comm.rank == 0:\n"
        f"    time.sleep({delay})\n"
        "    comm.Send([buf, 8, MPI.BYTE], dest=1, tag=1)\n"
        "else:\n"
        "    cpu, t = time.process_time(), time.monotonic()\n"
        "    comm.Recv([buf, 8, MPI.BYTE], source=0, tag=1)\n"
        "    print('waited', round(time.monotonic() - t, 2), 'cpu', round(time.process_time() - cpu, 3))\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    words = next(ln for ln in res.stdout.splitlines() if "waited" in ln).split()
    return float(words[-3]), float(words[-1])


def test_idle_receiver_sleeps_instead_of_spinning(tmp_path):
    """A receive waiting 2 s for its message busy-polls only briefly, then sleeps: its
    process uses well under a second of CPU meanwhile (spinning all along: ~2 s)."""
    waited, cpu = _late_recv(tmp_path, 2)
    assert waited >= 1.9
    assert cpu < 0.5, cpu


def test_waiting_recv_busy_polls_once(tmp_path, monkeypatch):
    """DISTLAUNCH_SHM_P2P_BUSY_US bounds a blocking receive's busy-poll as a whole: with
    200 ms configured, a Recv waiting 1.5 s spins once (fast path), then sleeps (~0.2 s
    of CPU); it used 0.55-0.9 s when each later step and each 0.5 s wait slice spun
    again."""
    monkeypatch.setenv("DISTLAUNCH_SHM_P2P_BUSY_US", "200000")
    waited, cpu = _late_recv(tmp_path, 1.5)
    assert waited >= 1.4
    assert cpu < 0.45, cpu


def test_oversubscribed_ranks_do_not_spin(tmp_path, monkeypatch):
    """Both ranks on one CPU (the launcher's affinity): a waiter must yield the CPU at
    once, not busy-poll, or each message waits for the spinner's time slice to end.
    With a busy-poll of 100 ms configured, 300 round trips still cost each rank well
    under the ~1 s of CPU that spinning through even 3 ms (one slice) per wait would.
    CPU time, not wall time: other load on that CPU slows a yielding rank's wall clock
    too, but not its own CPU time."""
    monkeypatch.setenv("DISTLAUNCH_SHM_P2P_BUSY_US", "100000")
    prog = _script(
        tmp_path,
        "comm = MPI.COMM_WORLD\n"
        "buf = np.zeros(8, np.uint8)\n"
        "other = 1 - comm.rank\n"
        "comm.Barrier()\n"
        "t = time.process_time()\n"
        "for _ in range(300):\n"
        "    if comm.rank == 0:\n"
        "        comm.Send([buf, 8, MPI.BYTE], dest=other, tag=1)\n"
        "        comm.Recv([buf, 8, MPI.BYTE], source=other, tag=1)\n"
        "    else:\n"
        "        comm.Recv([buf, 8, MPI.BYTE], source=other, tag=1)\n"
        "        comm.Send([buf, 8, MPI.BYTE], dest=other, tag=1)\n"
        "print('took', round(time.process_time() - t, 3), 'cpus', sorted(os.sched_getaffinity(0)))\n",
    )
    cpu = min(os.sched_getaffinity(0))
    res = subprocess.run(
        [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", str(prog)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "took" in ln]
    assert len(lines) == 2 and all(f"cpus [{cpu}]" in ln for ln in lines), res.stdout
    assert max(float(ln.split()[-3]) for ln in lines) < 0.3, res.stdout  # CPU seconds


def test_blocking_recv_from_a_peer_that_exits_raises(tmp_path):
    """A small blocking Recv (the fast path, busy-polling the peer's ring) from a rank
    that exits without sending: PeerLostError within seconds, not the group timeout."""
    _assert_survivor_raises_peer_lost(
        tmp_path,
        "comm = MPI.COMM_WORLD\n"
        "buf = np.zeros(8, np.uint8)\n"
        "comm.Barrier()\n"
        "if comm.rank == 1:\n"
        "    os._exit(0)\n",
        "comm.Recv([buf, 8, MPI.BYTE], source=1, tag=1)",
    )


@pytest.mark.parametrize("mode,ring", [("shm", None), ("shm", "4096"), ("tcp", None)])
def test_buffer_types_match_mpich(mode, ring, tmp_path, monkeypatch):
    """p2p_buffers.py: every buffer type (numpy, bytearray, bytes, memoryview slices,
    mmap, array.array, torch) as ``[buf, count, MPI.BYTE]`` sends exactly ``count``
    bytes and lands in place (the bytes around it untouched), bare and typed specs,
    truncation, Isend/Irecv windows with mixed tags in order per tag (half sent before
    the receives were posted), ANY_TAG, a persistent receive: MPICH's output; also
    with a 4 KiB ring (records wrap at its end) and over TCP. Torch tensors in the first
    case only: they reach the transport as numpy views of their memory, and each rank's
    torch import costs seconds of CPU."""
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if mode == "shm" else "0")
    if ring:
        monkeypatch.setenv("DISTLAUNCH_SHM_P2P_RING", ring)
    args = () if (mode, ring) == ("shm", None) else ("--no-torch",)
    rc, mine, err = run("p2p_buffers", 2, tmp_path, ours=True, args=args, timeout=120)
    assert rc == 0, err[-3000:]
    assert len([ln for ln in mine if " window " in ln]) >= 48, mine
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    rc2, theirs, err2 = run("p2p_buffers", 2, tmp_path, ours=False, args=args, timeout=120)
    assert rc2 == 0, err2[-3000:]
    assert mine == theirs


def test_every_buffer_type_takes_the_fast_path(tmp_path):
    """Send, Recv, Isend and Irecv of every buffer type, bare or as ``[buf, count,
    MPI.BYTE]``, resolve to a view of the buffer without a Spec (``parse``) and a
    receive is never copied out of a kept buffer (``Spec.unpack``); the data and the
    bytes around the received count are right. Before, every type but numpy went
    through both (10-13 us a message against 3.5)."""
    prog = _script(
        tmp_path,
        "import array, mmap, torch\n"
        "from distlaunch.mpi import comm as C, datatypes as D\n"
        "calls = []\n"
        "parse, unpack = C.parse, D.Spec.unpack\n"
        "C.parse = lambda *a, **k: calls.append('parse') or parse(*a, **k)\n"
        "D.Spec.unpack = lambda *a, **k: calls.append('unpack') or unpack(*a, **k)\n"
        "comm = MPI.COMM_WORLD\n"
        "PAT = bytes(range(1, 33))\n"
        "def make(kind, data):\n"
        "    if kind == 'numpy': return np.frombuffer(bytearray(data), np.uint8)\n"
        "    if kind in ('bytearray', 'bytes'): return bytearray(data)\n"
        "    if kind == 'memoryview': return memoryview(bytearray(b'x' * 8 + data))[8:]\n"
        "    if kind == 'mmap':\n"
        "        m = mmap.mmap(-1, len(data)); m[:] = data; return m\n"
        "    if kind == 'array': return array.array('B', data)\n"
        "    return torch.frombuffer(bytearray(data), dtype=torch.uint8)\n"
        "ok = []\n"
        "for kind in ('numpy', 'bytearray', 'bytes', 'memoryview', 'mmap', 'array', 'torch'):\n"
        "    if comm.rank == 0:\n"
        "        s = bytes(PAT) if kind == 'bytes' else make(kind, PAT)\n"
        "        comm.Send([s, 10, MPI.BYTE], 1, 1)\n"
        "        comm.Isend([s, 12, MPI.BYTE], 1, 2).Wait()\n"
        "        comm.Send(s, 1, 3)\n"
        "    else:\n"
        "        for tag, n in ((1, 10), (2, 12), (3, 32)):\n"
        "            r = make(kind, b'\\xee' * 40)\n"
        "            if tag == 2:\n"
        "                comm.Irecv([r, 40, MPI.BYTE], 0, tag).Wait()\n"
        "            else:\n"
        "                comm.Recv([r, 40, MPI.BYTE], 0, tag)\n"
        "            got = bytes(r.numpy() if kind == 'torch' else r)\n"
        "            ok.append(got == PAT[:n] + b'\\xee' * (40 - n))\n"
        "print('rank', comm.rank, 'calls', calls, 'ok', all(ok), flush=True)\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(ln for ln in res.stdout.splitlines() if "calls" in ln)
    assert len(lines) == 2, res.stdout
    assert all(ln.endswith("calls [] ok True") for ln in lines), lines


def test_window_of_irecv_takes_messages_straight_from_the_ring(tmp_path):
    """A window of contiguous Irecv from a peer on this node whose first receive was
    posted before its message came: the later Irecvs (messages already there) and the
    Waitall of a window posted before any message came take each message straight
    from the ring into its buffer, in order -- none is routed (``_local_route``) or kept
    as an unexpected copy. Before, the first look routed every arrived message, all but
    the first into kept copies that the later receives then copied out again."""
    prog = _script(
        tmp_path,
        "from distlaunch.mpi import p2p\n"
        "routed = []\n"
        "route = p2p.Engine._local_route\n"
        "p2p.Engine._local_route = lambda self, f: routed.append(f[9]) or route(self, f)\n"
        "comm = MPI.COMM_WORLD\n"
        "K, N = 6, 100\n"
        "bufs = [np.zeros(N + 4, np.uint8) for _ in range(K)]\n"
        "for rnd in range(2):\n"
        "    if comm.rank == 1 and rnd == 0:  # the first receive before, the rest after\n"
        "        reqs = [comm.Irecv([bufs[0], N, MPI.BYTE], 0, 7)]\n"
        "    if comm.rank == 1 and rnd == 1:  # all posted before\n"
        "        reqs = [comm.Irecv([b, N, MPI.BYTE], 0, 7) for b in bufs]\n"
        "    comm.Barrier()\n"
        "    if comm.rank == 0:\n"
        "        for k in range(K):\n"
        "            comm.Send(np.full(N - k, 10 * rnd + k, np.uint8), 1, 7)\n"
        "    comm.Barrier()\n"
        "    if comm.rank == 1:\n"
        "        if rnd == 0:\n"
        "            reqs += [comm.Irecv([b, N, MPI.BYTE], 0, 7) for b in bufs[1:]]\n"
        "        st = [MPI.Status() for _ in range(K)]\n"
        "        MPI.Request.Waitall(reqs, st)\n"
        "        ok = all(st[k].Get_count(MPI.BYTE) == N - k and st[k].Get_tag() == 7\n"
        "                 and (bufs[k][: N - k] == 10 * rnd + k).all() and not bufs[k][N - k :].any()\n"
        "                 for k in range(K))\n"
        "        print('round', rnd, 'ok', ok, 'routed', routed, flush=True)\n"
        "        routed.clear()\n"
        "        for b in bufs: b[:] = 0\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = sorted(ln.split(": ", 1)[-1] for ln in res.stdout.splitlines() if "round" in ln)
    assert lines == ["round 0 ok True routed []", "round 1 ok True routed []"], res.stdout


def test_window_of_irecv_is_posted_then_taken_as_one_run(tmp_path):
    """A window of contiguous Irecv from a peer on this node whose messages are all in
    the ring already: the Irecvs only post (nothing is taken from the ring, no
    ``take_prefix``) and the Waitall takes the whole window in one run (one
    ``take_run``: one lock, one tail publication), every message in order in its own
    buffer, with its Status. A served receive keeps no view of its buffer once waited
    (a bytearray grows at once, the cyclic GC off). Before, each Irecv took its message
    itself (16 ``take_prefix``, each its lock, fence and tail update)."""
    prog = _script(
        tmp_path,
        "import gc\n"
        "from distlaunch.collectives.transport import shm_p2p\n"
        "calls = []\n"
        "L = shm_p2p.ShmLinks\n"
        "tp, tr = L.take_prefix, L.take_run\n"
        "L.take_prefix = lambda *a: calls.append('take_prefix') or tp(*a)\n"
        "L.take_run = lambda *a: calls.append('take_run') or tr(*a)\n"
        "comm = MPI.COMM_WORLD\n"
        "W, N = 16, 24\n"
        "if comm.rank == 0:\n"
        "    for k in range(W):\n"
        "        comm.Send(np.full(N - k % 3, k, np.uint8), 1, 5)\n"
        "comm.Barrier()\n"
        "if comm.rank == 1:\n"
        "    gc.disable()\n"
        "    bufs = [bytearray(N + 2) for _ in range(W)]\n"
        "    calls.clear()\n"
        "    reqs = [comm.Irecv([b, N, MPI.BYTE], 0, 5) for b in bufs]\n"
        "    posting = list(calls)\n"
        "    sts = [MPI.Status() for _ in range(W)]\n"
        "    MPI.Request.Waitall(reqs, sts)\n"
        "    ok = all(bytes(bufs[k]) == bytes([k]) * (N - k % 3) + bytes(N + 2 - (N - k % 3))\n"
        "             and sts[k].Get_count(MPI.BYTE) == N - k % 3 and sts[k].Get_tag() == 5\n"
        "             and sts[k].Get_source() == 0 for k in range(W))\n"
        "    b = bytearray(8)\n"
        "    print('posting', posting, 'waitall', calls[len(posting):], 'ok', ok, flush=True)\n"
        "comm.Barrier()\n"
        "if comm.rank == 0:\n"
        "    comm.Send(np.full(8, 9, np.uint8), 1, 6)\n"
        "if comm.rank == 1:\n"
        "    comm.Irecv([b, 8, MPI.BYTE], 0, 6).Wait()\n"
        "    b.extend(b'x')  # BufferError while a view of it is kept\n"
        "    print('grown', bytes(b) == bytes([9] * 8) + b'x', flush=True)\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    out = [ln.split(": ", 1)[-1] for ln in res.stdout.splitlines()]
    assert "posting [] waitall ['take_run'] ok True" in out, res.stdout
    assert "grown True" in out, res.stdout


def test_finalize_unmaps_the_rings_after_isend_windows(tmp_path):
    """After windows of Isend/Irecv and blocking Send/Recv (the kept per-destination
    putters of ``ShmLinks.putter``), MPI.Finalize unmaps every point-to-point inbox:
    nothing kept keeps a view of the mapping (an unlinked segment stays in memory while
    mapped). Checked in /proc/self/maps."""
    prog = _script(
        tmp_path,
        "comm = MPI.COMM_WORLD\n"
        "peer = 1 - comm.rank\n"
        "b = np.zeros(64, np.uint8)\n"
        "for k in range(3):\n"
        "    reqs = [comm.Irecv([b, 64, MPI.BYTE], peer, 1) for _ in range(8)]\n"
        "    reqs += [comm.Isend([b, 32, MPI.BYTE], peer, 1) for _ in range(8)]\n"
        "    MPI.Request.Waitall(reqs)\n"
        "    comm.Send([b, 8, MPI.BYTE], peer, 2)\n"
        "    comm.Recv([b, 8, MPI.BYTE], peer, 2)\n"
        "def rings():\n"
        "    return [ln for ln in open('/proc/self/maps') if 'p2p-' in ln]\n"
        "before = len(rings())\n"
        "MPI.Finalize()\n"
        "print('rings', before > 0, rings(), flush=True)\n",
    )
    res = dl("run", "--nproc-per-node", "2", prog, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    out = [ln.split(": ", 1)[-1] for ln in res.stdout.splitlines() if "rings" in ln]
    assert out == ["rings True []"] * 2, res.stdout


@pytest.mark.parametrize("n,mode,ring", [(2, "shm", None), (3, "shm", "4096"), (3, "tcp", None)])
def test_irecv_windows_match_mpich(n, mode, ring, tmp_path, monkeypatch):
    """p2p_windows.py: windows of Irecv posted before their messages came (the receives
    that take them straight from the ring) next to everything that must stop that:
    other tags first, ANY_TAG, a too small buffer mid-window, a cancelled receive
    (Status.Is_cancelled, also through Get_status: False before), Test / Testany /
    Waitany / Waitsome, a blocking Recv behind posted receives, ANY_SOURCE receives
    after those of one sender: MPICH's output, also with a 4 KiB ring and over TCP."""
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if mode == "shm" else "0")
    if ring:
        monkeypatch.setenv("DISTLAUNCH_SHM_P2P_RING", ring)
    rc, mine, err = run("p2p_windows", n, tmp_path, ours=True, timeout=120)
    assert rc == 0, err[-3000:]
    assert "cancelled status True True" in mine, mine
    if not have_mpich():
        pytest.skip("mpi4py/mpiexec not installed")
    rc2, theirs, err2 = run("p2p_windows", n, tmp_path, ours=False, timeout=120)
    assert rc2 == 0, err2[-3000:]
    assert mine == theirs


def test_irecv_windows_beside_a_receiving_thread_do_not_deadlock(tmp_path):
    """Two threads of rank 0 receive at once: one windows of Irecv from rank 1 (taken
    straight from the ring into the posted receives, under the links' and the engine's
    locks), the other blocking Recvs from rank 2 (routed: the links' lock, then the
    engine's). Both complete with every message in order. With the two locks taken in
    the other order by the windows, this hung (a deadlock)."""
    prog = _script(
        tmp_path,
        "import sys, threading\n"
        "sys.setswitchinterval(1e-6)  # thread switches everywhere, between two locks too\n"
        "comm = MPI.COMM_WORLD\n"
        "R, W = 300, 16\n"
        "if comm.rank == 0:\n"
        "    bad = []\n"
        "    def windows():\n"
        "        bufs = [np.zeros(8, np.uint8) for _ in range(W)]\n"
        "        for k in range(R):\n"
        "            MPI.Request.Waitall([comm.Irecv([b, 8, MPI.BYTE], 1, 1) for b in bufs])\n"
        "            bad.extend(k for b in bufs if int(b[0]) != k % 256)\n"
        "    def blocking():\n"
        "        r = np.zeros(8, np.uint8)\n"
        "        for k in range(R * W):\n"
        "            comm.Recv([r, 8, MPI.BYTE], 2, 2)\n"
        "            bad.extend([k] if int(r[0]) != k % 256 else [])\n"
        "    ts = [threading.Thread(target=windows), threading.Thread(target=blocking)]\n"
        "    for t in ts: t.start()\n"
        "    for t in ts: t.join()\n"
        "    print('threads ok', not bad, flush=True)\n"
        "else:\n"
        "    s = np.zeros(8, np.uint8)\n"
        "    for k in range(R * W):\n"
        "        s[0] = (k // W if comm.rank == 1 else k) % 256\n"
        "        comm.Send([s, 8, MPI.BYTE], 0, comm.rank)\n",
    )
    for _ in range(3):
        res = dl("run", "--nproc-per-node", "3", prog, timeout=60)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "threads ok True" in res.stdout, res.stdout
