"""Round 0 planned by the head inside a Slurm allocation (tests/slurm.py's two-node
cluster): each agent starts its workers from its spec, before it imports the node agent,
the rendezvous and the observer, and every supervision guarantee holds in that window.

The window is widened on purpose: a ``sitecustomize`` in the agents (only there) delays
the import of ``distlaunch.agent.node`` by ``DELAY`` seconds and records, per node,
which modules were loaded at the agent's first spawn and whether a worker had been
spawned before that import began.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest
from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

# what an agent imports only once its round-0 workers are spawned
AFTER_SPAWN = {
    "distlaunch.agent.node",
    "distlaunch.rendezvous",
    "distlaunch.agent.observer",
    "distlaunch.events",
}
# what an agent never imports, in a job that succeeds: `run`'s options (the CLI's), GPU
# discovery (a restart's GPU release wait), the events (the head reports the rounds),
# the engine registry, the Slurm engine and the step's command line (remote.srun picks
# the agent's spec), the idna codec (store addresses are resolved as bytes), glob (the
# scratch directory and the segments are removed with os alone), subprocess (its workers
# are the fast lane's: the worker group adopts them)
NEVER = {
    "subprocess",
    "glob",
    "encodings.idna",
    "distlaunch.remote.command",
    "distlaunch.run_options",
    "distlaunch.devices",
    "distlaunch.events",
    "distlaunch.engine",
    "distlaunch.engine.slurm",
}
# what an agent has not imported at its first spawn either: its workers start from the
# spec's dict with the fast lane's spawn (agent.lane.spawn) before the configuration, the
# store client and the worker group are built (their dataclasses and typing: most of an
# agent's start); the sitecustomize below loads json itself
BEFORE_SPAWN_NEVER = {
    "dataclasses",
    "inspect",
    "socket",
    "distlaunch.env",
    "distlaunch.config",
    "distlaunch.store.client",
    "distlaunch.agent.specs",
    "distlaunch.agent.group",
    "distlaunch.agent.process",
}
DELAY = 1.5  # seconds the agents' import of the node agent takes here

AGENT_SITE = """\
import gc, json, os, sys, time
if sys.orig_argv[-3:] == ["-m", "distlaunch", "agent"]:
    marks, node = {marks!r}, os.environ["SLURMD_NODENAME"]
    spawned = []

    def spawning(event, args):  # an audit hook: subprocess's spawns and the fast lane's
        if event not in ("subprocess.Popen", "os.posix_spawn"):
            return
        if os.environ.get("FAIL_SPAWN_ON") == node:  # this node cannot start its workers
            raise PermissionError(13, "Permission denied (test)")
        if not spawned:
            with open(os.path.join(marks, "spawn." + node), "w") as f:
                json.dump(sorted(sys.modules), f)
            with open(os.path.join(marks, "gc-spawn." + node), "w") as f:
                f.write(str(gc.isenabled()))
        spawned.append(1)

    sys.addaudithook(spawning)
    me, leave = os.getpid(), os._exit

    def exit_(code):
        if os.getpid() == me:  # not the forked guard
            with open(os.path.join(marks, "exit." + node), "w") as f:
                json.dump(sorted(sys.modules), f)
            with open(os.path.join(marks, "gc-exit." + node), "w") as f:
                f.write(str(gc.isenabled()))
        leave(code)

    os._exit = exit_

    class SlowNode:
        # the node agent's import takes {delay} s: workers started from the spec run meanwhile
        def find_spec(self, name, path=None, target=None):
            if name == "distlaunch.agent.node":
                sys.meta_path.remove(self)
                tmp = os.path.join(marks, ".node." + node)  # renamed: never read half-written
                with open(tmp, "w") as f:
                    json.dump({{"spawned_before": bool(spawned), "pid": os.getpid()}}, f)
                os.rename(tmp, os.path.join(marks, "node." + node))
                time.sleep({delay})
            return None

    sys.meta_path.insert(0, SlowNode())
elif sys.orig_argv[-5:-3] == ["run", "--nproc-per-node"] and os.environ.get("SLOW_HEAD"):

    class SlowController:
        # the head's import of its controller (after the specs went out, before plan 0)
        def find_spec(self, name, path=None, target=None):
            if name == "distlaunch.head_controller":
                sys.meta_path.remove(self)
                open(os.path.join({marks!r}, "head.slow"), "w").close()
                time.sleep({delay} * 4)
            return None

    sys.meta_path.insert(0, SlowController())
