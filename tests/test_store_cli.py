"""`distlaunch store`: a standalone store process that real clients use."""

import os
import re
import signal
import socket
import subprocess

import pytest
from conftest import dl, dl_cmd

from distlaunch.errors import StoreAuthError
from distlaunch.store import StoreClient


def start_store(env):
    p = subprocess.Popen(dl_cmd("store", "--port", "0"), stderr=subprocess.PIPE, text=True, env=env)
    port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", p.stderr.readline()).group(1))
    return p, port


def test_standalone_store_with_token_from_env():
    env = dict(os.environ, DISTLAUNCH_STORE_TOKEN="s3cret-token")
    p, port = start_store(env)
    try:
        with StoreClient("127.0.0.1", port, token="s3cret-token", timeout=10) as c:
            c.set("k", b"v")
            assert c.get("k") == b"v"
        with pytest.raises(StoreAuthError):
            StoreClient("127.0.0.1", port, token="wrong", timeout=5).get("k")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
    assert "DISTLAUNCH_STORE_TOKEN=" not in p.stderr.read()  # the given secret is never shown


def test_standalone_store_generates_and_shows_token():
    env = {k: v for k, v in os.environ.items() if k != "DISTLAUNCH_STORE_TOKEN"}
    p, port = start_store(env)
    try:
        token = re.search(r"DISTLAUNCH_STORE_TOKEN=(\w+)", p.stderr.readline()).group(1)
        with StoreClient("127.0.0.1", port, token=token, timeout=10) as c:
            assert c.add("n", 5) == 5
    finally:
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=15) == 0


def test_address_in_use_exits_2_with_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = dl("store", "--port", port, timeout=30)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        f"distlaunch: error: --host 127.0.0.1 --port {port} cannot be bound (Address already in use); "
        f"choose a free --port (0 picks one) and, for --host, an address of this machine"
    ]
