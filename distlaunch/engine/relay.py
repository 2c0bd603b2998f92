"""Relaying the output of agents that run elsewhere, as whole lines, and noticing their
ends. Works with any process handle shaped like ``remote.ssh.RemoteProcess`` (``fileno``,
``read_stdout``, ``read_stderr``, ``exited``, ``eof``, ``exit_status``, ``close``).
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Protocol

from ..agent.output import StreamSink
from . import OnEnd


class AgentProcess(Protocol):
    """What the relay needs of an agent's process handle (``remote.ssh.RemoteProcess``)."""

    def fileno(self) -> int: ...
    def read_stdout(self) -> bytes: ...
    def read_stderr(self) -> bytes: ...
    def exited(self) -> bool: ...
    def eof(self) -> bool: ...
    def exit_status(self) -> int | None: ...
    def close(self) -> None: ...


class AgentRelay:
    """The agents' processes by node id. Their output is already prefixed by the agent;
    it goes to this process's stdout/stderr line by line."""

    def __init__(self) -> None:
        self.procs: dict[int, AgentProcess] = {}
        self.sinks: dict[int, tuple[StreamSink, StreamSink]] = {}
        self.status: dict[int, int | None] = {}

    def add(self, node_id: int, proc: AgentProcess) -> None:
        self.procs[node_id] = proc
        self.sinks[node_id] = (StreamSink(b"", 1, None, False), StreamSink(b"", 2, None, True))

    @property
    def running(self) -> list[int]:
        return [k for k in self.procs if k not in self.status]

    def pump(
        self, timeout: float | None, extra_fds: Sequence[int] = (), on_end: OnEnd | None = None
    ) -> list[int]:
        """Wait up to ``timeout`` s for output or exits; returns the ready ``extra_fds``."""
        poller = select.poll()  # not select(): fds above 1024 with many hosts
        draining: list[int] = []  # exited, output not closed yet: their fd stays readable, so look
        for k in self.running:  # again shortly instead of spinning on it
            proc = self.procs[k]
            if proc.exited():
                draining.append(k)
            else:
                poller.register(proc.fileno(), select.POLLIN)
        for fd in extra_fds:
            poller.register(fd, select.POLLIN)
        if draining:
            timeout = 0.05 if timeout is None else min(timeout, 0.05)
        ready = {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)}
        for k in self.running:
            proc = self.procs[k]
            if k not in draining and proc.fileno() not in ready:
                continue
            out, err = self.sinks[k]
            out.feed(proc.read_stdout())
            err.feed(proc.read_stderr())
            if proc.exited() and proc.eof():
                out.close()
                err.close()
                self.status[k] = proc.exit_status()
                if on_end is not None:
                    on_end(k, self.status[k])
        return [fd for fd in extra_fds if fd in ready]

    def abandon(self, node_id: int) -> None:
        self.procs[node_id].close()
        self.status[node_id] = -1

    def close(self) -> None:
        for p in self.procs.values():
            p.close()
