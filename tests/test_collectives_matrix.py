"""Every collective x world size 1-4 x dtype x root x ReduceOp against a numpy
reference. One launch per world size runs the whole matrix (tests/collectives_workers/
matrix.py), so the suite stays fast on small machines."""

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


def _run_matrix(n, *args):
    rc, out, err = launch.launch("matrix.py", n, args=args, timeout=240)
    assert rc == 0, f"matrix failed at world size {n}:\n{out[-3000:]}\n{err[-6000:]}"
    passed = [line for line in out.splitlines() if "checks passed" in line]
    assert len(passed) == n, out  # every rank reported, none silently skipped
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matrix_numpy(n):
    _run_matrix(n)


# torch tensors become numpy views at the API (collectives/buffers.as_array) before any
# algorithm runs, so the algorithms of every world size are the numpy matrix's; here the
# tensors' path on one rank and on several (3 ranks: ~15 s each, most of it torch's
# import), each on one transport (one rank has no peer to reach)
@pytest.mark.parametrize("n,on", [(1, "tcp"), (3, "shm")])
def test_matrix_torch(n, on, transport):
    if transport != on:  # (the autouse fixture's other half)
        pytest.skip(f"the torch matrix of {n} ranks runs on {on} only")
    pytest.importorskip("torch")
    _run_matrix(n, "--torch")
