"""SSH connections with paramiko, configured the way OpenSSH's ``ssh`` would be.

Settings come from the OpenSSH client config (``ssh_config(5)``, as ``ssh -G`` reports
it, so ``Include``, ``Match`` and tokens work as with ssh; paramiko's parser when no
``ssh`` client is installed), overridden by :class:`SSHOptions` (the ``--ssh-*`` flags):

===================  ===============================================================
``HostName``         the address to connect to (the host as listed is only a name)
``User``             after ``user@host`` and ``--ssh-user``; else the local user name
``Port``             after ``--ssh-port``; else 22
``IdentityFile``     after ``--ssh-key``; files that do not exist are skipped (as ssh)
``IdentitiesOnly``   ``yes``: do not ask ssh-agent
``UserKnownHostsFile``  after ``SSHOptions.known_hosts_file``; else ~/.ssh/known_hosts.
                     All listed files are read, new keys go to the first
``GlobalKnownHostsFile``  read too (default /etc/ssh/ssh_known_hosts), never written
``StrictHostKeyChecking``  ``accept-new`` or ``no`` act like ``--ssh-accept-new-host-keys``
``ProxyJump``        ``[user@]host[:port][,...]``: tunnelled through the jump host(s)
``ProxyCommand``     run locally, its stdin/stdout is the connection (``%h %p %r`` are
                     the config's values, not the ``--ssh-*`` overrides)
===================  ===============================================================

Host keys are verified against known_hosts as ``ssh`` with ``StrictHostKeyChecking yes``:
an unknown key is refused unless new keys are accepted (then it is appended to the
known_hosts file, like ``accept-new``); a *changed* key is always refused. Entries for a
non-22 port are ``[address]:port``, as OpenSSH writes them. Not supported: ``Match exec``
without an ``ssh`` client (refused), ``HostKeyAlias``, certificates, password and
keyboard-interactive authentication (launches are non-interactive).
"""

from __future__ import annotations

import getpass
import logging
import os
import random
import re
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from ..agent.output import warn_once
from ..hosts import Host
from . import RemoteError, in_threads

# paramiko imports invoke (~35 ms, a tenth of a 2-host head launch) only so that its own
# ssh_config parser can run `Match exec` commands; our settings come from `ssh -G`, which
# runs them itself. invoke is hidden only while paramiko is first imported and stays
# importable for everyone else (paramiko's parser, used when no ssh client is installed,
# then refuses `Match exec`: see _lookup).
_hide_invoke = "invoke" not in sys.modules and "paramiko" not in sys.modules
if _hide_invoke:
    cast(dict[str, Any], sys.modules)["invoke"] = None  # `import invoke` raises ImportError
try:
    import paramiko
finally:
    if _hide_invoke:
        del sys.modules["invoke"]

__all__ = ["SSHOptions", "SSHConnection", "RemoteProcess", "connect_all"]

DEFAULT_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
DEFAULT_GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
EOF_GRACE = 2.0  # seconds output may trail the exit status before eof() gives up on it
KEEPALIVE_INTERVAL = 15.0  # seconds; notices a dead peer on an otherwise idle connection

# paramiko logs failed handshakes with tracebacks at ERROR; with no handler configured,
# Python's last-resort handler would print them. Only the CLI talks to the user: our
# RemoteError carries the message.
if not logging.getLogger("paramiko").handlers:
    logging.getLogger("paramiko").addHandler(logging.NullHandler())

# Appends to known_hosts from concurrent connects (connect_all) must not interleave.
_known_hosts_lock = threading.Lock()


