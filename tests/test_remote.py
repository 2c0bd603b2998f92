"""SSH plumbing (distlaunch.remote) against a real OpenSSH sshd on 127.0.0.2/127.0.0.3.

See tests/sshd.py for the server and its ssh_config aliases (node1, node2, deadnode,
node2-via-node1). The environment-shipping rules are pure and need no server.
"""

import json
import os
import pathlib
import random
import selectors
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from conftest import dl
from sshd import sshd_hosts  # noqa: F401  (session-scoped fixture)

import distlaunch
from distlaunch.errors import ConfigError
from distlaunch.hosts import Host
from distlaunch.remote import RemoteError
from distlaunch.remote.command import HOST_SPECIFIC, checked_command, quote, remote_command, shipped_env
from distlaunch.remote.preflight import HostReport, preflight, start_checked
from distlaunch.remote.ssh import SSHConnection, connect_all

ROOT = pathlib.Path(__file__).resolve().parent.parent
PY = sys.executable  # same machine, so the head's interpreter exists "remotely" too


@pytest.fixture(scope="module")
def node1(sshd_hosts):
    conn = SSHConnection(Host("node1"), sshd_hosts.options())
    yield conn
    conn.close()


def error_of(fn, *args, **kw) -> RemoteError:
    with pytest.raises(RemoteError) as err:
        fn(*args, **kw)
    return err.value


# --- connecting ----------------------------------------------------------------------------


def test_connect_through_config_alias_and_run(node1, sshd_hosts):
    assert (node1.hostname, node1.port, node1.user) == ("127.0.0.2", sshd_hosts.port, "root")
    status, out, err = node1.run("echo out; echo err >&2; echo $SSH_CONNECTION; exit 3")
    assert status == 3 and err == "err\n"
    lines = out.splitlines()
    assert lines[0] == "out" and lines[1].split()[2:] == ["127.0.0.2", str(sshd_hosts.port)]


def test_addresses(node1, sshd_hosts):
    assert node1.peer_address == "127.0.0.2" and node1.local_address.startswith("127.")
    with SSHConnection(Host("node2-via-node1"), sshd_hosts.options()) as conn:
        assert conn.peer_address == "127.0.0.3" and conn.local_address is None


def test_second_address_and_explicit_user(sshd_hosts):
    with SSHConnection(Host("node2", user="root"), sshd_hosts.options()) as conn:
        status, out, _ = conn.run("echo $SSH_CONNECTION; id -un")
    assert status == 0 and out.split()[2] == "127.0.0.3" and out.split()[-1] == "root"


def test_connect_by_address_with_options_only(sshd_hosts):
    """No config file entry for the address: port, key and known_hosts from SSHOptions."""
    opts = sshd_hosts.options(
        config_file=os.devnull,
        port=sshd_hosts.port,
        user="root",
        key_file=sshd_hosts.key_file,
        known_hosts_file=sshd_hosts.known_hosts,
    )
    with SSHConnection(Host("127.0.0.3"), opts) as conn:
        assert conn.run("echo ok")[:2] == (0, "ok\n")


def test_proxy_jump(sshd_hosts):
    with SSHConnection(Host("node2-via-node1"), sshd_hosts.options()) as conn:
        status, out, _ = conn.run("echo $SSH_CONNECTION")
        assert status == 0 and out.split()[2] == "127.0.0.3"
        assert conn._jump is not None and conn._jump.hostname == "127.0.0.2"


def test_proxy_jump_through_a_dead_host(sshd_hosts, tmp_path):
    config = tmp_path / "config"
    config.write_text(
        "Host via-dead\n    HostName 127.0.0.2\n    ProxyJump deadnode\n"
        + pathlib.Path(sshd_hosts.ssh_config).read_text()
    )
    err = error_of(SSHConnection, Host("via-dead"), sshd_hosts.options(config_file=str(config)))
    assert str(err).startswith("via-dead: via jump host: deadnode (root@127.0.0.9:")
    assert "connection refused" in str(err) and err.host == "via-dead"


