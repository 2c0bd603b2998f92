"""Head mode: `distlaunch run -H node1:2,node2:2` starts agents over SSH (a real sshd on
127.0.0.2 and 127.0.0.3) and supervises the job from one head."""

import json
import os
import re
import sys
import time

import psutil
from conftest import WORKERS, dl, dl_popen
from sshd import sshd_hosts  # noqa: F401  (session fixture)
from test_supervision import survivors, wait_for

import distlaunch


def head_args(sshd, hosts="node1:2,node2:2"):
    return ["run", "--ssh-config", sshd.ssh_config, "-H", hosts]


def test_two_hosts_ranks_output_and_env(sshd_hosts, tmp_path):
    env = dict(os.environ, SHIPPED="a b'c$d", NOT_SHIPPED="x")
    res = dl(
        *head_args(sshd_hosts),
        "-x",
        "SHIPPED",
        "-x",
        "SET_HERE=42",
        "--prefix-host",
        "--bind-to",
        "core",
        WORKERS / "actor.py",
        "--dump-env",
        tmp_path,
        "--lines",
        "3",
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    for r, e in enumerate(envs):
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["GROUP_RANK"]) == (
            str(r),
            "4",
            str(r % 2),
            str(r // 2),
        )
        assert e["SHIPPED"] == "a b'c$d" and e["SET_HERE"] == "42" and "NOT_SHIPPED" not in e
        assert e["DISTLAUNCH_NODE_ID"] == str(r // 2)
        assert "DISTLAUNCH_STORE_TOKEN" in e
    assert len({e["MASTER_ADDR"] + e["MASTER_PORT"] for e in envs}) == 1
    # --bind-to reaches the remote agents: one CPU per worker, distinct on each host
    assert all(len(e["_cpus"]) == 1 for e in envs)
    if len(os.sched_getaffinity(0)) > 1:
        assert envs[0]["_cpus"] != envs[1]["_cpus"] and envs[2]["_cpus"] != envs[3]["_cpus"]
    lines = res.stdout.splitlines()
    for r, host in enumerate(["node1", "node1", "node2", "node2"]):
        mine = [ln for ln in lines if ln.startswith(f"[{host}:{r}]: ")]
        assert [re.sub(r" x* end \d+$", "", ln) for ln in mine] == [
            f"[{host}:{r}]: line {i} of rank {r}" for i in range(3)
        ]


def test_failure_on_one_host_stops_the_other(sshd_hosts):
    t0 = time.monotonic()
    res = dl(
        *head_args(sshd_hosts),
        WORKERS / "actor.py",
        "--fail-rank",
        "1",
        "--fail-code",
        "9",
        "--fail-delay",
        "0.5",
        "--sleep",
        "60",
        timeout=120,
    )
    assert time.monotonic() - t0 < 40
    assert res.returncode == 9, res.stderr
    summary = res.stderr.split("root cause")[1]
    assert "rank 1 (local rank 1) on node 0 (node1)" in summary
    assert "rank 1 failing on purpose" in summary


def test_restart_across_hosts(sshd_hosts, tmp_path):
    res = dl(
        *head_args(sshd_hosts),
        "--max-restarts",
        "1",
        WORKERS / "actor.py",
        "--fail-rank",
        "3",
        "--fail-attempts",
        "1",
        "--mark-dir",
        tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert all((tmp_path / f"started.{r}.1").exists() for r in range(4))


def test_head_sigkill_leaves_no_survivor(sshd_hosts, tmp_path):
    p = dl_popen(
        *head_args(sshd_hosts),
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--spawn-child",
        tmp_path,
        "--sleep",
        "120",
    )
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 60)
    assert wait_for(lambda: all((tmp_path / f"child.{r}").exists() for r in range(4)), 20)
    pids = [int((tmp_path / f"child.{r}").read_text()) for r in range(4)]
    workers = [
        pr.info["pid"]
        for pr in psutil.process_iter(["pid", "cmdline"])
        if str(tmp_path) in " ".join(pr.info["cmdline"] or [])
        and "actor.py" in " ".join(pr.info["cmdline"] or [])
    ]
    assert len(survivors(workers)) >= 4
    p.kill()
    p.wait()
    assert wait_for(lambda: not survivors(workers + pids), 30), survivors(workers + pids)


def test_sigterm_to_head_stops_every_host(sshd_hosts, tmp_path):
    p = dl_popen(*head_args(sshd_hosts), WORKERS / "actor.py", "--mark-dir", tmp_path, "--sleep", "120")
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 60)
    p.terminate()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert all((tmp_path / f"SIGTERM.{r}").exists() for r in range(4))


def test_preflight_failure_starts_nothing(sshd_hosts, tmp_path):
    res = dl(
        *head_args(sshd_hosts),
        "--remote-python",
        "/nonexistent/python",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    assert "preflight failed on 2 of 2" in res.stderr and "/nonexistent/python" in res.stderr
    assert not list(tmp_path.iterdir())


def test_one_interpreter_per_host(sshd_hosts, tmp_path):
    """The agent checks its host itself: one interpreter per host, where a separate
    preflight probe used to start a second one."""
    log = tmp_path / "starts.log"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    res = dl(*head_args(sshd_hosts, "node1:1,node2:1"), "--remote-python", python, script, timeout=120)
    assert res.returncode == 0, res.stderr
    assert log.read_text().splitlines() == ["-m distlaunch agent"] * 2
    assert "preflight node1: ok" in res.stderr and "preflight node2: ok" in res.stderr


def test_agent_of_another_version_gets_no_spec(sshd_hosts, tmp_path):
    """An agent that answers with another version is refused before its spec (which
    holds the store's secret) is sent: it reads end-of-file, and nothing starts."""
    pkg = tmp_path / "old" / "distlaunch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0.9'\n")
    got = tmp_path / "stdin"
    got.mkdir()
    (pkg / "__main__.py").write_text(
        "import os, sys\n"
        "print('DISTLAUNCH-AGENT 0.0.9', flush=True)\n"
        f"open(os.path.join({str(got)!r}, str(os.getpid())), 'w').write(sys.stdin.read())\n"
    )
    # run in the old package's directory: `python -m distlaunch` finds it first
    res = dl(*head_args(sshd_hosts, "node1:1,node2:1"), "--remote-cwd", pkg.parent, WORKERS / "actor.py",
             "--mark-dir", tmp_path / "marks", timeout=120)  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "preflight failed on 2 of 2" in res.stderr
    assert f"distlaunch {distlaunch.__version__} expected, found 0.0.9" in res.stderr
    wait_for(lambda: len(list(got.iterdir())) == 2, 10)
    assert [f.read_text() for f in got.iterdir()] == ["", ""]  # end-of-file: no spec
    assert not (tmp_path / "marks").exists()


def test_unreachable_host_is_a_usage_error(sshd_hosts, tmp_path):
    res = dl(
        "run",
        "--ssh-config",
        sshd_hosts.ssh_config,
        "-H",
        "node1:1,127.0.0.9:1,127.0.0.10:1",
        "--ssh-port",
        str(sshd_hosts.port),
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        timeout=60,
    )
    assert res.returncode == 2
    # one line naming every unreachable host, each reason once (no stray separators)
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("distlaunch: error: cannot connect to 2 of 3 hosts: 127.0.0.9"), line
    assert "; 127.0.0.10" in line and ":;" not in line
    assert not list(tmp_path.iterdir())


def test_local_host_runs_in_process_with_remote_one(sshd_hosts, tmp_path):
    # localhost is this machine: its agent runs inside the head, the other over SSH.
    res = dl(
        *head_args(sshd_hosts, "localhost:1,node2:2"),
        WORKERS / "actor.py",
        "--dump-env",
        tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["GROUP_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "3"),
        ("1", "1", "3"),
        ("2", "1", "3"),
    ]
    assert "preflight node2: ok" in res.stderr


def test_hostfile_and_exclude(sshd_hosts, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# OpenMPI style\nnode1 slots=1\n\nnode2 slots=2 max_slots=4\n")
    out = tmp_path / "env"
    out.mkdir()
    res = dl(
        "run",
        "--ssh-config",
        sshd_hosts.ssh_config,
        "--hostfile",
        hostfile,
        "--exclude",
        "node1",
        WORKERS / "actor.py",
        "--dump-env",
        out,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["0.json", "1.json"]
    assert json.loads((out / "1.json").read_text())["GROUP_WORLD_SIZE"] == "1"


def test_unknown_host_key_is_refused(sshd_hosts, tmp_path):
    cfg = tmp_path / "ssh_config"
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    text = open(sshd_hosts.ssh_config).read()
    assert sshd_hosts.known_hosts in text
    cfg.write_text(text.replace(sshd_hosts.known_hosts, str(empty)))
    res = dl(
        "run", "--ssh-config", cfg, "-H", "node1:1", WORKERS / "actor.py", "--mark-dir", tmp_path, timeout=60
    )
    assert res.returncode == 2
    assert "host key" in res.stderr and "--ssh-accept-new-host-keys" in res.stderr
    res = dl(
        "run",
        "--ssh-config",
        cfg,
        "--ssh-accept-new-host-keys",
        "-H",
        "node1:1",
        WORKERS / "actor.py",
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert empty.read_text().strip()  # the accepted key was saved


def test_unresponsive_agent_is_killed_over_ssh(sshd_hosts, tmp_path):
    import signal

    p = dl_popen(
        *head_args(sshd_hosts),
        "--stop-timeout",
        "1",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--sleep",
        "120",
    )
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 60)
    # This job's agents are the parents of its workers (other jobs may be running).
    workers = [
        pr
        for pr in psutil.process_iter(["pid", "cmdline"])
        if str(tmp_path) in " ".join(pr.info["cmdline"] or [])
        and "distlaunch" not in " ".join(pr.info["cmdline"])
    ]
    agents = {w.ppid() for w in workers}
    assert len(agents) == 2
    frozen = psutil.Process(min(agents))
    frozen_workers = [w.pid for w in workers if w.ppid() == frozen.pid]
    assert len(frozen_workers) >= 2
    frozen.send_signal(signal.SIGSTOP)  # it can no longer hear the stop request
    try:
        t0 = time.monotonic()
        p.terminate()
        out, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 40
        assert "did not stop; killing its processes" in err
        assert wait_for(lambda: not survivors(frozen_workers + [frozen.pid]), 15)
    finally:
        if frozen.is_running():
            frozen.send_signal(signal.SIGCONT)


def run_in_pty(args, timeout=120):
    """Run distlaunch with stderr on a pseudo-terminal; return (exit code, stderr text)."""
    import pty
    import subprocess as sp

    from conftest import dl_cmd

    master, slave = pty.openpty()
    p = sp.Popen(dl_cmd(*args), stdout=sp.DEVNULL, stderr=slave, cwd=str(WORKERS.parent.parent))
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout), b"".join(chunks).decode(errors="replace")


def test_live_status_on_a_terminal_only(sshd_hosts):
    code, err = run_in_pty([*head_args(sshd_hosts), WORKERS / "actor.py", "--sleep", "0.5"])
    assert code == 0, err
    assert "\r\x1b[Kdistlaunch: connecting to 2 host(s)" in err
    assert "\r\x1b[Kdistlaunch: checking 2 host(s)" in err
    assert "starting 4 workers on 2 hosts: 4/4 ready" in err and "\x1b[K" in err
    res = dl(*head_args(sshd_hosts), WORKERS / "actor.py")
    assert res.returncode == 0 and "\x1b[K" not in res.stderr and "ready" not in res.stderr


def test_head_reports_rounds_once(sshd_hosts, tmp_path):
    res = dl(
        *head_args(sshd_hosts),
        "--max-restarts",
        "1",
        "--run-id",
        "hr",
        "--log-dir",
        tmp_path,
        WORKERS / "actor.py",
        "--fail-rank",
        "3",
        "--fail-code",
        "5",
        "--fail-attempts",
        "1",
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    err = res.stderr
    assert err.count("round 0: 2 node(s) [node1:2, node2:2], restart count 0") == 1
    assert err.count("round 0 ended: rank 3 (local rank 1) on node 1 (node2) exit code 5") == 1
    assert err.count("round 1: 2 node(s)") == 1 and "round 1 ended: every worker succeeded" in err
    events = [json.loads(ln) for ln in (tmp_path / "hr" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in events] == [
        ("round", 0),
        ("round_end", 0),
        ("round", 1),
        ("round_end", 1),
    ]


def test_repeatedly_failing_host_is_dropped(sshd_hosts):
    # rank 3 lives on node2 while it is a member: it fails twice, node2 is dropped, and
    # the job finishes on node1 alone.
    res = dl(
        *head_args(sshd_hosts),
        "--min-nodes",
        "1",
        "--max-restarts",
        "3",
        WORKERS / "actor.py",
        "--fail-rank",
        "3",
        "--fail-code",
        "4",
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "dropping host node2: its workers failed in 2 consecutive rounds" in res.stderr
    assert "round 2: 1 node(s) [node1:2], restart count 2" in res.stderr


def agent_of(tmp_path, host_rank_range):
    """The pid of the agent whose workers are ranks in ``host_rank_range`` (found from the
    workers' environment, as root)."""
    for pr in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(pr.info["cmdline"] or [])
        if str(tmp_path) in cmd and "distlaunch" not in cmd:
            try:
                if int(pr.environ().get("RANK", -1)) in host_rank_range:
                    return pr.ppid()
            except psutil.Error:
                pass
    return None


def test_lost_agent_dropped_with_min_nodes(sshd_hosts, tmp_path):
    import signal

    p = dl_popen(
        *head_args(sshd_hosts),
        "--min-nodes",
        "1",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--sleep",
        "5",
    )
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 60)
    agent = agent_of(tmp_path, range(2, 4))
    assert agent
    os.kill(agent, signal.SIGKILL)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 0, err
    assert "dropping host node2: agent on node2 ended" in err
    assert "round 1: 1 node(s) [node1:2], restart count 0" in err


def test_lost_agent_ends_the_job_without_min_nodes(sshd_hosts, tmp_path):
    import signal

    p = dl_popen(*head_args(sshd_hosts), WORKERS / "actor.py", "--mark-dir", tmp_path, "--sleep", "60")
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(4)), 60)
    os.kill(agent_of(tmp_path, range(2, 4)), signal.SIGKILL)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 1
    assert "node 1 was lost (agent on node2 ended" in err
