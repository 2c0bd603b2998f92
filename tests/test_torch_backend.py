"""The "distlaunch" torch.distributed backend (distlaunch/torch/) in real processes:
every operation x dtype x world 1-4 against gloo in the same processes, DDP, async
futures, every init method (env:// under distlaunch run and torchrun, tcp://, file://,
store=), and the failure paths (mismatch, timeout, killed peer). One launch per world
size for the matrix (tests/torch_workers/ops_matrix.py loops over ops and dtypes)."""

import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT, dl  # noqa: E402
from ports import free_port

W = ROOT / "tests" / "torch_workers"
_matrix: dict = {}


def worlds(*sizes: int) -> list:
    """World sizes for tests of ``matrix(world)``: under pytest-xdist every test of one
    world size runs in the same worker, which launches that world's matrix once."""
    return [pytest.param(w, marks=pytest.mark.xdist_group(f"torch_ops_matrix_{w}")) for w in sizes]


def matrix(world: int) -> subprocess.CompletedProcess:
    """ops_matrix.py under `distlaunch run` at ``world`` (run once per process, shared by
    the tests)."""
    if world not in _matrix:
        _matrix[world] = dl("run", "--nproc-per-node", world, W / "ops_matrix.py", timeout=120)
    return _matrix[world]


def lines(res: subprocess.CompletedProcess, what: str) -> list:
    return re.findall(rf"^\[(\d+)\]: {what}", res.stdout, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("world", worlds(1, 2, 3, 4))
def test_every_op_and_dtype_matches_gloo(world):
    res = matrix(world)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(lines(res, r"ops ok \d+")) == [str(r) for r in range(world)]


@pytest.mark.parametrize("world", worlds(1, 2, 3, 4))
def test_async_work_and_futures(world):
    res = matrix(world)
    assert sorted(lines(res, "futures ok")) == [str(r) for r in range(world)], res.stderr[-3000:]


@pytest.mark.parametrize("world", worlds(2, 3, 4))
def test_large_all_reduce_has_the_bits_of_the_rank_order_sum(world):
    # multi-chunk float32 with NaN payloads: every rank's result is x0 + x1 + ... bit for
    # bit, blocking and async (two ranks: the one-phase pair algorithm; more: two-phase)
    res = matrix(world)
    assert sorted(lines(res, "large ok")) == [str(r) for r in range(world)], res.stderr[-3000:]


@pytest.mark.parametrize("world", worlds(2, 4))
def test_ddp_ends_with_identical_parameters(world):
    # every rank checks its parameters against all others' and against DDP over gloo
    res = matrix(world)
    assert sorted(lines(res, "ddp ok")) == [str(r) for r in range(world)], res.stderr[-3000:]


def spawn(worker: str, *args, world: int, timeout: float = 180) -> list:
    """Start ``world`` ranks of a worker by hand (no launcher): [(rank, rc, stdout, stderr)].
    (``timeout``: seconds per rank; each imports torch, 20 s and more on a loaded machine)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLAUNCH_", "RANK", "WORLD_SIZE"))}
    procs = [
        subprocess.Popen(
            [sys.executable, str(W / worker), *map(str, args), str(r), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    out = []
    try:
        for r, p in enumerate(procs):
            so, se = p.communicate(timeout=timeout)
            out.append((r, p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("method", ["file", "tcp", "store"])
def test_init_methods_by_hand(method, tmp_path):
    url = f"file://{tmp_path}/rdzv" if method == "file" else f"tcp://127.0.0.1:{free_port()}"
    for _r, rc, so, se in spawn("init_methods.py", "store" if method == "store" else "url", url, world=2):
        assert rc == 0, se[-3000:]
        kind = "store" if method == "store" else "url"
        assert f"init ok {kind} transport=shm" in so  # one machine: shared memory, not TCP


def test_env_init_under_torchrun():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
        ]
        + [str(W / "init_methods.py"), "env"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("init ok env transport=shm") == 2


def test_env_init_under_distlaunch_run():
    res = dl("run", "--nproc-per-node", "2", W / "init_methods.py", "env", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(lines(res, "init ok env transport=shm")) == 2


@pytest.mark.slow
def test_tutorial_program_with_only_the_backend_name_changed(tmp_path):
    # tests/workers/torch_tutorial.py (the PyTorch tutorial's operations, each checked
    # against its expected tensor) with "gloo" -> "distlaunch" and the registering import
    # (3 ranks; every op at 1-4 ranks is test_every_op_and_dtype_matches_gloo's)
    world = 3
    src = (ROOT / "tests" / "workers" / "torch_tutorial.py").read_text()
    assert src.count('"gloo"') == 1
    changed = tmp_path / "tutorial_distlaunch.py"
    changed.write_text("import distlaunch.torch  # noqa: F401\n" + src.replace('"gloo"', '"distlaunch"'))
    outs = []
    for prog in (ROOT / "tests" / "workers" / "torch_tutorial.py", changed):
        res = dl("run", "--nproc-per-node", world, prog, timeout=180)
        assert res.returncode == 0, res.stderr[-3000:]
        outs.append(sorted(res.stdout.splitlines()))
    assert outs[1] == outs[0]
    assert sum(ln.endswith("barrier ok") for ln in outs[1]) == world


RAISED = r"raised (\w+) ([\d.]+) isDistBackendError=(\w+)"


def raised(text: str) -> list:
    """(class name, seconds, is DistBackendError) of each rank's report."""
    return [(c, float(s), b == "True") for c, s, b in re.findall(RAISED, text)]


def test_mismatched_call_raises_on_every_rank():
    res = dl("run", "--nproc-per-node", "3", W / "failures.py", "mismatch", timeout=120)
    got = raised(res.stdout)
    assert len(got) == 3, res.stdout + res.stderr[-3000:]
    assert all(c == "DistlaunchMismatchError" and b and s < 30 for c, s, b in got), got


def test_timeout_aborts_every_rank():
    # init_process_group(timeout=3 s): rank 0 calls all_reduce at once, rank 1 after 2 s,
    # rank 2 after rank 0 gave up; seconds are counted from each rank's own call
    timeout = 3.0
    res = dl("run", "--nproc-per-node", "3", W / "failures.py", "timeout", timeout=120)
    got = {
        r: (c, float(s), b == "True") for r, c, s, b in re.findall(rf"^\[(\d)\]: {RAISED}", res.stdout, re.M)
    }
    assert sorted(got) == ["0", "1", "2"], res.stdout + res.stderr[-3000:]
    assert all(c == "DistlaunchTimeoutError" and b for c, _, b in got.values()), got
    assert timeout - 0.1 <= got["0"][1] < timeout + 5  # the init timeout, not the 30 min default
    assert got["1"][1] < timeout  # rank 0's ABORT, before rank 1's own deadline
    assert got["2"][1] < 2  # the group was already broken when rank 2 called


@pytest.mark.parametrize(
    "mode,world", [("killed", 3), ("killed-mid", 2), ("killed-ddp", 2), ("killed-ddp", 3)]
)
def test_killed_peer_raises_on_every_survivor(mode, world):
    # started by hand (a launcher would stop the survivors itself): tcp:// on torch's store;
    # killed-mid: the victim dies inside two ranks' chunked all_reduces (one phase per chunk);
    # killed-ddp: inside DDP's all_reduces of its buckets, which DDP's backward raises
    # as a RuntimeError carrying the backend's message (it
    # crashed with SIGSEGV: DDP read the error object as the result)
    out = spawn("failures.py", mode, f"tcp://127.0.0.1:{free_port()}", world=world)
    assert out[-1][1] == -9, out[-1]  # the victim (its output says why when it is not)
    for _r, rc, so, se in out[:-1]:
        got = raised(so)
        assert rc == 0 and len(got) == 1, so + se[-3000:]
        cls, took, is_backend_error = got[0]
        if mode == "killed-ddp":
            assert cls == "RuntimeError" and "DistlaunchPeerLostError" in so and "died" in so, so
        else:
            assert cls == "DistlaunchPeerLostError" and is_backend_error
        assert took < 30  # the group timeout is 60 s: found dead, not timed out


def test_collectives_work_without_torch():
    # distlaunch.collectives never imports torch; with torch unavailable it still loads
    code = (
        "import sys; sys.modules['torch'] = None; import distlaunch.collectives as c; "
        "import numpy as np; assert 'distlaunch.torch' not in sys.modules; print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
