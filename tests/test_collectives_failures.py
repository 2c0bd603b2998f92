"""Failure behaviours (tests/collectives_workers/failures.py): a rank that skips a
collective is named in the others' timeout error; ranks that disagree on shape, dtype,
op, root or the operation all raise CollectiveMismatchError; a peer killed mid-operation
makes the survivors raise PeerLostError quickly; a receive nobody satisfies times out."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402


@pytest.fixture(params=["shm", "tcp"], autouse=True)
def transport(request, monkeypatch):
    """Every test runs with the shared-memory path on and off."""
    launch.use_transport(monkeypatch, request.param)
    return request.param


def _results(out):
    return dict(
        re.findall(r"RESULT (\w+) rank (\d+): ", out)[i][::-1] for i in range(len(re.findall("RESULT", out)))
    )


def _check(rc, out, err, expect_ranks):
    results = _results(out)
    assert set(results) == {str(r) for r in expect_ranks}, f"missing results:\n{out}\n{err[-4000:]}"
    assert all(v == "ok" for v in results.values()), f"\n{out}\n{err[-4000:]}"


@pytest.mark.parametrize("n", [3, 4])
def test_skipped_collective_times_out_naming_the_rank(n):
    rc, out, err = launch.launch("failures.py", n, args=["skip"], timeout=60)
    _check(rc, out, err, range(n))
    assert rc == 0
    assert f"ranks [{n - 1}] did not arrive" in out


@pytest.mark.parametrize("what", ["shape", "dtype", "op", "root", "kind"])
def test_mismatch_raises_on_every_rank(what):
    rc, out, err = launch.launch("failures.py", 4, args=[f"mismatch-{what}"], timeout=60)
    _check(rc, out, err, range(4))
    assert rc == 0


def test_killed_peer_makes_survivors_raise(transport):
    # the subprocess spawner, not `distlaunch run`: the launcher would (rightly) stop the
    # survivors as soon as rank 2 dies, before they could report. With "shm" the ranks get
    # a launcher node id and shm prefix, so the survivors are blocked on a futex
    prefix = f"dltest-kill-{os.getpid()}-"
    env = {"DISTLAUNCH_NODE_ID": "n0", "DISTLAUNCH_SHM_PREFIX": prefix} if transport == "shm" else {}
    rc, out, err = launch.spawn("failures.py", 4, args=["kill"], timeout=60, env=env)
    _check(rc, out, err, [0, 1, 3])
    assert rc == -9  # rank 2 was SIGKILLed
    # the segment is unlinked as soon as every rank mapped it: nothing is left behind
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def test_abort_of_a_timeout_with_an_unreachable_rank_is_peer_lost_everywhere(transport):
    """Rank 2 stops; rank 0's all_reduce times out and finds only rank 2 unreachable
    (PeerLostError); rank 1, whose timeout is far later, learns it from rank 0's ABORT
    and raises the same class (it raised CollectiveTimeoutError, the class of every
    timeout's ABORT)."""
    prefix = f"dltest-stopped-{os.getpid()}-"
    env = {"DISTLAUNCH_NODE_ID": "n0", "DISTLAUNCH_SHM_PREFIX": prefix} if transport == "shm" else {}
    rc, out, err = launch.spawn("failures.py", 3, args=["stopped"], timeout=60, env=env)
    _check(rc, out, err, [0, 1])
    assert "rank 0 aborted" in out  # rank 1's error came from the ABORT


def test_recv_without_sender_times_out():
    rc, out, err = launch.launch("failures.py", 3, args=["recv-timeout"], timeout=60)
    _check(rc, out, err, range(3))


def test_destroy_right_after_an_eager_first_call():
    """A new group's first call is a small broadcast, destroyed at once, rank 1 0.5 s
    late: the root must not unlink the segment before rank 1 mapped it (rank 1 then
    waited in a fresh, empty one until the timeout)."""
    rc, out, err = launch.launch("failures.py", 2, args=["destroy-early"], timeout=60)
    _check(rc, out, err, range(2))


def test_mismatch_in_the_last_call_is_raised_by_destroy(transport):
    """The ranks disagree on the root of a group's last (small) broadcast, which reads
    nothing on either: destroy_process_group raises CollectiveMismatchError on both
    (shared memory; over TCP such a mismatch is found by a next call only)."""
    if transport == "tcp":
        pytest.skip("shared memory only")
    rc, out, err = launch.launch("failures.py", 2, args=["destroy-last"], timeout=60)
    _check(rc, out, err, range(2))


@pytest.mark.parametrize(
    "op",
    ["broadcast", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single"],
)
@pytest.mark.parametrize("what", ["size", "dtype", "root"])
def test_reused_arrays_changed_in_place_still_mismatch(what, op, transport):
    """Small calls repeated on the same array objects (varied, revisited counts, dtypes
    and roots: results checked) take cached per-call plans on shared memory (each
    operation's were made); then one rank resizes its array in place, changes its
    dtype in place, or names another root: every rank still raises
    CollectiveMismatchError (each call is made 3 times: the second and third take its
    plan). all_to_all's calls also meet a rank's async_op calls and, on the plan of
    rank 0, a block of rank 1 to rank 2 longer than a phase."""
    if transport == "tcp":
        pytest.skip("shared memory only (no plans over TCP)")
    if what == "root" and op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_single"):
        pytest.skip("no root")
    if what == "size" and op.startswith("all_to_all"):
        pytest.skip("block sizes only their sender and receiver know (torch's all_to_all)")
    rc, out, err = launch.launch("failures.py", 3, args=[f"reuse-{what}-{op}"], timeout=90)
    _check(rc, out, err, range(3))
