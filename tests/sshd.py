"""A real OpenSSH sshd for the SSH tests, on loopback aliases 127.0.0.2 and 127.0.0.3.

Use it by importing the fixture into a test module (this is a helper module, not a
conftest)::

    from sshd import sshd_hosts   # noqa: F401  (session-scoped fixture)

    def test_x(sshd_hosts):
        conn = SSHConnection(Host("node1"), sshd_hosts.options())

The fixture generates host keys and user keys per session (ssh-keygen, in a temporary
directory), starts ``/usr/sbin/sshd -D -e`` on a free port of both addresses, and stops it
at the end of the session. It skips the tests when sshd or ssh-keygen is missing, or when
not running as root (sshd must be able to switch to the logged-in user, and the key is
authorized for root). All of 127.0.0.0/8 is loopback on Linux, so nothing leaves the
machine. Host aliases in the generated ssh_config:

=====================  =================================================
``node1``             127.0.0.2 (sshd)
``node2``             127.0.0.3 (sshd)
``deadnode``          127.0.0.9 (nothing listens: connection refused)
``node2-via-node1``   127.0.0.3 through ``ProxyJump node1``
``node2-via-command`` 127.0.0.3 through ``ProxyCommand ssh -W %h:%p node1``
====================  =================================================

all with ``Port``, ``User root``, ``IdentityFile`` (the authorized key) and
``UserKnownHostsFile`` (both host keys).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ports import free_ports

SSHD = "/usr/sbin/sshd"
ADDRESSES = ("127.0.0.2", "127.0.0.3")
DEAD_ADDRESS = "127.0.0.9"


@dataclass
class SSHDServer:
    """What the ``sshd_hosts`` fixture yields."""

    addresses: tuple[str, str]  # ("127.0.0.2", "127.0.0.3"), both served by sshd
    aliases: tuple[str, str]  # ("node1", "node2") in ssh_config
    port: int
    user: str  # "root"
    key_file: str  # private key authorized by sshd
    other_key_file: str  # a valid private key sshd does NOT accept
    known_hosts: str  # both host keys, as "[127.0.0.x]:port ssh-ed25519 ..."
    ssh_config: str  # OpenSSH client config with the aliases above
    host_key_pub: str  # the host public key line ("ssh-ed25519 AAAA...")
    dir: Path  # the temporary directory holding all of it
    log: Path  # sshd's log (stderr)
    process: subprocess.Popen = field(repr=False, default=None)

    def options(self, **overrides):
        """``SSHOptions`` that use this server's ssh_config (imported lazily: paramiko)."""
        from distlaunch.remote.ssh import SSHOptions

        overrides.setdefault("config_file", self.ssh_config)
        overrides.setdefault("connect_timeout", 5.0)
        return SSHOptions(**overrides)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "distlaunch-test", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _wait_listening(port: int, proc: subprocess.Popen, log: Path, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    pending = list(ADDRESSES)
    while pending:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with socket.create_connection((pending[0], port), timeout=1.0) as s:
                s.settimeout(2.0)
                if s.recv(4).startswith(b"SSH-"):  # a real banner, not just a SYN-ACK
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd not listening on {pending} after {timeout} s:\n{log.read_text()}")
        time.sleep(0.05)


def start_sshd(base: Path, extra: tuple[str, ...] = ()) -> SSHDServer:
    """Generate keys and configs under ``base`` and start sshd; see the module docstring.
    ``extra``: more sshd_config lines (e.g. a ForceCommand that records commands)."""
    base.mkdir(parents=True, exist_ok=True)
    host_key, user_key, other_key = base / "ssh_host_ed25519_key", base / "id_user", base / "id_other"
    for key in (host_key, user_key, other_key):
        _keygen(key)
    authorized = base / "authorized_keys"
    shutil.copy(f"{user_key}.pub", authorized)
    port = free_ports(1, ADDRESSES)[0]
    log = base / "sshd.log"
    sshd_config = base / "sshd_config"
    sshd_config.write_text(
        "\n".join(
            [
                *(f"ListenAddress {a}:{port}" for a in ADDRESSES),
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {authorized}",
                f"PidFile {base / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "MaxStartups 100",
                "MaxSessions 100",
                "AllowTcpForwarding yes",  # ProxyJump tests
                "PrintMotd no",
                "LogLevel INFO",
                *extra,
                "",
            ]
        )
    )
    host_pub = Path(f"{host_key}.pub").read_text().split()
    host_key_line = f"{host_pub[0]} {host_pub[1]}"
    known_hosts = base / "known_hosts"
    known_hosts.write_text("".join(f"[{a}]:{port} {host_key_line}\n" for a in ADDRESSES))
    ssh_config = base / "ssh_config"
    ssh_config.write_text(f"""\
Host node1
    HostName {ADDRESSES[0]}
Host node2
    HostName {ADDRESSES[1]}
Host deadnode
    HostName {DEAD_ADDRESS}
Host node2-via-node1
    HostName {ADDRESSES[1]}
    ProxyJump node1
Host node2-via-command
    HostName {ADDRESSES[1]}
    ProxyCommand ssh -F {base / "ssh_config"} -W %h:%p node1
Host *
    Port {port}
    BatchMode yes
    User root
    IdentityFile {user_key}
    IdentitiesOnly yes
    UserKnownHostsFile {known_hosts}
    StrictHostKeyChecking yes
""")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(sshd_config)],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
        )
    try:
        _wait_listening(port, proc, log)
    except BaseException:
        _stop(proc)
        raise
    return SSHDServer(
        addresses=ADDRESSES,
        aliases=("node1", "node2"),
        port=port,
        user="root",
        key_file=str(user_key),
        other_key_file=str(other_key),
        known_hosts=str(known_hosts),
        ssh_config=str(ssh_config),
        host_key_pub=host_key_line,
        dir=base,
        log=log,
        process=proc,
    )


def _stop(proc: subprocess.Popen) -> None:
    """Stop the listening sshd (its connection children exit when their client goes)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _skip_reason() -> str | None:
    if not os.path.exists(SSHD):
        return f"{SSHD} not installed (apt-get install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not installed (apt-get install openssh-client)"
    if os.geteuid() != 0:
        return "the sshd tests run sshd and log in as root; run them as root"
    return None


# Each test module that imports the fixture gets its own (session-scoped) instance of it;
# they share one server, stopped when the last of them is finalized.
_shared: dict = {"server": None, "users": 0}


@pytest.fixture(scope="session")
def sshd_hosts(tmp_path_factory):
    """A running sshd on 127.0.0.2 and 127.0.0.3 for the whole session (SSHDServer)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if _shared["server"] is None:
        _shared["server"] = start_sshd(tmp_path_factory.mktemp("sshd"))
    _shared["users"] += 1
    try:
        yield _shared["server"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            _stop(_shared["server"].process)
            _shared["server"] = None
