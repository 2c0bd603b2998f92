"""The mpi facade's buffer collectives (Bcast, Gather, Scatter, Allgather, Alltoall and
the v-variants) on every buffer type, ``[buf, count, MPI.BYTE]`` specs that use part of
the buffer, at sizes across the shared-memory slot (set small, so that several phases
run), against numpy's result: tests/mpi_programs/coll_buffers.py under `distlaunch run`.
On shared memory the collectives must not open a TCP connection."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_run import run  # noqa: E402

SLOT = 4096  # bytes: the program's sizes go past 2 slots


@pytest.mark.parametrize("n,transport", [(2, "shm"), (3, "shm"), (3, "tcp")])
def test_buffer_collectives(tmp_path, monkeypatch, n, transport):
    # torch tensors in one case: they reach the collectives as numpy views of their
    # memory (buffer resolution is before any transport) and each rank's torch import
    # costs seconds of CPU
    no_torch = () if (n, transport) == (2, "shm") else ("--no-torch",)
    monkeypatch.setenv("DISTLAUNCH_SHM_SLOT", str(SLOT))
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if transport == "shm" else "0")
    if transport == "shm":
        monkeypatch.setenv("COLL_EXPECT_NO_TCP", "1")
    rc, lines, err = run("coll_buffers", n, tmp_path, True, (str(SLOT), *no_torch), timeout=180)
    assert rc == 0, f"rc={rc}\n{err[-4000:]}"
    passed = [ln for ln in lines if "checks passed" in ln]
    assert len(passed) == n, lines


def test_wrong_collectives(tmp_path):
    """A short receive buffer raises one clear line before anything moves (the group
    stays usable); Gather against Scatter raises on both ranks."""
    rc, lines, err = run("coll_errors", 2, tmp_path, True, timeout=120)
    text = "\n".join(lines)
    short = "rank 0: MPIException: recvbuf block holds 1 bytes but 4 are sent to it"
    assert short in text, text + err[-2000:]
    assert "rank 0: gathered [0, 1, 2, 3, 10, 11, 12, 13]" in text, text
    assert "rank 0: mismatch CollectiveMismatchError" in text, text + err[-2000:]
    assert "rank 1: mismatch CollectiveMismatchError" in text, text + err[-2000:]


@pytest.mark.parametrize("n", [2, 4])
def test_small_collectives_are_eager(tmp_path, n):
    """On shared memory the root of a small Bcast or Scatter and the non-roots of a
    small Gather leave without waiting for the others: a program whose root sends to
    the others after the call, while they receive before making it, completes for
    every root (it deadlocked when every call was a rendezvous). Ranks that disagree on
    the root, so that nobody reads anybody, get CollectiveMismatchError from the next
    call, naming both calls."""
    rc, lines, err = run("coll_eager", n, tmp_path, True, timeout=120)
    assert rc == 0, f"rc={rc}\n{err[-4000:]}"
    for r in range(n):
        assert f"{r} eager {2 * n - 1}" in lines, lines
        [roots] = [ln for ln in lines if ln.startswith(f"{r} roots:")]
        assert "CollectiveMismatchError in the next call" in roots, roots
        assert "root=0)" in roots and "root=1)" in roots and "the call before this one" in roots, roots


def test_free_right_after_an_eager_first_call(tmp_path):
    """A communicator's first (small) Bcast, Scatter or Gather and then Free, with the
    last rank to arrive 0.5 s late: the ranks that could leave first must not unlink
    the segment before the late one mapped it (it hung until the group timeout)."""
    rc, lines, err = run("coll_free_early", 2, tmp_path, True, timeout=20)
    assert rc == 0, f"rc={rc}\n{err[-4000:]}"
    assert "0 freed early [28, [0, 1], [10, 11], 32, [0, 1], [10, 11]]" in lines, lines
    assert "1 freed early [28, [2, 3], 32, [2, 3]]" in lines, lines


def test_a_mismatch_in_the_last_call_is_reported_on_free(tmp_path):
    """Ranks disagree on the root of a communicator's last (small, eager) Bcast, so no
    rank reads another's and the call cannot see it; Free (and Finalize for the world)
    compares the calls: CollectiveMismatchError on every rank, naming both calls and
    the Bcast's own sequence number (it went unreported when no call followed)."""
    rc, lines, err = run("coll_last_mismatch", 2, tmp_path, True, timeout=60)
    assert rc == 0, f"rc={rc}\n{err[-4000:]}"
    for r in range(2):
        for how, end in (("dup", "Free"), ("split", "Free"), ("world", "Finalize")):
            [line] = [ln for ln in lines if ln.startswith(f"{r} {how}:")]
            assert f"CollectiveMismatchError in {end}" in line, line
            assert "root=0)" in line and "root=1)" in line, line
            if end == "Free":
                assert "broadcast #2 on" in line and "last call" in line and "on destroy" in line, line