"""

# rank, pid to a file; FAIL_RANK exits 3 at once; with a mark dir, waits for SIGTERM and
# records it (a worker stopped with grace, not SIGKILLed)
WORKER = """\
import os, signal, sys, time
rank = os.environ["RANK"]
print("rank", rank, "of", os.environ["WORLD_SIZE"], "master", os.environ["MASTER_ADDR"],
      os.environ["MASTER_PORT"], flush=True)
if rank == os.environ.get("FAIL_RANK") and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)
if len(sys.argv) > 1:
    marks = sys.argv[1]
    def term(signum, frame):
        open(os.path.join(marks, "term." + rank), "w").write(str(signum))
        sys.exit(128 + signum)
    signal.signal(signal.SIGTERM, term)
    tmp = os.path.join(marks, ".pid." + rank)  # renamed: a reader never sees it empty
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, os.path.join(marks, "pid." + rank))
    time.sleep(120)
"""


def _setup(cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AGENT_SITE.format(marks=str(marks), delay=DELAY))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    return marks, script, path


def _launch(script, *args, opts=()):
    return [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", *opts, str(script), *args]


def _node_marks(marks):
    return {p.name.split(".", 1)[1]: json.loads(p.read_text()) for p in marks.glob("node.*")}


def test_agents_spawn_before_the_node_agent_is_imported(slurm_cluster, tmp_path):  # noqa: F811
    """Each agent spawns its first worker before the node agent, the rendezvous, the
    observer and the events are imported, with the cyclic collector off until its node
    agent runs, and never imports NEVER; the ranks, MASTER_ADDR and MASTER_PORT the
    workers got are the ones the rendezvous then agrees on (the job succeeds, one
    MASTER_PORT for all), and output is prefixed from the first line."""
    marks, script, path = _setup(slurm_cluster, tmp_path)
    cp = slurm_cluster.run(
        "salloc", "-N2", *_launch(script), timeout=120, env=slurm_cluster.env(PYTHONPATH=path)
    )
    assert cp.returncode == 0, cp.stderr
    rows = sorted(ln for ln in cp.stdout.splitlines() if " rank " in ln)
    assert [r.split(": ", 1)[0] for r in rows] == ["[0]", "[1]", "[2]", "[3]"], cp.stdout
    assert [r.split()[2] for r in rows] == ["0", "1", "2", "3"]
    assert len({r.split("master ", 1)[1] for r in rows}) == 1, rows
    for node in ("n1", "n2"):
        seen = set(json.loads((marks / f"spawn.{node}").read_text()))
        assert not AFTER_SPAWN & seen, (node, sorted(AFTER_SPAWN & seen))
        assert not BEFORE_SPAWN_NEVER & seen, (node, sorted(BEFORE_SPAWN_NEVER & seen))
        at_exit = set(json.loads((marks / f"exit.{node}").read_text()))
        assert "distlaunch.agent.node" in at_exit and not NEVER & at_exit, (node, sorted(NEVER & at_exit))
        # the collector is off through the agent's start-up and back on once it runs
        gc_at = {w: (marks / f"gc-{w}.{node}").read_text() for w in ("spawn", "exit")}
        assert gc_at == {"spawn": "False", "exit": "True"}, (node, gc_at)
    assert all(m["spawned_before"] for m in _node_marks(marks).values()), _node_marks(marks)
    assert len(_node_marks(marks)) == 2


def test_worker_failing_before_the_agent_joins(slurm_cluster, tmp_path):  # noqa: F811
    """A worker of a head-planned round 0 that fails while its agent still imports the
    node agent: the failure is that round's (exit code 3, the root cause names rank 2 on
    n2), and with --max-restarts 1 the job restarts through the rendezvous and succeeds."""
    marks, script, path = _setup(slurm_cluster, tmp_path)
    env = slurm_cluster.env(PYTHONPATH=path, FAIL_RANK="2")
    cp = slurm_cluster.run("salloc", "-N2", *_launch(script), timeout=120, env=env)
    assert cp.returncode == 3, cp.stderr
    assert "rank 2 (local rank 0) on node 1 (n2)" in cp.stderr, cp.stderr
    assert all(m["spawned_before"] for m in _node_marks(marks).values()), _node_marks(marks)
    for p in marks.iterdir():
        p.unlink()
    again = slurm_cluster.run(
        "salloc", "-N2", *_launch(script, opts=("--max-restarts", "1")), timeout=120, env=env
    )
    assert again.returncode == 0, again.stderr
    assert {ln.split()[2] for ln in again.stdout.splitlines() if " rank " in ln} == {"0", "1", "2", "3"}
    assert all(m["spawned_before"] for m in _node_marks(marks).values()), _node_marks(marks)


def _wait_for(marks, pattern, count, timeout=60.0):
    deadline = time.monotonic() + timeout
    while len(list(marks.glob(pattern))) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(marks.glob(pattern))


def _signal_in_window(cluster, tmp_path, target, sig=signal.SIGTERM):
    """Start a job whose workers wait, send SIGTERM to ``target`` ("head" or "agent",
    n2's) once every worker runs and while the agents still import the node agent;
    returns (salloc's result, worker pids, marks)."""
    marks, script, path = _setup(cluster, tmp_path)
    head_pid = tmp_path / "head.pid"
    cmd = f"echo $$ > {head_pid}; exec {' '.join(_launch(script, str(marks)))}"
    env = cluster.env(PYTHONPATH=path, **({"SLOW_HEAD": "1"} if target == "head-before-plan" else {}))
    proc = cluster.popen("salloc", "-N2", "sh", "-c", cmd, env=env)
    try:
        pids = [int(p.read_text()) for p in _wait_for(marks, "pid.*", 4)]
        assert len(pids) == 4, "the workers did not start"
        # (an agent under load may reach its node agent's import after its workers run)
        assert len(_wait_for(marks, "node.*", 2)) == 2, "an agent did not import its node agent"
        nodes = _node_marks(marks)
        assert len(nodes) == 2 and all(m["spawned_before"] for m in nodes.values()), nodes
        if target == "head-before-plan":  # the head still imports its controller
            assert (marks / "head.slow").exists()
        pid = nodes["n2"]["pid"] if target == "agent" else int(head_pid.read_text())
        os.kill(pid, sig)  # within DELAY s of the agents' start: in the window
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err, pids, marks


def _gone(pids, timeout=15.0):
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if psutil.pid_exists(p)]


@pytest.mark.parametrize("target", ["head", "head-before-plan"])
def test_stop_signal_to_the_head_in_the_window(slurm_cluster, tmp_path, target):  # noqa: F811
    """SIGTERM to the head while the agents' early workers run and the agents still
    import the node agent (head-before-plan: and before the head published plan 0, so
    the agents learn that the job ended instead of a plan): every worker gets SIGTERM
    (its handler runs: stopped with grace), the job exits 143, no worker survives."""
    code, out, err, pids, marks = _signal_in_window(slurm_cluster, tmp_path, target)
    assert code == 143, err
    assert not _gone(pids)
    assert sorted(p.name for p in marks.glob("term.*")) == ["term.0", "term.1", "term.2", "term.3"], err


def test_stop_signal_to_an_agent_in_the_window(slurm_cluster, tmp_path):  # noqa: F811
    """SIGTERM to n2's agent in the same window: its relay passes it to its workers at
    once, the other node stops too (the signal is the round's stop cause), the job exits
    143, and no worker survives."""
    code, out, err, pids, marks = _signal_in_window(slurm_cluster, tmp_path, "agent")
    assert code == 143, err
    assert not _gone(pids)
    assert {"term.2", "term.3"} <= {p.name for p in marks.glob("term.*")}, err


def test_agent_that_cannot_start_its_planned_workers(slurm_cluster, tmp_path):  # noqa: F811
    """n2's agent cannot spawn its planned workers: it says why and ends without joining
    round 0; the head takes it for an agent lost before the job and stops n1's workers
    at once (not after the rendezvous' join timeout), and the job fails."""
    marks, script, path = _setup(slurm_cluster, tmp_path)
    env = slurm_cluster.env(PYTHONPATH=path, FAIL_SPAWN_ON="n2")
    t0 = time.monotonic()
    cp = slurm_cluster.run("salloc", "-N2", *_launch(script, str(marks)), timeout=120, env=env)
    took = time.monotonic() - t0
    assert cp.returncode == 1, cp.stderr
    assert "cannot start rank 2" in cp.stderr and "Permission denied (test)" in cp.stderr, cp.stderr
    assert "node 1 was lost (agent on n2 ended with status 1)" in cp.stderr, cp.stderr
    assert took < 30, f"took {took:.0f} s\n{cp.stderr}"
    pids = [int(p.read_text()) for p in marks.glob("pid.*")]
    assert not _gone(pids)


def test_agent_killed_in_the_window(slurm_cluster, tmp_path):  # noqa: F811
    """SIGKILL to n2's agent while its early workers run and it still imports the node
    agent: its orphan guard, forked before the first spawn, kills them; the head finds
    the agent lost, the job fails, and no worker survives on either node."""
    code, out, err, pids, marks = _signal_in_window(slurm_cluster, tmp_path, "agent", signal.SIGKILL)
    assert code not in (0, 143), err
    assert "agent on n2 ended" in err, err
    assert not _gone(pids)