@dataclass(frozen=True)
class SSHOptions:
    """Connection settings shared by all hosts (the ``--ssh-*`` flags).

    ``None`` means "as the OpenSSH config says" (see the module docstring).
    ``config_file`` defaults to ~/.ssh/config when it exists. ``connect_timeout`` (seconds)
    bounds each of: TCP connect, SSH banner and key exchange, authentication, opening a
    channel.
    """

    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    accept_new_host_keys: bool = False
    config_file: str | None = None
    known_hosts_file: str | None = None
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class _Settings:
    """Where and how to connect, after merging OpenSSH config and SSHOptions."""

    label: str  # the host as the user listed it, for messages
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    allow_agent: bool
    known_hosts: tuple[str, ...]  # first one is written to
    global_known_hosts: tuple[str, ...]
    accept_new: bool
    proxy_jump: tuple[str, ...]
    proxy_command: str | None


def _lookup(name: str, path: str | None) -> dict[str, Any]:
    """The OpenSSH client settings for host ``name`` (lowercase keys, ``identityfile`` a
    list), from config file ``path`` (None: ~/.ssh/config and the system-wide one).

    As OpenSSH reads them: ``ssh -G`` (Include, Match, tokens, /etc/ssh/ssh_config) when
    an ``ssh`` client is installed; else paramiko's parser, which ignores ``Include``
    and most of ``Match`` (paramiko issue 1609): then a warning, once, if the file uses
    them. Blocks (one short ``ssh -G`` process). Raises RemoteError when the file
    cannot be read."""
    explicit = path is not None
    path = os.path.expanduser(path or DEFAULT_CONFIG)
    ssh = shutil.which("ssh")
    if ssh is not None:
        cmd = [ssh, "-G", *(["-F", path] if explicit else []), "--", name]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RemoteError(f"{name}: cannot read the ssh config with ssh -G: {e}", host=name) from e
        if res.returncode != 0:
            why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
            raise RemoteError(f"cannot read ssh config {path}: {why}", host=name)
        return _parse_ssh_g(res.stdout, name)
    if not explicit and not os.path.exists(path):
        return dict(paramiko.SSHConfig().lookup(name))
    try:
        config = paramiko.SSHConfig.from_path(path)
        with open(path, encoding="utf-8", errors="replace") as f:
            unread = {w.split()[0].lower() for w in f if w.split()} & {"include", "match"}
        settings = dict(config.lookup(name))
    except (OSError, ValueError, paramiko.SSHException) as e:
        raise RemoteError(f"cannot read ssh config {path}: {e}") from e
    except ImportError:  # `Match exec`, which needs invoke: see the import of paramiko above
        raise RemoteError(
            f"cannot read ssh config {path}: it uses Match exec; install the OpenSSH client "
            f"(ssh) so distlaunch can ask ssh -G"
        ) from None
    if unread:
        warn_once(
            "ssh-config",
            f"{path} uses {' and '.join(sorted(unread))}, which paramiko does not read as OpenSSH "
            f"does; install the OpenSSH client (ssh) so distlaunch can ask ssh -G",
        )
    return settings


def _parse_ssh_g(text: str, name: str) -> dict[str, Any]:
    """``ssh -G`` output ("key value" lines) as paramiko's lookup gives it, with the
    ProxyCommand tokens (%h %p %r %n %%) expanded, as ssh does before running it."""
    out: dict[str, Any] = {"identityfile": []}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        key = key.lower()
        if key == "identityfile":
            out["identityfile"].append(value)
        elif key and key not in out:
            out[key] = value
    if "proxycommand" in out:
        tokens = {
            "%": "%",
            "h": out.get("hostname", name),
            "p": out.get("port", "22"),
            "r": out.get("user", ""),
            "n": name,
        }
        out["proxycommand"] = re.sub(
            r"%(.)", lambda m: tokens.get(m.group(1), m.group(0)), out["proxycommand"]
        )
    return out


def _split_paths(value: str | None) -> list[str]:
    return [os.path.expanduser(p) for p in (value or "").split()]


