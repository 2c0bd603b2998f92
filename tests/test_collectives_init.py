"""Initialisation: from `distlaunch run`'s environment, env://, tcp://, file://; bad
backends and init methods; init timeout naming missing ranks; restarted groups use fresh
store keys; FileStore semantics; importing the package stays light."""

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402

import distlaunch.collectives as dist  # noqa: E402
from distlaunch.collectives.filestore import FileStore  # noqa: E402
from distlaunch.errors import ConfigError, StoreTimeoutError  # noqa: E402


def _ok(rc, out, err, n):
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert sum("checks passed" in line for line in out.splitlines()) == n, out


@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_init_methods(method, tmp_path):
    init = {
        "env": "env://",
        "tcp": f"tcp://127.0.0.1:{launch.free_port()}",
        "file": f"file://{tmp_path}/store",
    }[method]
    rc, out, err = launch.spawn(
        "features.py", 3, args=["basic"], init_method=init, env={"COLL_TIMEOUT_TIMEDELTA": "1"}, timeout=60
    )
    _ok(rc, out, err, 3)


@pytest.mark.parametrize("init_method", ["", "env://"])
def test_init_under_launcher(init_method):
    """No init_method: the launcher's store; env://: rank 0 hosts a store on MASTER_PORT."""
    if not launch._launcher_available():
        pytest.skip("distlaunch run is not usable in this tree")
    rc, out, err = launch.launch(
        "features.py",
        2,
        args=["basic"],
        timeout=60,
        spawner="distlaunch",
        env={"COLL_INIT_METHOD": init_method},
    )
    _ok(rc, out, err, 2)


def test_restarted_group_uses_fresh_keys():
    if not launch._launcher_available():
        pytest.skip("distlaunch run is not usable in this tree")
    rc, out, err = launch.launch(
        "restart.py",
        3,
        timeout=90,
        spawner="distlaunch",
        launcher_args=["--max-restarts", "1", "--stop-timeout", "2"],
    )
    assert rc == 0, f"{out[-3000:]}\n{err[-5000:]}"
    assert out.count("attempt 1 ok") == 3, out


def test_init_timeout_names_missing_rank(tmp_path):
    rc, out, err = launch.spawn(
        "features.py",
        3,
        args=["basic"],
        init_method=f"file://{tmp_path}/s",
        env={"COLL_SKIP_INIT_RANK": "1", "COLL_TEST_INIT_TIMEOUT": "4"},
        timeout=90,
    )
    assert rc != 0
    assert err.count("init_process_group timed out after 4 s: ranks [1] did not join") == 2, err[-3000:]


@pytest.mark.parametrize("backend", ["nccl", "mpi", "ucc"])
def test_unsupported_backend(backend):
    with pytest.raises(ConfigError, match="not supported"):
        dist.init_process_group(backend=backend, init_method="file:///nonexistent", rank=0, world_size=1)
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", [None, "auto", "cpu", "gloo", "GLOO", "cpu:gloo"])
def test_accepted_backends(backend, tmp_path):
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/s", rank=0, world_size=1, timeout=10)
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_bad_init_method_and_missing_rank(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="unsupported scheme"):
        dist.init_process_group(init_method="foo://x", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="rank"):
        dist.init_process_group(init_method="file:///tmp/x")
    with pytest.raises(dist.NotInitializedError):
        dist.get_rank()


def test_single_process_world_in_process(tmp_path):
    """world size 1 in the test process itself: init, ops, timedelta timeout, destroy, re-init."""
    import numpy as np

    for _ in range(2):  # re-initialising on the same file uses a new generation of keys
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp_path}/s",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=10),
        )
        try:
            assert dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() == 1
            assert dist.GroupMember.WORLD is not None and dist.get_backend() == "cpu"
            x = np.arange(4.0)
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            assert x.tolist() == [0, 1, 2, 3]
            w = dist.all_reduce(x, async_op=True)
            assert w.wait() and w.is_completed()
            with pytest.warns(DeprecationWarning):
                assert dist.reduce_op.SUM is dist.ReduceOp.SUM
        finally:
            dist.destroy_process_group()
        assert not dist.is_initialized() and dist.GroupMember.WORLD is None


def test_import_is_light():
    code = (
        "import sys, distlaunch.collectives as d; "
        "bad = [m for m in ('torch', 'click', 'psutil', 'paramiko', 'yaml', 'scipy', 'pandas', "
        "'distlaunch.cli', 'distlaunch.launcher', 'distlaunch.agent') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=launch.REPO,
        env={**os.environ, "PYTHONPATH": launch.REPO},
        check=True,
    ).stdout
    assert out.strip() == "[]"


def test_filestore_semantics(tmp_path):
    a, b = FileStore(str(tmp_path / "fs"), timeout=5), FileStore(str(tmp_path / "fs"), timeout=5)
    a.set("k", b"v")
    assert b.get("k") == b"v" and b.check(["k"]) and not b.check(["k", "nope"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    got = []
    t = threading.Thread(target=lambda: got.append(b.get("later")))
    t.start()
    time.sleep(0.05)
    a.set("later", "x")
    t.join(5)
    assert got == [b"x"]
    assert b.delete_key("k") and not a.check(["k"]) and not a.delete_key("k")
    with pytest.raises(StoreTimeoutError):
        a.wait(["never"], timeout=0.1)
    assert a.num_keys() == 2


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_multiprocessing_started_ranks(scheme, tmp_path, monkeypatch):
    import multiprocessing as mp

    import mp_worker

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTLAUNCH_STORE_PORT"):
        monkeypatch.delenv(name, raising=False)
    world = 3
    init = f"tcp://127.0.0.1:{launch.free_port()}" if scheme == "tcp" else f"file://{tmp_path}/store"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=mp_worker.run, args=(r, world, init, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(30)
    assert results == [(r, [6.0, 6.0, 6.0], [0, 1, 2]) for r in range(world)], results


def test_init_with_a_store_object():
    """store=: any c10d-style store; here distlaunch's own StoreServer/StoreClient."""
    import numpy as np

    from distlaunch.store import StoreClient, StoreServer

    server = StoreServer(token="t0k")
    server.start()
    try:
        client = StoreClient("127.0.0.1", server.port, token="t0k", timeout=10)
        dist.init_process_group(store=client, rank=0, world_size=1, timeout=10)
        try:
            x = np.ones(3)
            dist.all_reduce(x)
            assert x.tolist() == [1.0, 1.0, 1.0]
            assert client.check(["distlaunch/coll/g0/joined/0", "distlaunch/coll/g0/node/0"])  # namespaced
        finally:
            dist.destroy_process_group()
        client.close()
    finally:
        server.stop()