def test_proxy_command(sshd_hosts):
    if shutil.which("ssh") is None:
        pytest.skip("OpenSSH client (ssh) not installed")
    with SSHConnection(Host("node2-via-command"), sshd_hosts.options()) as conn:
        status, out, _ = conn.run("echo $SSH_CONNECTION")
    assert status == 0 and out.split()[2] == "127.0.0.3"


def test_config_strict_host_key_checking_accept_new(sshd_hosts, tmp_path):
    known = tmp_path / "kh"
    config = tmp_path / "config"
    config.write_text(f"""\
Host fresh
    HostName 127.0.0.2
    Port {sshd_hosts.port}
    User root
    IdentityFile {sshd_hosts.key_file}
    UserKnownHostsFile {known} {tmp_path / "unused"}
    StrictHostKeyChecking accept-new
""")
    with SSHConnection(Host("fresh"), sshd_hosts.options(config_file=str(config))) as conn:
        assert conn.run("true")[0] == 0
    assert known.read_text().startswith(f"[127.0.0.2]:{sshd_hosts.port} ")


def test_unreadable_config_file(sshd_hosts, tmp_path):
    err = error_of(SSHConnection, Host("node1"), sshd_hosts.options(config_file=str(tmp_path / "missing")))
    assert "cannot read ssh config" in str(err)


