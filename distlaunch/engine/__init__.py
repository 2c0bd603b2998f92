"""Engines: how the head starts one agent per node on other machines and watches them.

One implementation per way of reaching the nodes; :class:`AgentEngine` is what the head
(``head.py``) needs from any of them:

- ``ssh.SSHEngine``: one SSH connection per host, one exec per agent (paramiko, imported
  only by that module).
- ``slurm.SlurmEngine``: every agent in one ``srun`` step inside the user's allocation.

An engine starts ``python -m distlaunch agent`` (``agent/entry.py``) with each node's job
spec on the agent's stdin (the spec holds the store's secret: never on a command line),
relays the agents' output to this process's stdout/stderr as whole lines, reports each
agent's end with its status, and kills a node's recorded processes (``agent/kill.py``)
when its agent does not stop. Importing this package imports no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["AgentEngine", "OnEnd"]

# (node id, exit status) of an agent that ended; the status is None or -1 when unknown
# (killed by a signal, connection lost).
OnEnd = Callable[[int, "int | None"], None]


class AgentEngine(Protocol):
    """Agents on other machines, one per node id (the host's index in the host list)."""

    def store_address(self) -> str | None:
        """The address of this machine that the nodes reach it at (where the head's store
        listens); None when it cannot be told (e.g. SSH through a proxy)."""

    def master_address(self, node_id: int) -> str:
        """The address node ``node_id`` announces as MASTER_ADDR if it becomes node 0."""

    def start(self, specs: Mapping[int, dict[str, Any]]) -> None:
        """Start one agent per node id with its spec (JSON on stdin). Raises RemoteError."""

    @property
    def running(self) -> list[int]:
        """Node ids of the agents started and not yet ended."""

    def pump(
        self, timeout: float | None, extra_fds: Sequence[int] = (), on_end: OnEnd | None = None
    ) -> list[int]:
        """Relay output and notice ends for up to ``timeout`` s (None: until something
        happens); calls ``on_end`` once per agent that ended. Returns the ``extra_fds``
        that became readable."""

    def abandon(self, node_id: int) -> None:
        """Stop watching node ``node_id``'s agent (after killing it); it counts as ended
        with status -1 (``on_end`` is not called)."""

    def kill(self, node_id: int, records: list[tuple[int, int]]) -> None:
        """SIGKILL node ``node_id``'s recorded processes (validated ``(pid, start time)``
        records, agent.kill). Best effort; blocks for a few seconds at most; never raises."""

    def signal_group(self, sig: int) -> None:
        """Relay signal ``sig`` the head received to the agents' processes where the engine
        can (Slurm: SIGUSR1/SIGUSR2 to the whole step); a no-op where it cannot (SSH). The
        ``agent.signals.SignalRelay`` target interface; never raises."""

    def close(self) -> None:
        """Release every connection and channel; agents still running lose their stdin
        and output. Idempotent."""
