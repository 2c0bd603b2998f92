"""Faults through the scheduler on the real two-node Slurm cluster (tests/slurm.py):
the agent step's start racing the head's first reads, ``--max-restarts`` inside an
allocation, signals Slurm sends to a running job (``scancel --signal``, ``sbatch
--signal=USR1@T``) reaching every worker on both nodes exactly once while the job goes
on, and the time limit leaving no worker alive.

Workers are tests/slurm_programs/fault_worker.py: they write a pid mark per attempt and
a line per SIGUSR1 they get, on the node Slurm says they run on (``SLURMD_NODENAME``).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path

import psutil
import pytest
from slurm import ENDED_STATES, slurm_cluster  # noqa: F401  (session-scoped fixture)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "slurm_programs", "fault_worker.py")
DRIVER = os.path.join(HERE, "slurm_programs", "engine_driver.py")
NODE_OF_RANK = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}  # --nproc-per-node 2 on n[1-2]


def launch_cmd(*opts: str, marks: Path) -> list[str]:
    return [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", *opts, WORKER, str(marks)]


def pid_marks(marks: Path, attempt: int) -> dict[int, tuple[int, str]]:
    """rank -> (pid, node) of the workers of ``attempt``."""
    out = {}
    for p in marks.glob(f"pid.{attempt}.*"):
        if p.suffix != ".tmp":
            pid, node = p.read_text().split()
            out[int(p.name.rsplit(".", 1)[1])] = (int(pid), node)
    return out


def usr1_marks(marks: Path) -> dict[int, list[str]]:
    """rank -> the node named by each SIGUSR1 the worker got (one entry per signal)."""
    return {int(p.name.split(".")[1]): p.read_text().split() for p in marks.glob("usr1.*")}


def wait_for(pred, timeout: float, what: str, out: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            log = out.read_text() if out is not None and out.exists() else ""
            raise AssertionError(f"{what} not within {timeout:g} s\n{log}")
        time.sleep(0.1)
    return value


@pytest.fixture
def jobs(slurm_cluster):  # noqa: F811
    """Job ids a test submitted; any still running at its end is cancelled and awaited."""
    ids: list[int] = []
    yield ids
    for job in ids:
        if slurm_cluster.job(job).get("JobState") not in ENDED_STATES:
            slurm_cluster.run("scancel", str(job))
        slurm_cluster.wait_job_end(job, 60)


def submit(cluster, jobs, tmp_path: Path, marks: Path, *sbatch_opts: str, seconds: int = 120) -> int:
    """An sbatch job on both nodes running distlaunch with 4 workers that run until
    ``marks/done`` exists (at most ``seconds``); returns the job id once all 4 run."""
    out = tmp_path / "out.txt"
    script = f"#!/bin/sh\nexec {' '.join(launch_cmd(marks=marks))}\n"
    job = cluster.sbatch(
        script,
        "-N2",
        "-o",
        str(out),
        *sbatch_opts,
        env=cluster.env(PYTHONPATH=os.environ.get("PYTHONPATH", ""), WORKER_SECONDS=str(seconds)),
    )
    jobs.append(job)
    wait_for(lambda: len(pid_marks(marks, 0)) == 4, 60, "4 workers running", out)
    return job


def assert_each_worker_got_usr1_once(marks: Path, out: Path) -> None:
    """Every worker got SIGUSR1, on the node it runs on, exactly once (a second delivery
    would run its handler again: e.g. a checkpoint or a requeue twice)."""
    got = usr1_marks
    wait_for(lambda: len(got(marks)) == 4 and all(got(marks).values()), 60, "SIGUSR1 at all 4 workers", out)
    time.sleep(1.0)  # a second delivery (Slurm's and a forwarded one) would have landed
    assert usr1_marks(marks) == {r: [n] for r, n in NODE_OF_RANK.items()}


def test_hellos_waiting_before_start_are_read(slurm_cluster, tmp_path):  # noqa: F811
    """SlurmEngine.connect() starts the agent step; when start() first reads, the agents'
    hellos (srun's stdout) and srun's lines saying which node each task runs on (its
    stderr) are all waiting, and the hellos may be read first: none may be lost (each
    agent still gets its spec and ends 0) rather than waiting out the start timeout."""
    scenario = {
        "token": secrets.token_hex(16),
        "dir": str(tmp_path),
        "do": {"n1": "exit 0", "n2": "exit 0"},
        "delay_start": 2,
        "start_timeout": 10,
    }
    cp = slurm_cluster.run("salloc", "-N2", sys.executable, DRIVER, json.dumps(scenario), timeout=90)
    lines = [line for line in cp.stdout.splitlines() if line.startswith("{")]
    assert lines, f"driver printed no summary (exit {cp.returncode}):\n{cp.stdout}\n{cp.stderr}"
    out = json.loads(lines[-1])
    assert "error" not in out, out
    assert sorted((k, s) for k, s, _ in out["ends"]) == [(0, 0), (1, 0)]


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_max_restarts_inside_allocation(slurm_cluster, tmp_path, max_restarts):  # noqa: F811
    """A worker on n2 fails in the first attempt only: with --max-restarts 1 the group is
    restarted inside the allocation, on both nodes, and the job succeeds; with 0 the job
    ends with the worker's exit code (7), as torchrun's."""
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = launch_cmd("--max-restarts", str(max_restarts), marks=marks)
    env = slurm_cluster.env(FAIL_RANK="2", WORKER_SECONDS="60")  # the others run until stopped
    cp = slurm_cluster.run("salloc", "-N2", *cmd, timeout=120, env=env)
    first = pid_marks(marks, 0)
    assert {r: n for r, (_, n) in first.items()} == NODE_OF_RANK
    if max_restarts:
        assert cp.returncode == 0, cp.stderr
        second = pid_marks(marks, 1)
        assert {r: n for r, (_, n) in second.items()} == NODE_OF_RANK
        assert not {p for p, _ in second.values()} & {p for p, _ in first.values()}
    else:
        assert cp.returncode == 7, cp.stderr
        assert pid_marks(marks, 1) == {}
        assert "rank 2 (local rank 0) on node 1 (n2)" in cp.stderr


@pytest.mark.parametrize(
    "scancel_opts",
    [(), ("--batch",)],
    ids=["job-steps", "batch-shell"],
)
def test_scancel_signal_reaches_every_worker_once(slurm_cluster, jobs, tmp_path, scancel_opts):  # noqa: F811
    """``scancel --signal=USR1 JOB`` signals the job's steps (the agent step: Slurm
    delivers it to every process of the step, workers included); with ``--batch`` only
    the batch shell, here the distlaunch head, which relays it to the agent step through
    srun. Either way each worker on both nodes gets it once, and, as documented for
    SIGUSR1 (forwarded only, README "Supervision"), the job goes on: the workers keep
    running and then end by themselves, and the job ends COMPLETED with exit code 0."""
    marks = tmp_path / "marks"
    marks.mkdir()
    job = submit(slurm_cluster, jobs, tmp_path, marks)
    slurm_cluster.scancel(job, "--signal=USR1", *scancel_opts)
    assert_each_worker_got_usr1_once(marks, tmp_path / "out.txt")
    assert all(psutil.pid_exists(pid) for pid, _ in pid_marks(marks, 0).values())
    (marks / "done").touch()
    info = slurm_cluster.wait_job_end(job, 60)
    out = (tmp_path / "out.txt").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out
    assert "every worker succeeded" in out and pid_marks(marks, 1) == {}


@pytest.mark.slow
def test_time_limit_signal_then_time_limit(slurm_cluster, jobs, tmp_path):  # noqa: F811
    """``sbatch --time=1 --signal=USR1@59``: slurmctld sends SIGUSR1 to the job's steps
    when at most 59 s remain (its periodic check: within seconds of the start here), and
    every worker gets it once and keeps running; at the time limit (60 s) Slurm stops
    the job (SIGTERM, SIGKILL after KillWait) and no worker survives. About 70 s: Slurm's
    time limits are whole minutes."""
    marks = tmp_path / "marks"
    marks.mkdir()
    job = submit(slurm_cluster, jobs, tmp_path, marks, "--time=1", "--signal=USR1@59", seconds=600)
    assert_each_worker_got_usr1_once(marks, tmp_path / "out.txt")
    pids = [pid for pid, _ in pid_marks(marks, 0).values()]
    assert all(psutil.pid_exists(p) for p in pids)
    info = slurm_cluster.wait_job_end(job, 60 + slurm_cluster.kill_wait + 30)
    assert info["JobState"] == "TIMEOUT"
    deadline = time.monotonic() + slurm_cluster.kill_wait + 15
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)]
    assert pid_marks(marks, 1) == {}  # stopped, not restarted