def test_unknown_host_key_refused_then_accepted_and_saved(sshd_hosts, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    err = error_of(SSHConnection, Host("node1"), sshd_hosts.options(known_hosts_file=str(known)))
    msg = str(err)
    assert "host key not known" in msg and "--ssh-accept-new-host-keys" in msg
    assert f"[127.0.0.2]:{sshd_hosts.port}" in msg and "\n" not in msg and not err.transient

    opts = sshd_hosts.options(known_hosts_file=str(known), accept_new_host_keys=True)
    with SSHConnection(Host("node1"), opts) as conn:
        assert conn.run("true")[0] == 0
    assert known.read_text() == f"[127.0.0.2]:{sshd_hosts.port} {sshd_hosts.host_key_pub}\n"
    # saved: now known without accepting new keys
    with SSHConnection(Host("node1"), sshd_hosts.options(known_hosts_file=str(known))):
        pass


def test_missing_known_hosts_file_is_created_on_accept(sshd_hosts, tmp_path):
    known = tmp_path / "sub" / "known_hosts"
    err = error_of(SSHConnection, Host("node2"), sshd_hosts.options(known_hosts_file=str(known)))
    assert "host key not known" in str(err) and not known.exists()
    with SSHConnection(
        Host("node2"), sshd_hosts.options(known_hosts_file=str(known), accept_new_host_keys=True)
    ):
        pass
    assert known.read_text().startswith(f"[127.0.0.3]:{sshd_hosts.port} ssh-ed25519 ")


def test_changed_host_key_refused_even_when_accepting_new(sshd_hosts, tmp_path):
    known = tmp_path / "known_hosts"
    other = pathlib.Path(sshd_hosts.other_key_file + ".pub").read_text().split()
    known.write_text(f"[127.0.0.2]:{sshd_hosts.port} {other[0]} {other[1]}\n")
    err = error_of(
        SSHConnection,
        Host("node1"),
        sshd_hosts.options(known_hosts_file=str(known), accept_new_host_keys=True),
    )
    assert "host key CHANGED" in str(err) and "ssh-keygen -R" in str(err)


def test_wrong_key_is_an_auth_error(sshd_hosts):
    err = error_of(SSHConnection, Host("node1"), sshd_hosts.options(key_file=sshd_hosts.other_key_file))
    assert "authentication failed" in str(err) and sshd_hosts.other_key_file in str(err)
    assert err.host == "node1" and not err.transient


def test_missing_key_file(sshd_hosts, tmp_path):
    err = error_of(SSHConnection, Host("node1"), sshd_hosts.options(key_file=str(tmp_path / "nokey")))
    assert "--ssh-key" in str(err) and "no such file" in str(err)


def test_nothing_listening_is_a_clear_connection_error(sshd_hosts):
    start = time.monotonic()
    err = error_of(SSHConnection, Host("deadnode"), sshd_hosts.options())
    msg = str(err)
    assert msg.startswith(f"deadnode (root@127.0.0.9:{sshd_hosts.port}): connection refused")
    assert "\n" not in msg and not err.transient and time.monotonic() - start < 5


def test_port_override_wins_over_config(sshd_hosts):
    err = error_of(SSHConnection, Host("node1"), sshd_hosts.options(port=1))
    assert "127.0.0.2:1)" in str(err) and "connection refused" in str(err)


# --- running commands ---------------------------------------------------------------------


def test_stdin_data_reaches_the_remote_command(node1):
    secret = b"s3cr3t token\nsecond line"
    status, out, _ = node1.run(f"{PY} -c 'import sys; print(sys.stdin.read())'", stdin_data=secret)
    assert status == 0 and out == secret.decode() + "\n"
    # exec + read: the command sees EOF after the data
    proc = node1.exec("wc -c", stdin_data=secret)
    assert proc.wait(10) == 0
    assert proc.read_stdout().strip() == str(len(secret)).encode()


def test_keep_stdin_open_until_closed(node1):
    proc = node1.exec("head -n 1; cat >/dev/null; echo eof", stdin_data=b"line\n", keep_stdin_open=True)
    time.sleep(0.3)
    assert not proc.exited()
    proc.channel.shutdown_write()
    assert proc.wait(10) == 0


def collect(proc, timeout=10.0):
    """Poll with selectors until exit status and EOF: (stdout, stderr, wakeups)."""
    sel = selectors.DefaultSelector()
    sel.register(proc, selectors.EVENT_READ)
    out, err, wakeups = b"", b"", 0
    deadline = time.monotonic() + timeout
    while True:
        out += proc.read_stdout()
        err += proc.read_stderr()
        if proc.exited() and proc.eof():
            break
        assert time.monotonic() < deadline, "no exit status within the timeout"
        if sel.select(deadline - time.monotonic()):
            wakeups += 1
    out += proc.read_stdout()  # data that arrived with the EOF
    err += proc.read_stderr()
    sel.close()
    return out, err, wakeups


def test_fileno_is_selectable_for_output_and_exit(node1):
    proc = node1.exec("echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three; exit 7")
    assert proc.exit_status() is None and not proc.exited()
    assert proc.read_stdout() in (b"", b"one\n")  # non-blocking
    out, err, wakeups = collect(proc)
    assert out.endswith(b"three\n") and err == b"two\n" and wakeups >= 2
    assert proc.exit_status() == 7
    proc.close()


def test_exit_status_wakes_select_while_output_is_held_open(node1):
    """A background process keeps stdout open (so no EOF): the status must still wake us
    (well before the output closes; the margin is for a loaded machine)."""
    proc = node1.exec("sleep 30 & echo started; exit 5")
    sel = selectors.DefaultSelector()
    sel.register(proc, selectors.EVENT_READ)
    start = time.monotonic()
    out = b""
    while not proc.exited():
        assert time.monotonic() - start < 30, "no exit status"
        sel.select(20)  # (a selector the status does not wake sleeps all of it)
        out += proc.read_stdout()
    assert time.monotonic() - start < 10, "exit status did not wake the selector"
    assert proc.exit_status() == 5 and out == b"started\n"
    sel.close()
    proc.close()


def test_eof_gives_up_on_output_held_open(node1):
    proc = node1.exec("sleep 30 & echo hi; exit 4")  # (the margin is for load)
    start = time.monotonic()
    out, _, _ = collect(proc, timeout=20)
    assert out == b"hi\n" and proc.exit_status() == 4 and time.monotonic() - start < 20
    proc.close()


def test_run_returns_when_output_is_held_open(node1):
    # the shell exits at once; its background child holds the output for 20 s: a run
    # that waited for the output to close would take that long (the margin is for load)
    start = time.monotonic()
    assert node1.run("sleep 20 & echo hi; exit 2", timeout=30)[:2] == (2, "hi\n")
    assert time.monotonic() - start < 10


def test_run_timeout(node1):
    err = error_of(node1.run, "sleep 5", timeout=0.5)
    assert "did not finish within 0.5 s" in str(err)


def test_killed_by_signal_has_no_exit_status(node1):
    assert node1.run("kill -9 $$")[0] == -1


def test_wait_timeout(node1):
    proc = node1.exec("sleep 3")
    assert "still running after 0.2 s" in str(error_of(proc.wait, 0.2))
    proc.close()


def test_many_channels_on_one_connection(node1):
    procs = [node1.exec(f"echo {i}") for i in range(20)]
    assert [p.wait(10) for p in procs] == [0] * 20
    assert [collect(p)[0] for p in procs] == [f"{i}\n".encode() for i in range(20)]


# --- connect_all ----------------------------------------------------------------------------


def test_connect_all(sshd_hosts):
    conns = connect_all([Host("node1"), Host("node2")], sshd_hosts.options())
    try:
        assert [c.hostname for c in conns] == ["127.0.0.2", "127.0.0.3"]
        assert [c.run("echo $SSH_CONNECTION")[1].split()[2] for c in conns] == ["127.0.0.2", "127.0.0.3"]
    finally:
        for c in conns:
            c.close()


def test_connect_all_burst_bounded(sshd_hosts):
    """Many connections at once (one sshd, as when one node is listed per slot)."""
    hosts = [Host("node1"), Host("node2")] * 15
    conns = connect_all(hosts, sshd_hosts.options(), max_concurrent=8)
    try:
        assert len(conns) == 30 and all(c.transport.is_active() for c in conns)
    finally:
        for c in conns:
            c.close()


def test_connect_all_failing_mix_lists_every_bad_host(sshd_hosts, tmp_path):
    known = tmp_path / "kh"
    known.write_text(f"[127.0.0.2]:{sshd_hosts.port} {sshd_hosts.host_key_pub}\n")
    hosts = [Host("node1"), Host("deadnode"), Host("node2")]  # node2's key is not known
    err = error_of(connect_all, hosts, sshd_hosts.options(known_hosts_file=str(known)))
    lines = str(err).splitlines()
    assert lines[0] == "cannot connect to 2 of 3 hosts:"
    assert lines[1].strip().startswith("deadnode (") and "connection refused" in lines[1]
    assert lines[2].strip().startswith("node2 (") and "host key not known" in lines[2]
    assert len(lines) == 3


class Dropper:
    """A TCP forwarder on 127.0.0.4 to the real sshd that drops its first ``drops``
    connections (alternately closed and reset), as sshd's MaxStartups does to bursts."""

    def __init__(self, target, drops):
        self.target, self.drops, self.count = target, drops, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.4", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            if self.count <= self.drops:
                if self.count % 2:  # RST instead of FIN
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def options(self, server, tmp_path, **kw):
        known = tmp_path / "known_dropper"
        known.write_text(f"[127.0.0.4]:{self.port} {server.host_key_pub}\n")
        kw.setdefault("key_file", server.key_file)
        return server.options(
            config_file=os.devnull, port=self.port, user="root", known_hosts_file=str(known), **kw
        )

    def close(self):
        self.sock.close()


@pytest.fixture
def dropper(sshd_hosts):
    made = []

    def make(drops):
        made.append(Dropper(("127.0.0.2", sshd_hosts.port), drops))
        return made[-1]

    yield make
    for d in made:
        d.close()


def test_connect_all_retries_dropped_connections(sshd_hosts, dropper, tmp_path, capfd):
    drop = dropper(2)
    [conn] = connect_all([Host("127.0.0.4")], drop.options(sshd_hosts, tmp_path))
    assert conn.run("echo ok")[:2] == (0, "ok\n") and drop.count == 3
    conn.close()
    assert "Traceback" not in capfd.readouterr().err  # paramiko's handshake logging is muted


def test_connect_all_gives_up_after_attempts(sshd_hosts, dropper, tmp_path):
    drop = dropper(10)
    err = error_of(connect_all, [Host("127.0.0.4")], drop.options(sshd_hosts, tmp_path), attempts=2)
    assert drop.count == 2
    assert "cannot connect to 1 of 1 hosts:" in str(err) and "connection dropped" in str(err)


def test_connect_all_does_not_retry_auth_errors(sshd_hosts, dropper, tmp_path):
    drop = dropper(0)
    opts = drop.options(sshd_hosts, tmp_path, key_file=sshd_hosts.other_key_file)
    assert "authentication failed" in str(error_of(connect_all, [Host("127.0.0.4")], opts))
    assert drop.count == 1


def include_config(sshd_hosts, tmp_path):
    """An OpenSSH config that reaches 127.0.0.2 only through its Include."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {sshd_hosts.ssh_config}\nHost viainclude\n    HostName 127.0.0.2\n")
    return cfg


def test_config_read_as_openssh_does_include(sshd_hosts, tmp_path):
    """paramiko ignores Include (its issue 1609); ssh -G reads it."""
    with SSHConnection(
        Host("viainclude"), sshd_hosts.options(config_file=str(include_config(sshd_hosts, tmp_path)))
    ) as c:
        assert (c.hostname, c.port) == ("127.0.0.2", sshd_hosts.port)
        assert c.run("echo ok")[1] == "ok\n"


def test_without_ssh_client_paramiko_reads_config_and_warns(sshd_hosts, tmp_path):
    cfg = include_config(sshd_hosts, tmp_path)
    env = dict(os.environ, PATH=str(tmp_path / "no-bin"))  # no ssh client to ask
    res = dl(
        "run",
        "--ssh-config",
        cfg,
        "-H",
        "viainclude:1",
        "--ssh-port",
        "1",
        ROOT / "tests" / "workers" / "actor.py",
        env=env,
    )
    assert res.returncode == 2
    assert res.stderr.count("uses include, which paramiko does not read") == 1


def test_without_ssh_client_match_exec_is_refused_in_one_line(sshd_hosts, tmp_path):
    # paramiko runs `Match exec` through invoke, which distlaunch hides while paramiko is
    # imported (start-up); without ssh -G to run it, the config is refused with the fix.
    marker = tmp_path / "ran"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f'Match exec "touch {marker}"\n    Port 1\nHost *\n    HostName 127.0.0.2\n')
    env = dict(os.environ, PATH=str(tmp_path / "no-bin"))  # no ssh client to ask
    res = dl("run", "--ssh-config", cfg, "-H", "anyhost:1", ROOT / "tests" / "workers" / "actor.py", env=env)
    assert res.returncode == 2, res.stderr
    assert "uses Match exec; install the OpenSSH client" in res.stderr
    assert not marker.exists()


def test_invoke_stays_importable_after_paramiko():
    code = "import distlaunch.remote.ssh, invoke, paramiko.config; print(invoke.__name__)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "invoke\n", res.stderr


# --- preflight --------------------------------------------------------------------------------


def test_preflight_ok(sshd_hosts, node1):
    with SSHConnection(Host("node2"), sshd_hosts.options()) as node2:
        reports = preflight([node1, node2], PY, str(ROOT), distlaunch.__version__)
    assert reports == [HostReport(Host("node1"), True, None), HostReport(Host("node2"), True, None)]


def test_preflight_interpreter_on_remote_path(node1):
    if shutil.which("sh") is None:
        pytest.skip("no sh")
    # 'sh' is found on PATH but cannot import distlaunch: that is the reported problem
    [report] = preflight([node1], "sh", str(ROOT), distlaunch.__version__)
    assert not report.ok and "not importable" in report.problem


def test_preflight_missing_interpreter(node1, tmp_path):
    [by_path] = preflight([node1], str(tmp_path / "bin" / "python"), str(ROOT), "0.1.0")
    assert by_path.problem == f"python {tmp_path / 'bin' / 'python'} not found or not executable"
    [by_name] = preflight([node1], "no-such-python3.99", str(ROOT), "0.1.0")
    assert by_name.problem == "python no-such-python3.99 not found or not executable"
    [a_dir] = preflight([node1], str(tmp_path), str(ROOT), "0.1.0")
    assert not a_dir.ok and "not found or not executable" in a_dir.problem


def test_preflight_missing_directory(node1, tmp_path):
    missing = tmp_path / "no such dir"
    [report] = preflight([node1], PY, str(missing), distlaunch.__version__)
    assert report == HostReport(Host("node1"), False, f"directory {missing} does not exist")


def test_preflight_version_mismatch(node1):
    [report] = preflight([node1], PY, str(ROOT), "9.9.9")
    assert report.problem == f"distlaunch 9.9.9 expected, found {distlaunch.__version__} (python {PY})"


def test_preflight_distlaunch_not_importable(node1, tmp_path):
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip(f"{python} not present")
    # tmp_path as cwd: the checkout is not on that interpreter's sys.path
    [report] = preflight([node1], python, str(tmp_path), distlaunch.__version__)
    if report.ok:
        pytest.skip(f"distlaunch is installed for {python}")
    assert report.problem.startswith(f"distlaunch not importable by python {python} in ")
    assert "ModuleNotFoundError" in report.problem


def test_preflight_distlaunch_not_importable_isolated_interpreter(node1, tmp_path):
    """Deterministic variant: -S drops site-packages (the install), -I the cwd."""
    python = tmp_path / "bare-python"
    python.write_text(f'#!/bin/sh\nexec {PY} -I -S "$@"\n')
    python.chmod(0o755)
    [report] = preflight([node1], str(python), str(ROOT), distlaunch.__version__)
    assert report.problem == (
        f"distlaunch not importable by python {python} in {ROOT}: "
        f"ModuleNotFoundError: No module named 'distlaunch'"
    )


def test_preflight_old_distlaunch_found(node1, tmp_path):
    (tmp_path / "distlaunch").mkdir()
    (tmp_path / "distlaunch" / "__init__.py").write_text("__version__ = '0.0.9'\n")
    [report] = preflight([node1], PY, str(tmp_path), "0.1.0")
    assert report.problem == f"distlaunch 0.1.0 expected, found 0.0.9 (python {PY})"


def test_preflight_relative_interpreter_is_relative_to_cwd(node1, tmp_path):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    wrapper = tmp_path / "venv" / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {PY} "$@"\n')
    wrapper.chmod(0o755)
    [report] = preflight([node1], "venv/bin/python", str(tmp_path), distlaunch.__version__)
    assert report.ok, report.problem  # the checkout is importable via the install


def test_preflight_reports_lost_connection(sshd_hosts):
    conn = SSHConnection(Host("node2"), sshd_hosts.options())
    conn.close()
    [report] = preflight([conn], PY, str(ROOT), distlaunch.__version__)
    assert not report.ok and report.problem.startswith("node2: cannot run a command")


def test_start_checked_reports_each_host(sshd_hosts, node1, tmp_path):
    """One exec per host: an agent that says hello is kept (stdin open, waiting for its
    spec); a host check's mark and an agent that dies before its hello are explained."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {PY} -I -S "$@"\n')
    bare.chmod(0o755)
    missing = tmp_path / "no such dir"
    cases = [(PY, str(ROOT)), (PY, str(missing)), (str(bare), str(ROOT))]
    results = []
    for python, cwd in cases:
        cmd = checked_command(python, cwd, ["-m", "distlaunch", "agent"], {})
        results.append(start_checked({0: node1}, cmd, python, cwd, distlaunch.__version__, timeout=30))
    (ok, [good]), (none1, [nodir]), (none2, [dead]) = results
    assert good == HostReport(Host("node1"), True, None) and list(ok) == [0]
    assert nodir.problem == f"directory {missing} does not exist" and not none1
    assert dead.problem == (
        f"distlaunch not importable by python {bare} in {ROOT}: "
        "ModuleNotFoundError: No module named 'distlaunch'"
    )
    assert not none2
    agent = ok[0]
    agent.write_stdin(b"")  # end of stdin before a spec: the agent ends, starting nothing
    assert agent.wait(30) == 0