def _resolve(
    host: Host, opts: SSHOptions, cfg: dict[str, Any], via: tuple[str, ...] | None = None
) -> _Settings:
    label = str(host)
    try:
        port = opts.port or host.port or int(cfg.get("port", 22))
    except ValueError as e:
        raise RemoteError(f"{label}: bad Port in ssh config ({cfg.get('port')!r})", host=label) from e
    if opts.key_file:
        key_file = os.path.expanduser(opts.key_file)
        if not os.path.isfile(key_file):
            raise RemoteError(
                f"--ssh-key {opts.key_file}: no such file; give the path of a private key", host=label
            )
        key_files = (key_file,)
    else:  # OpenSSH silently skips IdentityFile entries that do not exist
        key_files = tuple(
            p for p in (os.path.expanduser(k) for k in cfg.get("identityfile", [])) if os.path.isfile(p)
        )
    known = (
        _split_paths(opts.known_hosts_file)
        or _split_paths(cfg.get("userknownhostsfile"))
        or [os.path.expanduser(DEFAULT_KNOWN_HOSTS)]
    )
    global_known = _split_paths(cfg.get("globalknownhostsfile")) or [DEFAULT_GLOBAL_KNOWN_HOSTS]
    strict = cfg.get("stricthostkeychecking", "yes").lower()
    if via is None:
        jump = cfg.get("proxyjump", "none")
        via = () if jump.lower() == "none" else tuple(j.strip() for j in jump.split(","))
    command = cfg.get("proxycommand")
    return _Settings(
        label=label,
        hostname=cfg.get("hostname", host.name),
        port=port,
        user=host.user or opts.user or cfg.get("user") or getpass.getuser(),
        key_files=key_files,
        allow_agent=cfg.get("identitiesonly", "no").lower() != "yes",
        known_hosts=tuple(known),
        global_known_hosts=tuple(global_known),
        accept_new=opts.accept_new_host_keys or strict in ("accept-new", "no", "off"),
        proxy_jump=via,
        proxy_command=None if via or not command or command.lower() == "none" else command,
    )


def _parse_jump(spec: str) -> Host:
    """``[user@]host[:port]`` (one ProxyJump element) -> Host with port."""
    user, _, rest = spec.rpartition("@")
    port = None
    if rest.startswith("["):
        name, _, tail = rest[1:].partition("]")
        if tail.startswith(":"):
            port = tail[1:]
    elif rest.count(":") == 1:
        name, _, port = rest.partition(":")
    else:
        name = rest
    try:
        return Host(name=name, user=user or None, port=int(port) if port else None)
    except ValueError as e:
        raise RemoteError(f"bad ProxyJump element {spec!r}; write [user@]host[:port]") from e


class _UnknownHostKey(paramiko.SSHException):
    pass


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys, or (accept-new) record them in the known_hosts file."""

    def __init__(self, accept_new: bool, save_to: str) -> None:
        self.accept_new = accept_new
        self.save_to = save_to

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise _UnknownHostKey(hostname)
        client.get_host_keys().add(hostname, key.get_name(), key)
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.save_to)), mode=0o700, exist_ok=True)
            with open(self.save_to, "a", encoding="utf-8") as f:
                f.write(line)


def _is_transient(e: BaseException) -> bool:
    """A failure sshd's MaxStartups (or a restart) causes: worth another attempt."""
    if isinstance(e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EOFError)):
        return True
    if isinstance(e, paramiko.SSHException) and not isinstance(
        e, (paramiko.AuthenticationException, paramiko.BadHostKeyException, _UnknownHostKey)
    ):
        text = str(e).lower()
        return (
            "banner" in text
            or "reset" in text
            or "eof" in text
            or isinstance(e.__cause__ or e.__context__, (EOFError, ConnectionError))
        )
    return False