def test_a_mismatch_in_the_last_call_is_reported_at_exit_without_finalize(tmp_path):
    """The same disagreement in a program that ends without MPI.Finalize: MPI is
    finalized at exit (as mpi4py does), so every rank reports the mismatch and exits 1
    (the program exited 0 with nothing reported: the facade registered nothing at exit).
    A program ending normally without Finalize still exits 0."""
    rc, lines, err = run("coll_exit_mismatch", 2, tmp_path, True, timeout=60)
    assert rc == 1, f"rc={rc}\n{err[-4000:]}"
    assert "0 left without Finalize" in lines and "1 left without Finalize" in lines, lines
    what = "distlaunch.mpi: MPI.Finalize at exit failed: CollectiveMismatchError"
    failed = [ln for ln in err.splitlines() if ln.startswith(("[0]: " + what, "[1]: " + what))]
    assert {ln[:4] for ln in failed} == {"[0]:", "[1]:"}, err[-4000:]
    assert all("root=0)" in ln and "root=1)" in ln for ln in failed), failed
    rc, lines, err = run("hello", 2, tmp_path, True, timeout=60)
    assert rc == 0 and len(lines) == 2, f"rc={rc} {lines}\n{err[-2000:]}"


@pytest.mark.parametrize(
    "n,case,transport",
    [
        (2, "planned", "shm"),
        (3, "planned", "shm"),
        (2, "first", "shm"),
        (3, "first", "shm"),
        (2, "large", "shm"),
        (2, "first", "tcp"),
    ],
)
def test_alltoall_blocks_of_another_size(tmp_path, monkeypatch, n, case, transport):
    """Rank 0 sends Alltoall blocks of another size than the others: every rank raises
    CollectiveMismatchError, on the planned path (repeated small calls), the general
    path's first call, several phases (a small slot) and TCP (the general path accepted
    it and moved wrong bytes); the ranks that find it name both sizes (a rank told by
    another's abort first may only name that rank)."""
    monkeypatch.setenv("DISTLAUNCH_SHM_SLOT", str(SLOT))
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if transport == "shm" else "0")
    rc, lines, err = run("coll_alltoall_mismatch", n, tmp_path, True, (case,), timeout=60)
    sizes = ("6000", "9000") if case == "large" else ("8", "16")
    found = []
    for r in range(n):
        [line] = [ln for ln in lines if ln.startswith(f"{r} {case}:")] or [
            f"no line of rank {r}: {err[-3000:]}"
        ]
        assert "CollectiveMismatchError" in line, line
        found += [line] if all(f"count={s})" in line for s in sizes) else []
    assert found, lines


@pytest.mark.parametrize(
    "op,dying",
    [("bcast", 1), ("bcast", 0), ("gather", 1), ("scatter", 0), ("allgather", 0), ("alltoall", 1)],
)
def test_a_peer_dying_in_repeated_calls_raises(tmp_path, op, dying):
    """A rank exits in the middle of repeated small calls (the planned path): the
    survivor's next calls raise PeerLostError within seconds, as a reader waiting for
    the dead rank's data and as a broadcast root waiting for it to have read."""
    rc, lines, err = run("coll_peer_death", 2, tmp_path, True, (op, str(dying)), timeout=60)
    me = 1 - dying
    [line] = [ln for ln in lines if ln.startswith(f"{me} {op}")] or [f"no line: {lines} {err[-3000:]}"]
    assert "['PeerLostError', 'PeerLostError']" in line, line


def test_roots_that_disagree_after_planned_calls(tmp_path):
    """After planned Bcasts from root 0, each rank calls Bcast as its own root, so
    nobody reads anybody's: the next call of each (rank 0's on its plan, which compares
    the previous call as it opens) raises CollectiveMismatchError naming both roots."""
    rc, lines, err = run("coll_peer_death", 2, tmp_path, True, ("roots", "-1"), timeout=60)
    for r in range(2):
        [line] = [ln for ln in lines if ln.startswith(f"{r} roots:")] or [f"no line: {lines} {err[-3000:]}"]
        assert line.count("CollectiveMismatchError") == 2, line
        assert "root=0)" in line and "root=1)" in line and "the call before this one" in line, line


@pytest.mark.parametrize("n", [2, 3])
def test_planned_calls_on_byte_buffers(tmp_path, n):
    """Repeated calls on bytearray, mmap and bytes buffers (which the plans slice
    without a memoryview up to 4 KiB per block) give the right bytes at block sizes
    around that limit, displaced too; a grown bytearray, a closed mmap and a read-only
    mmap made at a freed receive mmap's id leave the plan: the last is refused before
    anything moves (MPIException; without the plans' weak reference to a receive mmap
    the planned path writes into it: a TypeError that breaks the communicator), and the
    communicator stays usable."""
    rc, lines, err = run("coll_plan_buffers", n, tmp_path, True, timeout=180)
    assert rc == 0, f"rc={rc}\n{err[-4000:]}"
    grown = [2 + r for r in range(n)] + [40 + r for r in range(n)]
    for r in range(n):
        assert f"{r} planned ok" in lines, lines
        want = f"{r} fallbacks grown {grown} closed ValueError readonly MPIException same id True"
        assert f"{want} usable {list(range(n))}" in lines, lines
