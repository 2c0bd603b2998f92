"""Subgroups, async overlap, object collectives, large messages across the algorithm
thresholds and bad arguments -- each a small launch of tests/collectives_workers/features.py."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402


@pytest.fixture(params=["shm", "tcp"], autouse=True)
def transport(request, monkeypatch):
    """Every test runs with the shared-memory path on and off."""
    launch.use_transport(monkeypatch, request.param)
    return request.param


CASES = [
    ("subgroups", 4),
    ("async", 3),
    ("async", 4),
    ("objects", 3),
    ("large", 3),
    ("large", 4),
    ("runahead", 2),
    ("badargs", 2),
]


def _run(mode, n, *extra):
    rc, out, err = launch.launch("features.py", n, args=[mode, *extra], timeout=180)
    assert rc == 0, f"{mode} failed at world size {n}:\n{out[-3000:]}\n{err[-6000:]}"
    assert sum("checks passed" in line for line in out.splitlines()) == n, out


@pytest.mark.parametrize("mode,n", CASES)
def test_feature(mode, n):
    _run(mode, n)


@pytest.mark.parametrize("n", [3, 4])
def test_chunked_all_reduce(n, transport):
    """n > 2 ranks' chunked all_reduce and reduce: bit-identical results in rank order
    for 1, 2 and many chunks (a ragged last), dtypes, ops, every root, NaN payloads, a
    stalling rank. A 1 MiB slot and 384 KiB chunks keep it small (the default 2 MiB
    chunks take the same path)."""
    if transport == "tcp":  # (the autouse fixture's other half)
        pytest.skip("the rank-order bits are the shared-memory algorithm's promise")
    env = {"DISTLAUNCH_SHM_SLOT": str(1 << 20), "DISTLAUNCH_SHM_CHUNK": str(384 << 10)}
    rc, out, err = launch.launch("features.py", n, args=["chunked"], env=env, timeout=180)
    assert rc == 0, f"chunked failed at world size {n}:\n{out[-3000:]}\n{err[-6000:]}"
    assert sum("checks passed" in line for line in out.splitlines()) == n, out


# torch tensors become arrays before the transport is chosen (api.as_array), so each
# torch case runs on one transport: the numpy cases above cover both for every mode
TORCH_CASES = [("subgroups", 4, "shm"), ("async", 3, "tcp"), ("large", 2, "shm"), ("badargs", 2, "tcp")]


@pytest.mark.parametrize("mode,n,on", TORCH_CASES)
def test_feature_torch(mode, n, on, transport):
    if transport != on:  # (the autouse fixture's other half)
        pytest.skip(f"the torch {mode} case runs on {on} only")
    pytest.importorskip("torch")
    _run(mode, n, "--torch")


@pytest.mark.parametrize("n,seed", [(2, 1), (3, 2), (4, 3)])
def test_random_operation_sequence(n, seed):
    """A seeded random mix of collectives, sizes across the thresholds, subgroups and
    async_op (tests/collectives_workers/random_ops.py)."""
    rc, out, err = launch.launch("random_ops.py", n, args=[str(seed), "300"], timeout=180)
    assert rc == 0, f"{out[-3000:]}\n{err[-6000:]}"
    assert sum("checks passed" in line for line in out.splitlines()) == n, out
