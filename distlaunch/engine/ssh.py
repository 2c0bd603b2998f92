"""The SSH engine: one SSH connection per host (``remote.ssh``), one exec per agent that
checks the host and says hello before it reads its spec from the channel's stdin
(``remote.preflight.start_checked``: one interpreter per host, and nothing starts
anywhere unless every host passed), and remote kills run over the same connection (or
a fresh one if it broke). Nodes come from a host list (-H/--hostfile), never from the
environment. paramiko is imported when the engine connects, not with this module (the
registry imports it to choose an engine).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..hosts import Host
from ..remote import RemoteError
from ..remote.command import checked_command, remote_command
from ..report import progress, say
from . import AgentLaunch, EnginePlugin, OnEnd, Placement
from .relay import AgentRelay

if TYPE_CHECKING:
    from ..remote.ssh import SSHConnection
    from ..run_options import RunOptions

AGENT_ARGV = ["-m", "distlaunch", "agent"]


class SSHEngine:
    """Agents on ``hosts`` (node id -> Host) over SSH, run as ``python`` in ``cwd`` with
    ``cmd_env`` on the command line (nothing secret: see remote.command). See
    ``engine.AgentEngine`` for the methods."""

    def __init__(
        self,
        conns: Mapping[int, SSHConnection],
        python: str,
        cwd: str,
        cmd_env: Mapping[str, str],
        version: str,
    ):
        self.conns = dict(conns)
        self.python, self.cwd, self.cmd_env, self.version = python, cwd, dict(cmd_env), version
        self.relay = AgentRelay()

    @classmethod
    def connect(cls, hosts: Mapping[int, Host], launch: AgentLaunch) -> SSHEngine:
        """Connect to every host with ``launch.ssh``. Blocks. Raises ConfigError when a
        host cannot be reached (nothing was started)."""
        from ..remote.ssh import connect_all

        assert launch.ssh is not None  # set with every host list (modes._head_options)
        progress(f"connecting to {len(hosts)} host(s)", False)
        try:
            conns = dict(zip(hosts, connect_all(list(hosts.values()), launch.ssh)))
        except RemoteError as e:
            raise ConfigError(str(e)) from e  # one line per host; the CLI joins them
        return cls(conns, launch.python, launch.cwd, launch.cmd_env, launch.version)

    def store_address(self) -> str | None:
        first = next(iter(self.conns.values()), None)
        return first.local_address if first is not None else None

    def master_address(self, node_id: int) -> str:
        return self.conns[node_id].peer_address

    def start(self, specs: Mapping[int, dict[str, Any]]) -> None:
        """Start the agents, check that each runs with this version (each report is said,
        ``report.say``), and only then send every spec. Raises ConfigError when a host
        failed its check (nothing was started anywhere), RemoteError when a connection
        is lost while sending."""
        from ..remote.preflight import start_checked

        progress(f"checking {len(specs)} host(s)", False)
        cmd = checked_command(self.python, self.cwd, AGENT_ARGV, self.cmd_env)
        conns = {k: self.conns[k] for k in specs}
        procs, reports = start_checked(conns, cmd, self.python, self.cwd, self.version)
        for r in reports:
            say(f"preflight {r.host.name}: {'ok' if r.ok else r.problem}")
        bad = [r for r in reports if not r.ok]
        if bad:
            for p in procs.values():
                p.close()  # end of stdin before a spec: the agent ends, starting nothing
            raise ConfigError(
                f"preflight failed on {len(bad)} of {len(reports)} host(s) "
                f"({', '.join(r.host.name for r in bad)}); nothing was started"
            )
        for k, spec in specs.items():
            procs[k].write_stdin((json.dumps(spec) + "\n").encode())
            self.relay.add(k, procs[k])

    @property
    def running(self) -> list[int]:
        return self.relay.running

    def pump(
        self, timeout: float | None, extra_fds: Sequence[int] = (), on_end: OnEnd | None = None
    ) -> list[int]:
        return self.relay.pump(timeout, extra_fds, on_end)

    def abandon(self, node_id: int) -> None:
        self.relay.abandon(node_id)

    def kill(self, node_id: int, records: list[tuple[int, int]]) -> None:
        if records and node_id in self.conns:
            kill_remote(self.conns[node_id], kill_command(self.python, self.cwd, self.cmd_env, records))

    def signal_group(self, sig: int) -> None:
        """No-op: there is no way to signal the remote workers over SSH yet (the head
        stops a job through the store)."""

    def close(self) -> None:
        self.relay.close()
        for c in self.conns.values():
            c.close()


def kill_command(python: str, cwd: str, env: Mapping[str, str], records: list[tuple[int, int]]) -> str:
    """The command that kills a host's recorded processes (``agent.kill``; ``records``
    validated by ``parse_records``), run like the agent: same interpreter, directory and
    command-line environment. Pure."""
    return remote_command(
        python, cwd, ["-m", "distlaunch.agent.kill", *(f"{p}:{t}" for p, t in records)], env
    )


def kill_remote(conn: SSHConnection, cmd: str) -> None:
    """Run ``cmd`` (``python -m distlaunch.agent.kill``: SIGKILL an agent's recorded
    processes) on ``conn``'s host, over a fresh SSH connection if that one is broken."""
    from ..remote.ssh import SSHConnection

    try:
        conn.run(cmd, timeout=10)
    except RemoteError:
        try:
            with SSHConnection(conn.host, conn.opts) as fresh:
                fresh.run(cmd, timeout=10)
        except RemoteError:
            pass  # the host is unreachable: nothing more can be done from here


class SSHPlugin:
    """The SSH engine in the registry (``engine.EnginePlugin``): chosen by a host list
    (the default engine there) or ``--launcher ssh``; never detected."""

    local_agent_in_process = True  # the head's own host runs its agent in-process
    fills_around_given = False  # never detected

    def detect(self, environ: Mapping[str, str]) -> Placement | None:
        return None

    def check(self, environ: Mapping[str, str]) -> None:
        pass  # runs wherever SSH reaches the hosts; without a host list: this node alone

    def node_options(
        self, environ: Mapping[str, str], options: Mapping[str, Any], given: frozenset[str]
    ) -> dict[str, Any]:
        return {}  # never detected: no launcher of its own on a node

    def discover(self, opts: RunOptions, environ: Mapping[str, str]) -> list[Host]:
        raise ConfigError("--launcher ssh starts agents on the hosts of -H/--hostfile; give one of them")

    def engine(self) -> type[SSHEngine]:
        return SSHEngine

    def describe(self, hosts: Mapping[int, Host], launch: AgentLaunch) -> str:
        return remote_command(launch.python, launch.cwd, AGENT_ARGV, launch.cmd_env)

    def agent_spec(self, message: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        return dict(message)  # one channel per agent: the line is its spec


PLUGIN: EnginePlugin = SSHPlugin()  # mypy checks it against the protocol
