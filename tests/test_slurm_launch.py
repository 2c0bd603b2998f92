"""distlaunch run on a real two-node Slurm cluster (tests/slurm.py): inside an allocation
the agents start in one srun step (never SSH), under srun one launcher per node takes
nodes, ranks and the store from Slurm, a failing worker's exit code comes out,
scancel leaves no survivor, and a stop signal while the agent step starts cancels it at
once."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest
from conftest import ROOT, line_of
from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

from distlaunch import AGENT_HELLO

PROBE = """\
import os, sys, time
print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ.get("SLURMD_NODENAME"),
      "SLURM_PROCID" in os.environ, flush=True)
if len(sys.argv) > 1:
    tmp = os.path.join(sys.argv[1], f".pid.{os.environ['RANK']}")  # renamed: never read empty
    open(tmp, "w").write(str(os.getpid()))
    os.rename(tmp, os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"))
    time.sleep(300)
if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
    sys.exit(3)
"""


def run(cluster, tmp_path, *prefix, env=None, opts=()):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [*prefix, sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", *opts, str(script)]
    return cluster.run(*cmd, timeout=120, env=cluster.env(**(env or {})))


def ranks(cp):
    rows = sorted(line.split(": ", 1)[1].split() for line in cp.stdout.splitlines() if ": " in line)
    return [tuple(r) for r in rows]


def test_the_slurm_tests_share_one_xdist_worker(request, slurm_cluster):  # noqa: F811
    # under the README's `--dist loadgroup` the cluster's tests are one xdist group (conftest
    # marks them): a mark added after xdist read the marks left each worker its own cluster
    if not request.config.getoption("loadgroup", False):  # (xdist sets it in its workers)
        pytest.skip("only under pytest-xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@slurm_cluster"), request.node.nodeid


def test_allocation_agents_start_through_srun(slurm_cluster, tmp_path):  # noqa: F811
    cp = run(slurm_cluster, tmp_path, "salloc", "-N2")
    assert cp.returncode == 0, cp.stderr
    # ranks 0-1 on n1, 2-3 on n2; workers do not see the agent step's SLURM_PROCID
    assert ranks(cp) == [("0", "4", "n1", "False"), ("1", "4", "n1", "False"),
                         ("2", "4", "n2", "False"), ("3", "4", "n2", "False")]  # fmt: skip
    assert "preflight n1: ok" in cp.stderr and "preflight n2: ok" in cp.stderr
    plan = run(slurm_cluster, tmp_path, "salloc", "-N2", opts=("--dry-run",))
    assert "srun --overlap --nodes=2" in plan.stdout and "--nodelist=n1,n2" in plan.stdout


def test_one_launcher_per_node_under_srun(slurm_cluster, tmp_path):  # noqa: F811
    cp = run(slurm_cluster, tmp_path, "salloc", "-N2", "srun", "-N2", "--ntasks-per-node=1")
    assert cp.returncode == 0, cp.stderr
    assert [r[:3] for r in ranks(cp)] == [
        ("0", "4", "n1"),
        ("1", "4", "n1"),
        ("2", "4", "n2"),
        ("3", "4", "n2"),
    ]
    two = run(slurm_cluster, tmp_path, "salloc", "-N1", "-n2", "srun", "--ntasks-per-node=2")
    assert two.returncode == 2 and "use srun --ntasks-per-node=1" in two.stderr


def test_failing_worker_exit_code(slurm_cluster, tmp_path):  # noqa: F811
    cp = run(slurm_cluster, tmp_path, "salloc", "-N2", env={"FAIL_RANK": "2"})
    assert cp.returncode == 3, cp.stderr
    assert "rank 2 (local rank 0) on node 1 (n2)" in cp.stderr


def test_scancel_leaves_no_survivor(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    marks = tmp_path / "marks"
    marks.mkdir()
    job = slurm_cluster.sbatch(
        f"#!/bin/sh\n#SBATCH -N2 -o {tmp_path}/out.txt\n"
        f"exec {sys.executable} -m distlaunch run --nproc-per-node 2 {script} {marks}\n",
        env=slurm_cluster.env(PYTHONPATH=os.environ.get("PYTHONPATH", "")),
    )
    deadline = time.monotonic() + 60
    while len(list(marks.glob("pid.*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in marks.glob("pid.*")]
    assert len(pids) == 4, (tmp_path / "out.txt").read_text() if (tmp_path / "out.txt").exists() else ""
    slurm_cluster.scancel(job)
    slurm_cluster.wait_job_end(job, 60)
    deadline = time.monotonic() + slurm_cluster.kill_wait + 15
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if psutil.pid_exists(p)]


SLOW_PYTHON = """\
#!/bin/sh
# an interpreter slow to start: the agent says hello {delay} s after srun started it
echo $$ > "{marks}/agent.$SLURMD_NODENAME"
sleep {delay}
exec {python} "$@"
"""


SLOW_AGENT = """\
# sitecustomize of the agents: each says hello {delay} s after srun started it
import os, sys, time
if sys.argv[1:] == ["agent"] or sys.orig_argv[-3:] == ["-m", "distlaunch", "agent"]:
    open("{marks}/agent." + os.environ["SLURMD_NODENAME"], "w").write(str(os.getpid()))
    time.sleep({delay})
"""


SLOW_HEAD = """
# ... and the head's next import after the step's start takes 5 s: a SIGTERM lands
# before its own handling
class _SlowHead:
    def find_spec(self, name, path=None, target=None):
        if name == "distlaunch.preparse" and "run" in sys.orig_argv:
            time.sleep(5)
        return None
sys.meta_path.insert(0, _SlowHead())
"""


@pytest.mark.parametrize(
    "early,slow_head",
    [(False, False), (True, False), (True, True)],
    ids=["remote-python", "early-step", "slow-head"],
)
def test_stop_while_agent_step_starts(slurm_cluster, tmp_path, early, slow_head):  # noqa: F811
    """SIGTERM to the head while the agent step is still starting (the agents have not
    said hello, so none has its spec): the head exits 143 within a few seconds (it waited
    --stop-timeout + 5 s = 35 s for agents that never got a spec), the step is cancelled
    (no agent process is left) and no agent's hello line reaches the console. The step
    started by the engine (--remote-python: an interpreter slow to start) or before the
    CLI's imports (early-step: agents slow to start through a sitecustomize; slow-head:
    the head also slow to import what follows the step's start, so the signal comes
    before the CLI handles signals: the early step must not outlive it)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    head_pid = tmp_path / "head.pid"
    path = os.environ.get("PYTHONPATH", "")
    if early:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            SLOW_AGENT.format(delay=3, marks=marks) + (SLOW_HEAD if slow_head else "")
        )
        path = os.pathsep.join([str(site), path])
        opts = ""
    else:
        slow = tmp_path / "slow-python"
        slow.write_text(SLOW_PYTHON.format(delay=3, marks=marks, python=sys.executable))
        slow.chmod(0o755)
        opts = f"--remote-python {slow} "
    cmd = f"echo $$ > {head_pid}; exec {sys.executable} -m distlaunch run --nproc-per-node 2 {opts}{script}"
    env = slurm_cluster.env(PYTHONPATH=path)
    proc = slurm_cluster.popen("salloc", "-N2", "sh", "-c", cmd, env=env)
    try:
        deadline = time.monotonic() + 60
        # each mark holds its pid once written (created first: it may read empty)
        while sum(bool(p.read_text()) for p in marks.glob("agent.*")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        agents = [int(p.read_text()) for p in marks.glob("agent.*")]
        assert len(agents) == 2, "the agent step did not start"
        t0 = time.monotonic()
        os.kill(int(head_pid.read_text()), signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 10, f"the head took {took:.1f} s to stop\n{err}"
    assert proc.returncode == 143, err
    assert AGENT_HELLO not in out + err, out + err
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in agents if psutil.pid_exists(p)], "the agent step was not cancelled"


def test_hang_timeout_inside_an_allocation_names_the_stuck_rank(slurm_cluster):  # noqa: F811
    """--hang-timeout in the agents Slurm started: rank 2 (on n1, beside two ranks that
    wait) is named with its line; the job ends as a failure."""
    prog = ROOT / "tests" / "hang_workers" / "plain.py"
    stuck = line_of(prog, "STUCK-LINE")
    launch = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "3", "--hang-timeout", "3"]
    cp = slurm_cluster.run("salloc", "-N2", *launch, str(prog), "quiet", timeout=120, env=slurm_cluster.env())
    assert cp.returncode == 1, cp.stderr
    root = cp.stderr[cp.stderr.index("root cause") :]
    assert "hang: 2 of 3 ranks in wait_here (plain.py:" in root, root
    assert f"rank 2 in stuck_here at plain.py:{stuck}" in root, root


