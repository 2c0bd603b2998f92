"""The Slurm engine (distlaunch/engine/slurm.py) on the real two-node test cluster
(tests/slurm.py): a driver inside ``salloc -N2`` starts stand-in agents
(tests/slurm_programs/agent.py) in one srun step and reports what the engine saw."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest
from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

from distlaunch.engine.slurm import broadcast_line, select_spec
from distlaunch.errors import ConfigError
from distlaunch.remote import srun

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "slurm_programs", "engine_driver.py")


def drive(cluster, tmp_path, do: dict, timeout: float = 90, env: dict | None = None, **scenario):
    """Run the driver in a fresh 2-node allocation; returns (summary, completed salloc)."""
    token = secrets.token_hex(16)
    scenario = {"token": token, "dir": str(tmp_path), "do": do, **scenario}
    cp = cluster.run(
        "salloc",
        "-N2",
        sys.executable,
        DRIVER,
        json.dumps(scenario),
        timeout=timeout,
        env=cluster.env(**(env or {})),
    )
    lines = [line for line in cp.stdout.splitlines() if line.startswith("{")]
    assert lines, f"driver printed no summary (exit {cp.returncode}):\n{cp.stdout}\n{cp.stderr}"
    return json.loads(lines[-1]), cp, token


def got(tmp_path, node: str) -> dict:
    return json.loads((tmp_path / f"got-{node}").read_text())


def test_specs_reach_their_nodes_and_ends_are_per_node(slurm_cluster, tmp_path):  # noqa: F811
    out, cp, token = drive(slurm_cluster, tmp_path, {"n1": "exit 0", "n2": "exit 3"})
    assert out["nodes"] == slurm_cluster.hostnames("n[1-2]")
    # each agent kept its own spec (by SLURMD_NODENAME) and knows where it runs
    for k, node in enumerate(out["nodes"]):
        seen = got(tmp_path, node)
        assert seen["spec"]["node"] == {"node_id": k, "host_label": node}
        assert seen["spec"]["token"] == token
        assert seen["env"]["SLURMD_NODENAME"] == node
        assert seen["env"]["SLURM_NODEID"] == str(k)
    # the secret is never on a command line: not srun's, not the agents'
    assert not any(token in a for a in out["argv"])
    # every end reported once, with its own status
    assert sorted((k, s) for k, s, _ in out["ends"]) == [(0, 0), (1, 3)]
    # output relayed as whole lines without srun's labels or verbose chatter
    for node in out["nodes"]:
        assert f"agent on {node}: node {out['nodes'].index(node)}" in cp.stdout.splitlines()
        assert f"agent stderr on {node}" in cp.stderr.splitlines()
    assert "launching StepId" not in cp.stderr and "defined options" not in cp.stderr
    assert "srun: error: n2: task 1: Exited with exit code 3" in cp.stderr
    # Slurm's addresses (both nodes are NodeAddr=127.0.0.1 in the test cluster)
    assert out["master"] == ["127.0.0.1", "127.0.0.1"] and out["store"] == "127.0.0.1"


def test_a_dead_agent_is_reported_while_the_others_run(slurm_cluster, tmp_path):  # noqa: F811
    out, cp, _ = drive(slurm_cluster, tmp_path, {"n1": "sleep 4", "n2": "die 0.2"})
    ends = {k: (s, t) for k, s, t in out["ends"]}
    assert ends[1][0] == -1  # killed by a signal
    assert ends[0][0] == 0
    assert ends[1][1] < ends[0][1] - 1.0  # heard of when it happened, not at the step's end


def test_kill_reaches_the_recorded_process(slurm_cluster, tmp_path):  # noqa: F811
    out, cp, _ = drive(slurm_cluster, tmp_path, {"n1": "exit 0", "n2": "sleep 60"}, kill=1, timeout=60)
    ends = {k: (s, t) for k, s, t in out["ends"]}
    assert ends[1][0] == -1 and ends[1][1] < out["killed_at"] + 15, out
    assert ends[0][0] == 0


@pytest.mark.parametrize(
    "scenario, env, problem",
    [
        ({"cwd": "/nonexistent-dir"}, {}, "directory /nonexistent-dir does not exist"),
        ({}, {"FAKE_VERSION": "0.0.0"}, "expected, found 0.0.0"),
    ],
)
def test_failed_checks_start_nothing(slurm_cluster, tmp_path, scenario, env, problem):  # noqa: F811
    out, cp, _ = drive(slurm_cluster, tmp_path, {"n1": "exit 0", "n2": "exit 0"}, env=env, **scenario)
    assert "preflight failed on 2 of 2 Slurm node(s) (n1, n2); nothing was started" in out["error"]
    for node in ("n1", "n2"):
        assert any(
            line.startswith(f"distlaunch: preflight {node}: ") and problem in line
            for line in cp.stderr.splitlines()
        )
    assert not list(tmp_path.glob("got-*"))  # no agent read a spec


def test_no_answer_within_the_start_timeout(slurm_cluster, tmp_path):  # noqa: F811
    # agents that do not say hello in time are a problem, not a hang
    out, cp, _ = drive(slurm_cluster, tmp_path, {"n1": "exit 0", "n2": "exit 0"}, start_timeout=0.001)
    assert "nothing was started" in out["error"]
    assert not list(tmp_path.glob("got-*"))


def test_broadcast_line_round_trip():
    specs = {
        "n1": {"token": "t", "node": {"node_id": 0}, "env": {"A": "1"}},
        "n2": {"token": "t", "node": {"node_id": 1}, "env": {"A": "1"}},
    }
    message = json.loads(broadcast_line(specs))
    assert message["common"] == {"token": "t", "env": {"A": "1"}}  # sent once
    for name, spec in specs.items():
        assert select_spec(message, {"SLURMD_NODENAME": name}) == spec
    with pytest.raises(ConfigError, match="no job spec for Slurm node 'n3'"):
        select_spec(message, {"SLURMD_NODENAME": "n3"})
    with pytest.raises(ConfigError, match="SLURMD_NODENAME is not set"):
        select_spec(message, {})


def test_early_start_only_for_a_launch_the_command_line_decides(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    alloc = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    s = str(script)
    for args in ([s, "--lr", "1"], ["--nproc-per-node", "2", s], ["--nproc_per_node=4", s, "-x"]):
        assert srun.early_script(args, alloc) == s, args
    for args, env in [
        ([s], {}),  # not in an allocation
        ([s], {**alloc, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}),  # under srun: a node's launcher
        ([s], {**alloc, "PET_NNODES": "2"}),  # options from the environment
        (["--dry-run", s], alloc),
        (["-H", "a,b", s], alloc),
        (["--nproc-per-node", "0", s], alloc),
        (["--nproc-per-node", "gpu", s], alloc),
        (["--nproc-per-node", "\u00b2", s], alloc),  # a digit to str.isdigit, not to int()
        (["--nproc-per-node", s], alloc),
        ([str(tmp_path / "missing.py")], alloc),
        ([], alloc),
    ]:
        assert srun.early_script(args, env) is None, (args, env)


SPAWN_PROBE = """\
import os, signal, sys
ignored = int(sys.argv[1], 16)  # the shell's SigIgn, as exec gave it (Python ignores both itself)
default = [not ignored & (1 << s - 1) for s in (signal.SIGPIPE, signal.SIGXFSZ)]
print(os.getsid(0) == os.getpid(), *default, sorted(int(f) for f in os.listdir("/proc/self/fd")),
      os.environ.get("PROBE_VAR"), sys.stdin.read(), flush=True)
