"""Per-node (torchrun-style static) launches: one `distlaunch run --nnodes 2 --node-rank K`
per node, here two launchers on this machine, each a separate node."""

import json
import signal
import socket
import time

import psutil
from conftest import WORKERS, dl_popen
from ports import free_port
from test_supervision import started, survivors, wait_for


def launch_nodes(*args, nnodes=2, extra=(), env=None, nproc=2, prog=WORKERS / "actor.py"):
    """One per-node launcher per node of a static job on this machine, running ``prog``."""
    port = free_port()
    return [
        dl_popen(
            "run",
            "--nnodes",
            nnodes,
            "--node-rank",
            k,
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
            "--nproc-per-node",
            nproc,
            *extra,
            prog,
            *args,
            env=env,
        )
        for k in range(nnodes)
    ]


def finish(procs, timeout=60):
    return [p.communicate(timeout=timeout) + (p.returncode,) for p in procs]


def test_two_nodes_ranks_and_environment(tmp_path):
    results = finish(launch_nodes("--dump-env", tmp_path))
    assert [r[2] for r in results] == [0, 0], results
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for r, e in enumerate(envs):
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (
            str(r),
            "4",
            str(r % 2),
            "2",
        )
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) == (str(r // 2), "2")
        assert e["DISTLAUNCH_NODE_ID"] == str(r // 2)  # different nodes, whatever the host
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and len({e["TORCHELASTIC_RUN_ID"] for e in envs}) == 1
    # one port per job, as torchrun: MASTER_PORT is the store's, which serves torch's
    # TCPStore clients in a key space of their own
    assert envs[0]["MASTER_PORT"] == envs[0]["DISTLAUNCH_STORE_PORT"]
    assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in envs} == {"True"}


def test_failure_on_one_node_stops_the_other():
    t0 = time.monotonic()
    results = finish(
        launch_nodes("--fail-rank", "3", "--fail-code", "6", "--fail-delay", "0.5", "--sleep", "60")
    )
    assert time.monotonic() - t0 < 30
    for _out, err, rc in results:
        assert rc == 6, err
        assert "rank 3 (local rank 1) on node 1" in err


def test_nodes_restart_together(tmp_path):
    results = finish(
        launch_nodes(
            "--fail-rank", "0", "--fail-attempts", "1", "--mark-dir", tmp_path, extra=("--max-restarts", "1")
        )
    )
    assert [r[2] for r in results] == [0, 0], results
    assert all((tmp_path / f"started.{r}.1").exists() for r in range(4))
    assert all("restart 1 of 1" in r[1] for r in results)


def test_lost_node_is_noticed(tmp_path):
    procs = launch_nodes(
        "--mark-dir",
        tmp_path,
        "--sleep",
        "120",
        extra=("--rdzv-conf", "heartbeat_timeout=2,heartbeat_interval=0.2"),
    )
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 30)
    node1_workers = [c.pid for c in psutil.Process(procs[1].pid).children(recursive=True)]
    t0 = time.monotonic()
    procs[1].kill()
    out, err = procs[0].communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert procs[0].returncode != 0
    assert "node 1 was lost" in err and "heartbeat" in err
    assert wait_for(lambda: not survivors(node1_workers), 10)


def test_store_node_lost(tmp_path):
    procs = launch_nodes("--mark-dir", tmp_path, "--sleep", "120")
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 30)
    t0 = time.monotonic()
    procs[0].kill()
    out, err = procs[1].communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert procs[1].returncode != 0 and "lost the store" in err


def test_signal_on_one_node_stops_both(tmp_path):
    procs = launch_nodes("--mark-dir", tmp_path, "--sleep", "120")
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 30)
    procs[1].send_signal(signal.SIGTERM)
    results = finish(procs)
    assert [r[2] for r in results] == [128 + signal.SIGTERM] * 2, results


def launch_dynamic(endpoint, n, nnodes, *args, conf="last_call_timeout=1", env=None):
    procs = []
    for _ in range(n):
        procs.append(
            dl_popen(
                "run",
                "--nnodes",
                nnodes,
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "dyn",
                "--rdzv-conf",
                conf,
                "--nproc-per-node",
                1,
                WORKERS / "actor.py",
                *args,
                env=env,
            )
        )
        time.sleep(0.1)
    return procs


def test_dynamic_membership_ranks_by_arrival(tmp_path):
    results = finish(launch_dynamic(f"127.0.0.1:{free_port()}", 3, "2:3", "--dump-env", tmp_path))
    assert [r[2] for r in results] == [0, 0, 0], results
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["GROUP_RANK"], e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs] == [
        (str(r), str(r), "3", "3") for r in range(3)
    ]
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {"dyn"}


def test_dynamic_join_timeout(tmp_path):
    (p,) = launch_dynamic(f"127.0.0.1:{free_port()}", 1, "2:3", "--mark-dir", tmp_path, conf="join_timeout=1")
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1
    assert "only 1 of at least 2 nodes arrived within 1 s" in err
    assert not list(tmp_path.iterdir())


def test_dynamic_with_standalone_store(tmp_path):
    import os
    import re
    import subprocess

    from conftest import dl_cmd

    env = dict(os.environ, DISTLAUNCH_STORE_TOKEN="shared-secret")
    store = subprocess.Popen(dl_cmd("store", "--port", "0"), stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = int(re.search(r":(\d+)$", store.stderr.readline().strip()).group(1))
        results = finish(launch_dynamic(f"127.0.0.1:{port}", 2, "2", "--dump-env", tmp_path, env=env))
        assert [r[2] for r in results] == [0, 0], results
        assert json.loads((tmp_path / "1.json").read_text())["WORLD_SIZE"] == "2"
    finally:
        store.terminate()
        store.wait(15)