class SSHConnection:
    """One authenticated SSH connection (a paramiko transport) to ``host``.

    The constructor connects and blocks for at most about 4 × ``opts.connect_timeout``
    seconds (TCP connect, banner, authentication; plus the same per ProxyJump hop).
    Channels (:meth:`exec`, :meth:`run`) may be opened from several threads. The transport
    sends a keepalive every 15 s so a dead peer is noticed on idle connections.

    Raises RemoteError (one line naming the host) when: the host key is unknown (add it,
    or use ``--ssh-accept-new-host-keys``) or changed; authentication fails; the key is
    encrypted; the connection is refused, unreachable, times out, or the name does not
    resolve; the config or known_hosts file cannot be read. ``RemoteError.transient`` tells
    whether retrying makes sense (see :func:`connect_all`).
    """

    def __init__(self, host: Host, opts: SSHOptions, *, _via: tuple[str, ...] | None = None):
        self.host = host
        self.opts = opts
        self._jump: SSHConnection | None = None
        s = self.settings = _resolve(host, opts, _lookup(host.name, opts.config_file), _via)
        self.hostname, self.port, self.user = s.hostname, s.port, s.user
        self.client = paramiko.SSHClient()
        try:
            self._connect(s, opts)
        except BaseException:
            self.close()
            raise
        transport = self.client.get_transport()
        assert transport is not None  # connect() returned: the transport is up
        self.transport: paramiko.Transport = transport
        transport.set_keepalive(int(KEEPALIVE_INTERVAL))

    def _load_known_hosts(self, s: _Settings) -> None:
        for path in s.global_known_hosts:
            if os.path.isfile(path):
                self._read_known_hosts(path, self.client.load_system_host_keys)
        for path in s.known_hosts:
            if os.path.isfile(path):
                self._read_known_hosts(path, self.client.get_host_keys().load)

    def _read_known_hosts(self, path: str, load: Callable[[str], None]) -> None:
        try:
            load(path)
        except (OSError, paramiko.SSHException, ValueError) as e:
            raise RemoteError(f"cannot read known_hosts file {path}: {e}", host=self.settings.label) from e

    def _open_sock(self, s: _Settings, opts: SSHOptions) -> paramiko.Channel | paramiko.ProxyCommand | None:
        """A socket-like object through ProxyJump/ProxyCommand, or None for direct TCP."""
        if s.proxy_jump:
            # As ssh -J: the last jump host is reached through the ones before it (never
            # through its own config ProxyJump, so config loops cannot recurse); the
            # --ssh-port/--ssh-user overrides are for the destination only.
            jump_host = _parse_jump(s.proxy_jump[-1])
            try:
                self._jump = SSHConnection(
                    jump_host, replace(opts, port=None, user=None), _via=s.proxy_jump[:-1]
                )
            except RemoteError as e:
                raise RemoteError(
                    f"{s.label}: via jump host: {e}", host=s.label, transient=e.transient
                ) from e
            try:
                return self._jump.transport.open_channel(
                    "direct-tcpip", (s.hostname, s.port), ("127.0.0.1", 0), timeout=opts.connect_timeout
                )
            except (paramiko.SSHException, OSError, EOFError) as e:
                raise RemoteError(
                    f"{s.label}: jump host {jump_host} cannot reach {s.hostname}:{s.port} ({e})", host=s.label
                ) from e
        if s.proxy_command:  # %h %p %r were expanded by _lookup
            try:
                return paramiko.ProxyCommand(s.proxy_command)
            except (paramiko.SSHException, OSError) as e:
                raise RemoteError(f"{s.label}: ProxyCommand failed to start: {e}", host=s.label) from e
        return None

    def _connect(self, s: _Settings, opts: SSHOptions) -> None:
        self._load_known_hosts(s)
        self.client.set_missing_host_key_policy(_HostKeyPolicy(s.accept_new, s.known_hosts[0]))
        where = f"{s.label} ({s.user}@{s.hostname}:{s.port})"
        key_name = f"[{s.hostname}]:{s.port}" if s.port != 22 else s.hostname
        t = opts.connect_timeout
        sock = self._open_sock(s, opts)
        try:
            self.client.connect(
                s.hostname,
                port=s.port,
                username=s.user,
                sock=sock,
                key_filename=list(s.key_files) or None,  # type: ignore[arg-type]  # a list is documented; the stub says str
                look_for_keys=not s.key_files,
                allow_agent=s.allow_agent,
                timeout=t,
                banner_timeout=t,
                auth_timeout=t,
                channel_timeout=t,
            )
        except _UnknownHostKey as e:
            raise RemoteError(
                f"{where}: host key not known (no entry {key_name} in "
                f"{', '.join(s.known_hosts)}); add it (e.g. ssh-keyscan -p {s.port} "
                f"{s.hostname} >> {s.known_hosts[0]}) or use --ssh-accept-new-host-keys",
                host=s.label,
            ) from e
        except paramiko.BadHostKeyException as e:
            raise RemoteError(
                f"{where}: host key CHANGED (differs from {', '.join(s.known_hosts)}): "
                f"possible man-in-the-middle; if the host was reinstalled, remove the old "
                f"entry: ssh-keygen -R '{key_name}' -f {s.known_hosts[0]}",
                host=s.label,
            ) from e
        except paramiko.PasswordRequiredException as e:
            raise RemoteError(
                f"{where}: private key is encrypted; add it to ssh-agent (ssh-add) or use an unencrypted key",
                host=s.label,
            ) from e
        except paramiko.AuthenticationException as e:
            tried = ", ".join(s.key_files) or "default keys and ssh-agent"
            raise RemoteError(
                f"{where}: authentication failed (tried {tried}); check "
                f"--ssh-key/IdentityFile, --ssh-user/User and the remote "
                f"authorized_keys",
                host=s.label,
            ) from e
        except paramiko.ssh_exception.NoValidConnectionsError as e:
            raise RemoteError(
                f"{where}: connection refused or unreachable; is sshd running "
                f"there, and is the port right (--ssh-port/Port)?",
                host=s.label,
            ) from e
        except socket.gaierror as e:
            raise RemoteError(
                f"{where}: cannot resolve host name {s.hostname!r} "
                f"({e.strerror}); check the name or add a HostName to the ssh "
                f"config",
                host=s.label,
            ) from e
        except (socket.timeout, TimeoutError) as e:
            raise RemoteError(
                f"{where}: timed out after {t:g} s connecting; check the "
                f"address, firewall, or raise the connect timeout",
                host=s.label,
            ) from e
        except (paramiko.SSHException, OSError, EOFError) as e:
            transient = _is_transient(e)
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if transient:
                raise RemoteError(
                    f"{where}: connection dropped during the SSH handshake "
                    f"({detail}); sshd may be overloaded (MaxStartups)",
                    host=s.label,
                    transient=True,
                ) from e
            raise RemoteError(f"{where}: SSH error: {detail}", host=s.label) from e

    @property
    def local_address(self) -> str | None:
        """This machine's IP address on the TCP connection to the host (an address the
        host can usually reach back, barring NAT); None when tunnelled through ProxyJump
        or ProxyCommand (then the route back is unknown)."""
        sock = self.transport.sock
        return sock.getsockname()[0] if isinstance(sock, socket.socket) else None

    @property
    def peer_address(self) -> str:
        """The host's IP address when connected directly; else its configured HostName
        (as the jump host resolves it)."""
        sock = self.transport.sock
        return sock.getpeername()[0] if isinstance(sock, socket.socket) else self.hostname

    def exec(
        self, command: str, stdin_data: bytes | None = None, keep_stdin_open: bool = False
    ) -> RemoteProcess:
        """Start ``command`` (run by the remote user's login shell, as ``ssh host cmd``)
        on a new channel without a terminal, and return at once.

        ``stdin_data`` is written to the command's stdin (secrets travel this way, never
        on a command line), then stdin is closed so the command reads EOF; with
        ``keep_stdin_open`` it stays open and the command sees EOF only when this
        connection goes away (a way for a remote process to notice that the head died).
        Writing blocks only if the remote side does not read and more than the channel
        window (2 MiB) is sent.

        Raises RemoteError if the channel cannot be opened or sshd refuses the command
        (within ``connect_timeout`` seconds), or the connection is lost while writing.
        """
        try:
            chan = self.transport.open_session(timeout=self.opts.connect_timeout)
            proc = RemoteProcess(chan, self.settings.label)
            chan.exec_command(command)
            if stdin_data:
                chan.sendall(stdin_data)
            if not keep_stdin_open:
                chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise RemoteError(
                f"{self.settings.label}: cannot run a command: {e}", host=self.settings.label
            ) from e
        return proc

    def run(
        self, command: str, timeout: float = 30.0, stdin_data: bytes | None = None
    ) -> tuple[int, str, str]:
        """Run ``command`` to completion: ``(exit status, stdout, stderr)``, output decoded
        as UTF-8 (undecodable bytes replaced).

        Blocks until the command exits and its output is complete (see
        :meth:`RemoteProcess.eof`: at most 2 s after the exit status if a background
        process keeps the output open), at most ``timeout`` seconds. The exit status is
        -1 if the command was killed by a signal (sshd then sends no status).

        Raises RemoteError: the command could not start, or did not finish within
        ``timeout`` (its channel is then closed).
        """
        proc = self.exec(command, stdin_data)
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        poller = select.poll()  # not select(): descriptors may be above 1024 in big jobs
        poller.register(proc.fileno(), select.POLLIN)
        try:
            while True:
                out += proc.read_stdout()
                err += proc.read_stderr()
                if proc.eof() and proc.exited():
                    break
                now = time.monotonic()
                if now >= deadline:
                    raise RemoteError(
                        f"{self.settings.label}: command did not finish within {timeout:g} s: {command[:80]}",
                        host=self.settings.label,
                    )
                # after the status the fd stays readable: sleep a little while output trails
                poller.poll(max(1, int((deadline - now) * 1000)))
                if proc.exited() and not proc.eof():
                    time.sleep(0.01)
            out += proc.read_stdout()  # what arrived between the last read and the EOF
            err += proc.read_stderr()
        finally:
            proc.close()
        status = proc.exit_status()
        assert status is not None  # the loop above ends only once the command exited
        return (status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    def close(self) -> None:
        """Close the connection (and its channels, and any jump-host connection).
        Never raises; idempotent."""
        try:
            self.client.close()
        finally:
            if self._jump is not None:
                self._jump.close()

    def __enter__(self) -> SSHConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SSHConnection {self.settings.label} {self.user}@{self.hostname}:{self.port}>"


class _StatusEvent(threading.Event):
    """Replaces ``Channel.status_event`` so that the arrival of the exit status also makes
    the channel's fileno readable. paramiko alone signals the fileno only for data and
    EOF, and EOF never comes while a background process holds the command's output."""

    def __init__(self, chan: paramiko.Channel) -> None:
        super().__init__()
        self._chan = chan
        self.when: float | None = None  # time.monotonic() of the exit status

    def set(self) -> None:
        if self.when is None:
            self.when = time.monotonic()
        super().set()
        pipe = getattr(self._chan, "_pipe", None)
        if pipe is not None:
            pipe.set_forever()


class RemoteProcess:
    """A command running on a remote host (one SSH channel), watched without blocking.

    ``fileno()`` works with ``select``/``selectors``: it is readable while stdout or
    stderr data is waiting, and stays readable for good once the exit status arrived or
    the channel closed (so stop polling once :meth:`exited` and :meth:`eof` are both
    true). Output can trail the exit status: keep reading until :meth:`eof`.
    """

    def __init__(self, channel: paramiko.Channel, label: str = "") -> None:
        self.channel = channel
        self.label = label
        self._fd = channel.fileno()  # creates paramiko's pipe: must exist before data
        if hasattr(channel, "status_event") and not channel.status_event.is_set():
            channel.status_event = _StatusEvent(channel)

    def fileno(self) -> int:
        return self._fd

    def _drain(self, ready: Callable[[], bool], recv: Callable[[int], bytes]) -> bytes:
        data = bytearray()
        while ready():
            chunk = recv(1 << 16)
            if not chunk:
                break
            data += chunk
        return bytes(data)

    def read_stdout(self) -> bytes:
        """What the command wrote to stdout and has arrived; b"" if nothing. Never blocks."""
        return self._drain(self.channel.recv_ready, self.channel.recv)

    def read_stderr(self) -> bytes:
        """What the command wrote to stderr and has arrived; b"" if nothing. Never blocks."""
        return self._drain(self.channel.recv_stderr_ready, self.channel.recv_stderr)

    def write_stdin(self, data: bytes, close: bool = True) -> None:
        """Send ``data`` to the command's stdin (of a process started with
        ``keep_stdin_open``), then close stdin unless ``close`` is False. Blocks only when
        more than the channel window (2 MiB) is unread. Raises RemoteError when the
        connection is lost."""
        try:
            self.channel.sendall(data)
            if close:
                self.channel.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise RemoteError(f"{self.label}: cannot write to the remote command: {e}", self.label) from e

    def exited(self) -> bool:
        """True once the exit status arrived (or the channel closed without one)."""
        return self.channel.exit_status_ready()

    def eof(self) -> bool:
        """True once the remote side closed its output, or the channel closed, or 2 s
        after the exit status arrived: a leftover background process may hold the output
        open forever (as with ``ssh host 'sleep 99 & exit'``); its output is abandoned."""
        chan = self.channel
        if chan.eof_received or chan.closed:
            return True
        when = getattr(chan.status_event, "when", None)
        return when is not None and time.monotonic() - when >= EOF_GRACE

    def exit_status(self) -> int | None:
        """The command's exit status; None while it runs; -1 if the channel closed without
        a status (killed by a signal, or the connection was lost)."""
        if not self.channel.exit_status_ready():
            return None
        return self.channel.recv_exit_status()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the exit status arrives, at most ``timeout`` seconds (None: no
        limit); output is not read. Raises RemoteError on timeout."""
        if not self.channel.status_event.wait(timeout):
            raise RemoteError(
                f"{self.label}: remote command still running after {timeout:g} s", host=self.label
            )
        return self.channel.recv_exit_status()

    def close(self) -> None:
        """Close the channel (sshd then closes the command's stdin/stdout; a command that
        ignores that keeps running). Idempotent, never raises."""
        try:
            self.channel.close()
        except Exception:  # closing a channel of a dead transport: nothing left to do
            pass


def connect_all(
    hosts: list[Host], opts: SSHOptions, max_concurrent: int = 16, attempts: int = 4
) -> list[SSHConnection]:
    """Connect to every host in parallel; return the connections in ``hosts`` order.

    At most ``max_concurrent`` connections are being set up at once (OpenSSH's sshd drops
    connections beyond ``MaxStartups``, default 10:30:100, which matters when a jump host
    or one node is named many times). A transient failure (connection reset, no banner) is
    retried up to ``attempts`` times in all, after 0.5, 1, 2 ... s (with jitter); host-key,
    authentication, refused and timeout failures are not retried. Blocks until every host
    succeeded or gave up: roughly ``connect_timeout`` × 4 × ``attempts`` at the very worst.

    Raises RemoteError listing every failed host, one line each, after closing the
    connections that succeeded.
    """
    if not hosts:
        return []

    def one(host: Host) -> SSHConnection:
        for attempt in range(attempts):
            try:
                return SSHConnection(host, opts)
            except RemoteError as e:
                if not e.transient or attempt == attempts - 1:
                    raise
            time.sleep(0.5 * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    futures = in_threads(one, hosts, max_concurrent, "distlaunch-ssh")
    conns, failures = [], []
    for host, fut in zip(hosts, futures):
        try:
            conns.append(fut.result())
        except RemoteError as e:
            failures.append(str(e))
        except Exception as e:  # a paramiko bug should still name the host
            failures.append(f"{host}: {type(e).__name__}: {e}")
    if failures:
        for c in conns:
            c.close()
        raise RemoteError(
            f"cannot connect to {len(failures)} of {len(hosts)} hosts:\n  " + "\n  ".join(failures)
        )
    return conns
