"""Workers started without distlaunch: by srun on the real two-node test cluster, and by
MPICH's mpiexec (the bench extra). Each calls init_process_group() with no arguments and
runs an all_reduce and a broadcast; the expected values are computed here."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import pytest
from ports import free_port
from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_programs", "coll_worker.py")


def expected(size: int) -> tuple[list[float], list[int]]:
    total = sum(r + 1 for r in range(size))
    head = [float(i * total) for i in range(5)] + [float(sum(range(1000)) * total)]
    return head, [(size - 1) * 10 + 3] * 8


def results(stdout: str) -> list[dict]:
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda d: d["rank"]
    )


def test_srun_started_workers(slurm_cluster):  # noqa: F811
    cp = slurm_cluster.run("srun", "-N2", "--ntasks-per-node=2", sys.executable, WORKER, timeout=60)
    assert cp.returncode == 0, cp.stderr
    out = results(cp.stdout)
    assert [d["rank"] for d in out] == [0, 1, 2, 3] and all(d["size"] == 4 for d in out)
    head, bcast = expected(4)
    assert all(d["sum"] == head and d["bcast"] == bcast for d in out)
    # block distribution: ranks 0-1 on n1, 2-3 on n2; shared memory only within a Slurm node
    assert [d["node"] for d in out] == ["n1", "n1", "n2", "n2"]
    assert out[0]["node_keys"] == ["L:slurm:n1", "L:slurm:n1", "L:slurm:n2", "L:slurm:n2"]
    assert not any(d["token_env"] for d in out)


def test_srun_started_workers_with_master_port(slurm_cluster):  # noqa: F811
    env = slurm_cluster.env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cp = slurm_cluster.run("srun", "-N1", "-n2", sys.executable, WORKER, timeout=60, env=env)
    assert cp.returncode == 0, cp.stderr
    head, bcast = expected(2)
    assert all(d["sum"] == head and d["bcast"] == bcast for d in results(cp.stdout))


def test_a_missing_srun_task_times_out_naming_it(slurm_cluster):  # noqa: F811
    # SLURM_STEP_NUM_TASKS says 3 but only 2 tasks exist: init must fail, not hang
    prog = (
        "import os, datetime; os.environ['SLURM_STEP_NUM_TASKS'] = '3'\n"
        "import distlaunch.collectives as dist\n"
        "dist.init_process_group(timeout=3)\n"
    )
    cp = slurm_cluster.run("srun", "-N1", "-n2", sys.executable, "-c", prog, timeout=60)
    assert cp.returncode != 0
    assert "ranks [2] did not join" in cp.stderr


def mpiexec() -> str:
    path = shutil.which("mpiexec")
    if path is None:
        pytest.skip("mpiexec not installed (pip install mpich: the bench extra)")
    return path


def test_mpiexec_started_workers():
    import subprocess

    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    cp = subprocess.run(
        [mpiexec(), "-n", "3", sys.executable, WORKER],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert cp.returncode == 0, cp.stderr
    out = results(cp.stdout)
    head, bcast = expected(3)
    assert [d["rank"] for d in out] == [0, 1, 2]
    assert all(d["sum"] == head and d["bcast"] == bcast for d in out)
    assert len(set(out[0]["node_keys"])) == 1 and out[0]["node_keys"][0].startswith("L:mpi:")  # one host: shm
