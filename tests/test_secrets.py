"""Issue 12, item 1: no store is guarded by a value an outsider can derive (run ids,
ports, endpoints are public: `ps` shows them). Real launchers, real stores; the
outsider knows every public value and the old derivation rules."""

import os
import pathlib
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import WORKERS, dl, dl_popen
from test_pernode import finish, free_port, launch_nodes
from test_supervision import wait_for

from distlaunch.errors import StoreAuthError
from distlaunch.store import StoreClient


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _refused(port: int, token: str) -> bool:
    try:
        with StoreClient("127.0.0.1", port, token=token, timeout=5, connect_timeout=5) as c:
            c.check(["x"])
    except StoreAuthError:
        return True
    return False


def _env_without_secrets(config_home) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTLAUNCH_STORE_TOKEN")}
    env["XDG_CONFIG_HOME"] = str(config_home)
    return env


def test_per_node_store_refuses_tokens_derived_from_public_values(tmp_path):
    port = free_port()
    env = _env_without_secrets(tmp_path / "cfg")

    def node(k):
        return dl_popen("run", "--nnodes", "2", "--node-rank", k, "--master-addr", "127.0.0.1",
                        "--master-port", port, WORKERS / "actor.py", env=env)  # fmt: skip

    node0 = node(0)
    try:
        assert wait_for(lambda: _port_open(port)), "node 0 never hosted its store"
        # the old derivation (run id = job<port>), the run id alone, and an empty token
        for guess in (f"distlaunch-job{port}", f"job{port}", ""):
            assert _refused(port, guess), guess
        secret_file = tmp_path / "cfg" / "distlaunch" / "secret"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        node1 = node(1)
        results = finish([node0, node1])
        assert [r[2] for r in results] == [0, 0], results
    finally:
        node0.kill()


def test_dynamic_store_refuses_endpoint_derived_token(tmp_path):
    port = free_port()
    env = _env_without_secrets(tmp_path / "cfg")
    p = dl_popen(
        "run", "--nnodes", "2:2", "--rdzv-endpoint", f"127.0.0.1:{port}", WORKERS / "actor.py", env=env
    )
    try:
        assert wait_for(lambda: _port_open(port))
        assert _refused(port, f"distlaunch-job-127.0.0.1-{port}")
    finally:
        p.kill()
        p.communicate()


def test_two_nodes_agree_through_the_per_user_secret_file_created_concurrently(tmp_path):
    # both launchers start at once with no secret file: one creates it, both use it
    results = finish(launch_nodes(env=_env_without_secrets(tmp_path / "cfg")))
    assert [r[2] for r in results] == [0, 0], results


def _token_file(path: pathlib.Path, mode: int, text: str = "0123456789abcdef0123") -> pathlib.Path:
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_store_token_file_is_shared_and_checked(tmp_path):
    good = _token_file(tmp_path / "token", 0o600)
    env = _env_without_secrets(tmp_path / "no-such-config")
    results = finish(launch_nodes(env=env, nproc=1, extra=("--store-token-file", good)))
    assert [r[2] for r in results] == [0, 0], results
    # the file was used: no per-user secret was created
    assert not (tmp_path / "no-such-config" / "distlaunch" / "secret").exists()


@pytest.mark.parametrize("case", ["group-readable", "other-owner", "short", "missing", "via-env"])
def test_bad_token_file_is_refused_before_anything_starts(tmp_path, case):
    path = tmp_path / "token"
    if case == "group-readable":
        _token_file(path, 0o640)
    elif case == "other-owner":
        _token_file(path, 0o600)
        os.chown(path, 65534, 65534)  # nobody (the tests run as root)
    elif case == "short":
        _token_file(path, 0o600, "short")
    elif case == "via-env":
        _token_file(path, 0o644)
    env = _env_without_secrets(tmp_path / "cfg")
    args = ["run", "--nnodes", "2", "--node-rank", "0", "--master-port", free_port()]
    if case == "via-env":
        env["DISTLAUNCH_STORE_TOKEN_FILE"] = str(path)
    else:
        args += ["--store-token-file", path]
    res = dl(*args, WORKERS / "actor.py", env=env, timeout=30)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0], res.stderr
    expected = {
        "group-readable": "chmod 600",
        "other-owner": "not by you",
        "short": "at least 16",
        "missing": "cannot be read",
        "via-env": "chmod 600",
    }[case]
    assert expected in lines[0], res.stderr


def test_no_secret_to_be_had_exits_2_saying_how(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = _env_without_secrets(blocker / "sub")  # a config dir under a file: cannot be made
    res = dl(
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-port",
        free_port(),
        WORKERS / "actor.py",
        env=env,
        timeout=30,
    )
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and "DISTLAUNCH_STORE_TOKEN" in line and "--store-token-file" in line


ENV_WORKER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import distlaunch.collectives as dist
    dist.init_process_group(init_method="env://", timeout=30)
    x = np.array([dist.get_rank() + 1.0])
    dist.all_reduce(x)
    print("sum", x[0])
    dist.destroy_process_group()
""")


def test_env_init_by_hand_needs_no_setup_and_refuses_the_old_fixed_token(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(ENV_WORKER)
    port = free_port()
    env = _env_without_secrets(tmp_path / "cfg")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    env.pop("DISTLAUNCH_STORE_PORT", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    ]
    try:
        assert wait_for(lambda: _port_open(port)), (
            procs[0].stderr.read() if procs[0].poll() is not None else ""
        )
        assert _refused(port, "distlaunch-env-default-token")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env={**env, "RANK": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        outs = [p.communicate(timeout=60) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert all("sum 3.0" in o for o, _ in outs)
    finally:
        for p in procs:
            p.kill()