def test_agent_broken_after_hello_says_one_line(tmp_path):
    # the hello comes before the agent's own imports; a host whose install lost a module
    # still ends at once with one line naming it, without reading a spec
    shutil.copytree(ROOT / "distlaunch", tmp_path / "distlaunch")
    (tmp_path / "distlaunch" / "rounds.py").unlink()
    p = subprocess.run(
        [PY, "-m", "distlaunch", "agent"],
        input="",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    assert p.stdout == f"DISTLAUNCH-AGENT {distlaunch.__version__}\n"
    assert p.returncode == 1
    assert p.stderr.splitlines() == [
        "distlaunch agent: cannot start here: No module named 'distlaunch.rounds' (reinstall distlaunch)"
    ]


# --- remote command line ---------------------------------------------------------------------

HOSTILE = [
    "plain",
    "with space",
    "it's",
    'say "hi"',
    "$HOME",
    "`id`",
    "$(id)",
    "a;b",
    "a&&b",
    "a|b",
    "line1\nline2",
    "tab\there",
    "*",
    "~",
    "back\\slash",
    "",
    "-n",
    "ünïcödé",
    "#x",
    "x=y",
]


def test_remote_command_round_trips_hostile_values(node1, tmp_path):
    cwd = tmp_path / "d i'r $x; `y`"
    cwd.mkdir()
    env = {f"DL_TEST_{i}": v for i, v in enumerate(HOSTILE)}
    probe = (
        "import json, os, sys; print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(),"
        " 'env': {k: v for k, v in os.environ.items() if k.startswith('DL_TEST_')}}))"
    )
    command = remote_command(PY, str(cwd), ["-c", probe, *HOSTILE], env)
    status, out, err = node1.run(command)
    assert status == 0, err
    got = json.loads(out)
    assert got == {"argv": HOSTILE, "cwd": str(cwd), "env": env}


def test_remote_command_exit_status_and_missing_dir(node1, tmp_path):
    assert node1.run(remote_command(PY, "/", ["-c", "raise SystemExit(9)"], {}))[0] == 9
    status, _, err = node1.run(remote_command(PY, str(tmp_path / "gone"), ["-c", "1"], {}))
    assert status != 0 and "gone" in err


def test_remote_command_shape():
    assert (
        remote_command("/usr/bin/python3", "/w d", ["-m", "distlaunch", "agent"], {"A": "1", "B": "x y"})
        == "cd '/w d' && exec env A=1 'B=x y' /usr/bin/python3 -m distlaunch agent"
    )
    assert remote_command("python", "-dir", [], {}).startswith("cd ./-dir && ")


@pytest.mark.parametrize(
    "python, cwd, env",
    [
        ("", "/", {}),
        ("a=b/python", "/", {}),
        ("-python", "/", {}),
        ("python", "", {}),
        ("python", "/", {"BAD-NAME": "1"}),
        ("python", "/", {"1X": "1"}),
    ],
)
def test_remote_command_errors(python, cwd, env):
    with pytest.raises(ConfigError):
        remote_command(python, cwd, [], env)


# --- shipped_env (pure) -----------------------------------------------------------------------

ENV = {
    "FOO": "1",
    "BAR": "two words",
    "PYTHONPATH": "/p",
    "SSH_AUTH_SOCK": "/tmp/a",
    "DISPLAY": ":0",
    "HOME": "/root",
    "PWD": "/x",
    "TERM": "xterm",
    "SHLVL": "2",
    "_": "/usr/bin/distlaunch",
    "HOSTNAME": "head",
    "RANK": "3",
    "MASTER_ADDR": "h",
    "DISTLAUNCH_STORE_TOKEN": "secret",
    "SLURM_PROCID": "0",
    "CUDA_VISIBLE_DEVICES": "0",
    "BASH_FUNC_f%%": "() { :; }",
    "PATH": "/usr/bin",
}


def test_shipped_env_named_only_plus_pythonpath():
    assert shipped_env(ENV, ["FOO", "NEW=a=b", "EMPTY="], env_all=False) == {
        "PYTHONPATH": "/p",
        "FOO": "1",
        "NEW": "a=b",
        "EMPTY": "",
    }
    assert shipped_env({}, [], env_all=False) == {}


def test_shipped_env_all_skips_host_specific_and_launcher_names():
    assert shipped_env(ENV, [], env_all=True) == {
        "FOO": "1",
        "BAR": "two words",
        "PYTHONPATH": "/p",
        "PATH": "/usr/bin",
    }


def test_shipped_env_explicit_name_beats_exclusion():
    got = shipped_env(ENV, ["DISPLAY", "FOO=override"], env_all=True)
    assert got["DISPLAY"] == ":0" and got["FOO"] == "override"


@pytest.mark.parametrize(
    "names, words",
    [
        (["MISSING"], "not set in this environment"),
        (["BAD-NAME=1"], "not a variable name"),
        (["=1"], "not a variable name"),
        (["FOO\n=1"], "not a variable name"),  # (re's $ took a trailing newline)
        (["1FOO=1"], "not a variable name"),
        (["FÖO=1"], "not a variable name"),
        (["DISTLAUNCH_STORE_TOKEN"], "never shipped"),
        (["DISTLAUNCH_STORE_TOKEN=x"], "never shipped"),
    ],
)
def test_shipped_env_errors(names, words):
    with pytest.raises(ConfigError, match=words):
        shipped_env(ENV, names, env_all=False)


def test_remote_command_refuses_a_name_with_a_newline():
    """A variable name is ASCII letters, digits and ``_``, not starting with a digit:
    ``FOO\\n`` (which re's ``$`` matched) and non-ASCII letters are refused."""
    for name in ("FOO\n", "FOO\nBAR", "1A", "É", ""):
        with pytest.raises(ConfigError, match="not a variable name"):
            remote_command("python3", "/tmp", [], {name: "1"})
    line = remote_command("python3", "/tmp", [], {"_a1": "1", "if": "2"})
    assert line.endswith("exec env _a1=1 if=2 python3")


def test_host_specific_documents_the_obvious_ones():
    for name in ("SSH_*", "DISPLAY", "HOSTNAME", "PWD", "OLDPWD", "TERM", "SHLVL", "_", "HOME"):
        assert name in HOST_SPECIFIC


def test_quote_is_shlex_quote():
    """remote.command.quote (the early Slurm start builds its command line without
    importing shlex and re) gives shlex.quote's word for every string: generated from
    safe and unsafe characters, quotes, white space, non-ASCII letters and digits."""
    rnd = random.Random(27)
    alphabet = list("azAZ09_@%+=:,./-") + list(" '\"$;*?[]!~#&|<>()\\\n\t\x00") + ["é", "١", "²", "\u2028"]
    words = ["", "'", "''", "a b", "--x=1", "-"] + [
        "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 10))) for _ in range(20000)
    ]
    assert [quote(w) for w in words] == [shlex.quote(w) for w in words]