print("err", file=sys.stderr)
sys.exit(int(os.environ["PROBE_CODE"]))
"""


@pytest.mark.parametrize("way", ["posix_spawn", "no-setsid"])
def test_srun_is_started_as_popen_would(tmp_path, monkeypatch, way):
    """remote.srun.popen starts srun through os.posix_spawn (no subprocess import before
    the step starts) as ``subprocess.Popen(..., stdin/stdout/stderr=PIPE,
    start_new_session=True)`` would: a session of its own, SIGPIPE and SIGXFSZ at their
    defaults, no inherited descriptor but the three pipes (one inheritable here is
    not passed on), its environment, stdin written and closed, and Popen's exit codes
    (-N for a signal); a missing program raises FileNotFoundError. The same through
    subprocess where posix_spawn cannot start a session (no-setsid: a Python built
    without POSIX_SPAWN_SETSID raises NotImplementedError)."""
    if way == "no-setsid":

        def no_setsid(*args, **kwargs):
            raise NotImplementedError("setsid")

        monkeypatch.setattr(os, "posix_spawn", no_setsid)
    probe = tmp_path / "probe.py"
    probe.write_text(SPAWN_PROBE)
    shell = f"exec {sys.executable} {probe} $(sed -n 's/^SigIgn:\\t//p' /proc/$$/status)"
    argv = ["sh", "-c", shell]
    env = {**os.environ, "PROBE_VAR": "x y", "PROBE_CODE": "3"}
    leak_r, leak_w = os.pipe()
    os.set_inheritable(leak_w, True)
    try:
        ours = srun.popen(argv, env)
        theirs = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        outs = []
        for p in (ours, theirs):
            p.stdin.write(b"spec\n")
            p.stdin.close()
            outs.append((p.stdout.read(), p.stderr.read()))
            p.wait()
    finally:
        os.close(leak_r)
        os.close(leak_w)
    assert outs[0] == outs[1] and outs[0][0].startswith(b"True True True [0, 1, 2, 3] x y spec"), outs
    assert ours.returncode == theirs.returncode == 3 and ours.poll() == 3
    sleeper = srun.popen([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ))
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):  # as Popen.wait
        sleeper.wait(0.05)
    sleeper.terminate()
    assert sleeper.wait(10) == -15 and sleeper.returncode == -15
    sleeper.kill()  # reaped: nothing to signal, no error
    with pytest.raises(FileNotFoundError):
        srun.popen(["distlaunch-no-such-srun"], dict(os.environ))


@pytest.mark.parametrize("reap", ["poll", "wait"])
def test_a_poll_from_a_signal_handler_does_not_lose_the_exit_code(monkeypatch, reap):
    """A signal handler's poll (the engine's signal_group, SIGUSR1 relayed) that runs
    while Srun is reaping, just before its waitpid, must not reap srun itself: the
    interrupted waitpid would find no child and the exit code (7) would read 0. As
    Popen's _waitpid_lock, the nested poll says None and the reap gets 7."""
    import signal

    proc = srun.popen([sys.executable, "-c", "import sys; sys.exit(7)"], dict(os.environ))
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped
    nested, raised = [], []
    waitpid = os.waitpid

    def handler(signum, frame):
        nested.append(proc.poll())

    def waitpid_after_a_signal(pid, options):
        if not raised:  # the handler runs here, between the reap's check and its waitpid
            raised.append(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
        return waitpid(pid, options)

    old = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(os, "waitpid", waitpid_after_a_signal)
    try:
        code = proc.poll() if reap == "poll" else proc.wait()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert (code, proc.returncode, nested) == (7, 7, [None])


def test_srun_is_found_on_the_path_of_its_environment(tmp_path):
    """As Popen(env=...), a program without a ``/`` is looked up on the PATH of the
    environment it is given, not this process's; one that is there but not executable
    raises PermissionError, none FileNotFoundError, both naming it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "distlaunch-fake-srun"
    fake.write_text("#!/bin/sh\necho found $1\n")
    fake.chmod(0o755)
    (bin_dir / "distlaunch-not-executable").write_text("#!/bin/sh\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'missing'}:{bin_dir}:/usr/bin:/bin"}
    proc = srun.popen(["distlaunch-fake-srun", "x"], env)
    proc.stdin.close()
    assert proc.stdout.read() == b"found x\n" and proc.wait() == 0
    proc.stdout.close()
    proc.stderr.close()
    for name, error in (("distlaunch-not-executable", PermissionError), ("no-such", FileNotFoundError)):
        with pytest.raises(error) as ours:
            srun.popen([name], env)
        with pytest.raises(error) as theirs:
            subprocess.Popen([name], env=env)
        assert ours.value.filename == theirs.value.filename == name


def test_a_failure_before_srun_runs_leaves_no_child(monkeypatch):
    """An error while srun's pipes are set up (here the third file's open) raises with
    no srun started: none left running unreaped, nothing of it to supervise."""
    import builtins

    spawned, opened = [], []
    real_open = builtins.open

    def recording(spawn):
        def recording_spawn(*args, **kwargs):
            spawned.append(spawn(*args, **kwargs))
            return spawned[-1]

        return recording_spawn

    def failing_open(fd, *args, **kwargs):
        opened.append(fd)
        if len(opened) == 3:
            raise MemoryError("open")
        return real_open(fd, *args, **kwargs)

    for name in ("posix_spawn", "posix_spawnp"):
        monkeypatch.setattr(os, name, recording(getattr(os, name)))
    monkeypatch.setattr(srun, "open", failing_open, raising=False)
    with pytest.raises(MemoryError):
        srun.popen([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
    for pid in spawned:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert spawned == []


FAKE_SRUN = """#!/bin/sh
echo $$ > {pid}
exec sleep 60
"""


def test_an_early_step_that_differs_is_ended(tmp_path, monkeypatch):
    """take_early hands over the early srun only when it runs the command line and
    environment the engine asks for; any other is terminated and reaped (a stand-in srun
    that would run 60 s)."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    (tmp_path / "srun").write_text(FAKE_SRUN.format(pid=tmp_path / "srun.pid"))
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    for env in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(env)
    cmd_env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}
    argv = srun.srun_argv(["n1", "n2"], sys.executable, os.getcwd())
    env = srun.srun_env(cmd_env)

    srun.start_early([str(script)])
    proc = srun.take_early(argv, env)  # the one the engine would start
    assert proc is not None and proc.poll() is None
    proc.kill()
    proc.wait()
    assert srun.take_early(argv, env) is None  # handed over once

    (tmp_path / "srun.pid").unlink(missing_ok=True)  # the first stand-in's, if it got to write it
    srun.start_early([str(script)])
    pid = _stand_in_pid(tmp_path / "srun.pid")
    assert srun.take_early(argv[:-1] + ["other"], env) is None
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(pid, 0)


def _stand_in_pid(path, timeout=30.0):
    """The pid the stand-in srun wrote to ``path`` once it runs."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(path.read_text())


def test_an_early_step_is_ended_when_the_cli_leaves_without_it(tmp_path):
    """Every way out of the CLI goes through ``cli._leave`` (usage and configuration
    errors, Ctrl-C): an early step nobody took over must not outlive it (review finding:
    the stand-in srun ran on after the launcher exited)."""
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    (tmp_path / "srun").write_text(FAKE_SRUN.format(pid=tmp_path / "srun.pid"))
    (tmp_path / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_"))}
    env.update(
        PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-2]"
    )
    leave = (
        "import sys\n"
        "from distlaunch.remote import srun\n"
        "srun.start_early(sys.argv[1:])\n"
        "from distlaunch import cli\n"
        "cli._leave(2)\n"
    )
    res = subprocess.run([sys.executable, "-c", leave, str(script)], env=env, capture_output=True, timeout=60)
    assert res.returncode == 2, res.stderr
    pid = _stand_in_pid(tmp_path / "srun.pid")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError(f"the early step (stand-in pid {pid}) outlived the CLI")
