"""Issue 12, items 5 and 7: in head mode no shipped value reaches a command line (the
remote host's ps and audit logs show command lines), dry runs show names only, and the
agent's end is recorded under its host's id."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import WORKERS, dl_cmd
from sshd import _skip_reason, _stop, start_sshd

SECRET_VALUE = "s3cr3t-value-9f1c"


@pytest.fixture
def recording_sshd(tmp_path):
    """A real sshd whose ForceCommand appends every requested command line to a file
    (what an audit log or `ps` on the host sees) and then runs it."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    log = tmp_path / "commands.log"
    recorder = tmp_path / "record.sh"
    recorder.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$SSH_ORIGINAL_COMMAND" >> {log}\n'
        f'exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"\n'
    )
    recorder.chmod(0o755)
    server = start_sshd(tmp_path / "sshd", extra=(f"ForceCommand {recorder}",))
    try:
        yield server, log
    finally:
        _stop(server.process)


def test_env_all_values_travel_on_stdin_never_on_the_command_line(recording_sshd, tmp_path):
    server, log = recording_sshd
    out = tmp_path / "env"
    out.mkdir()
    env = dict(
        os.environ,
        MY_SECRET_SETTING=SECRET_VALUE,
        DISTLAUNCH_LAUNCH_TOKEN="tok-" + SECRET_VALUE,
        MY_NAMED="named-" + SECRET_VALUE,
    )
    res = subprocess.run(
        dl_cmd(
            "run",
            "--ssh-config",
            server.ssh_config,
            "-H",
            "node1:1",
            "--env-all",
            "-x",
            "MY_NAMED",
            WORKERS / "actor.py",
            "--dump-env",
            out,
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    worker = json.loads((out / "0.json").read_text())
    assert worker["MY_SECRET_SETTING"] == SECRET_VALUE  # shipped by --env-all
    assert worker["MY_NAMED"] == "named-" + SECRET_VALUE  # shipped by -x
    commands = log.read_text()
    assert "distlaunch agent" in commands  # the recorder saw the agent's start
    assert SECRET_VALUE not in commands, commands


def test_head_dry_run_shows_names_never_values(tmp_path):
    env = dict(os.environ, MY_SECRET_SETTING=SECRET_VALUE, MY_NAMED="named-" + SECRET_VALUE)
    res = subprocess.run(
        dl_cmd(
            "run",
            "-H",
            "nodeA:1",
            "--env-all",
            "-x",
            "MY_NAMED",
            "-x",
            f"INLINE={SECRET_VALUE}",
            "--dry-run",
            WORKERS / "actor.py",
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert SECRET_VALUE not in res.stdout + res.stderr
    for name in ("MY_SECRET_SETTING", "MY_NAMED", "INLINE"):
        assert name in res.stdout


def test_agent_records_its_end_under_its_host_id(tmp_path):
    """`distlaunch agent` as the head starts it (spec on stdin) for host index 1: the head
    tells a finished agent from a lost one by agent_exit/<host index>."""
    from distlaunch.agent.node import NodeOptions
    from distlaunch.config import LaunchConfig
    from distlaunch.rendezvous import Rendezvous
    from distlaunch.store import StoreClient, StoreServer

    token = os.urandom(16).hex()
    cfg = LaunchConfig(entrypoint=str(WORKERS / "actor.py"), run_id="agentexit").validate()
    with (
        StoreServer("127.0.0.1", 0, token=token) as server,
        StoreClient("127.0.0.1", server.port, token=token, timeout=30) as client,
    ):
        Rendezvous(client, cfg.run_id, 0, 1).publish_plan(0, [1], 0)  # host 1 is the only member
        spec = {
            "config": cfg.to_dict(),
            "store": ["127.0.0.1", server.port],
            "token": token,
            "node": dataclasses.asdict(NodeOptions(node_id=1, slots=1, host_label="h1")),
            "env": {},
            "master_addr": "127.0.0.1",
        }
        res = subprocess.run(
            [sys.executable, "-m", "distlaunch", "agent"],
            input=json.dumps(spec) + "\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        assert client.check([f"{cfg.run_id}/agent_exit/1"])
        assert not client.check([f"{cfg.run_id}/agent_exit/0"])


def test_single_node_dry_run_hides_shipped_values():
    res = subprocess.run(
        dl_cmd("run", "-x", f"MY_NAMED={SECRET_VALUE}", "--dry-run", WORKERS / "actor.py"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "MY_NAMED=****" in res.stdout and SECRET_VALUE not in res.stdout