def test_head_starts_the_agent_step_first_and_imports_no_click(slurm_cluster, tmp_path):  # noqa: F811
    """`python -m distlaunch run --nproc-per-node 2 SCRIPT` in an allocation starts the
    agent step before its next import (remote/srun.py), having imported none of the
    heavier modules the rest of the head needs (dataclasses, inspect, our env and
    config; typing too, where the interpreter's site does not load it), and srun
    started without subprocess, re, shlex, fnmatch or signal (~15 ms of CPU before
    the step could start; where the site has not loaded them): with that import held
    until the job has the step (tests/slurm_programs/head_gate), the job still runs;
    and the head takes the common form without click (preparse) and without loading
    the single-node fast lane, and resolves addresses without the idna codec; the
    cyclic collector stays off until the agents run (startup.py)."""
    gate = ROOT / "tests" / "slurm_programs" / "head_gate"
    path = os.pathsep.join([str(gate), os.environ.get("PYTHONPATH", "")])
    modules = tmp_path / "head_modules.json"
    cp = run(slurm_cluster, tmp_path, "salloc", "-N2", env={"PYTHONPATH": path, "HEAD_MODULES": str(modules)})
    assert cp.returncode == 0, cp.stderr
    assert len(ranks(cp)) == 4, cp.stdout
    loaded = json.loads(modules.read_text())
    assert "distlaunch.head" in loaded and "click" not in loaded, [m for m in loaded if "click" in m]
    assert "distlaunch.quick" not in loaded  # the fast lane declines in an allocation: never loaded
    assert "encodings.idna" not in loaded  # addresses are resolved as bytes: no idna codec
    assert "distlaunch.policy" not in loaded  # the head's policy: only once a round stops
    assert "distlaunch.numa" not in loaded  # (the agents bind their workers' CPUs)
    # the cyclic collector is off through the head's start-up, on once its agents run
    gc_at = json.loads((tmp_path / "head_modules.json.gc").read_text())
    assert gc_at == {"controller": False, "exit": True}, gc_at
    at_step = set(json.loads((tmp_path / "head_modules.json.step").read_text()))
    heavier = {"dataclasses", "inspect", "distlaunch.env", "distlaunch.config"}
    assert "distlaunch.remote.srun" in at_step and not heavier & at_step, sorted(heavier & at_step)
    at_srun = set((tmp_path / "head_modules.json.srun").read_text().split())
    spawning = {
        "subprocess",
        "re",
        "shlex",
        "fnmatch",
        "signal",
        "selectors",
        "enum",
        "typing",
        "dataclasses",
    }
    assert "distlaunch.remote.srun" in at_srun and not spawning & at_srun, sorted(spawning & at_srun)
