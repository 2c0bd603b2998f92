"""Issue 12, item 4 (remote kill): the head kills a host's recorded processes only when the
record is well-formed integers and each process is still the one recorded (start time)."""

import os
import subprocess
import sys
import time

import pytest
from sshd import sshd_hosts  # noqa: F401  (session fixture)
from test_supervision import wait_for

from distlaunch.agent.kill import parse_records, start_time, with_start_times
from distlaunch.engine.ssh import kill_command
from distlaunch.engine.ssh import kill_remote as _kill_remote
from distlaunch.hosts import Host


@pytest.mark.parametrize(
    "raw",
    [
        '["1; touch /tmp/pwned"]',
        '[["1; touch /tmp/pwned", 5]]',
        "[[true, 5]]",
        "[[12.0, 5]]",
        "[[99999999, 5]]",
        "[[1, 5]]",
        "[[123, -1]]",
        "[[123]]",
        '{"pid": 123}',
        '"123"',
        "not json",
        "[" * 100000,
    ],
)
def test_hostile_records_are_refused(raw):
    with pytest.raises(ValueError):
        parse_records(raw)


def test_records_round_trip_with_start_times():
    recs = with_start_times([os.getpid()])
    assert parse_records(str(recs).replace("'", '"')) == [(os.getpid(), start_time(os.getpid()))]
    assert start_time(os.getpid()) > 0


def _victim():
    """A process leading its own group, with a child in that group (a worker and its child)."""
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ],
        start_new_session=True,
    )
    time.sleep(0.3)
    return p


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group(pgid):
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == pgid]


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _run_kill(sshd, records):
    from distlaunch.remote.ssh import SSHConnection

    with SSHConnection(Host("node1"), sshd.options()) as conn:
        _kill_remote(conn, kill_command(sys.executable, os.getcwd(), {}, records))


def test_kill_over_ssh_kills_recorded_group(sshd_hosts):
    agent, worker = _victim(), _victim()
    members = _group(worker.pid)
    assert len(members) == 2
    try:
        _run_kill(sshd_hosts, parse_records(str(with_start_times([agent.pid, worker.pid]))))
        assert wait_for(lambda: not any(_alive(p) for p in members + [agent.pid]), 10)
    finally:
        for p in (agent, worker):
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait()


def test_kill_over_ssh_spares_a_reused_pid(sshd_hosts):
    # a record whose start time differs is another process now: it must survive
    agent, worker = _victim(), _victim()
    try:
        stale = [(agent.pid, start_time(agent.pid) - 1), (worker.pid, start_time(worker.pid) + 1)]
        _run_kill(sshd_hosts, stale)
        time.sleep(0.5)
        assert _alive(agent.pid) and _alive(worker.pid)
        assert len(_group(worker.pid)) == 2
    finally:
        for p in (agent, worker):
            os.killpg(p.pid, 9)
            p.wait()
