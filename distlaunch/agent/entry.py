"""``distlaunch agent``: the entry point of an agent an engine started on another machine
(``engine/``), with its job spec as one JSON line on stdin.

The agent first prints ``AGENT_HELLO <version>`` (remote.command), before its own
imports (they run while the head waits for the other hosts), and only then reads the
spec: the head's start-up check (remote.preflight.start_checked) needs no interpreter of
its own, and an agent whose head found a problem on any host reads end-of-file and ends
without starting anything. ``python -m distlaunch agent`` comes here without the
CLI's imports (``__main__``).

The line is one node's :class:`JobSpec` (``JobSpec.to_dict``), or a message of the
engine that started the agent, naming it (``{"engine": NAME, ...}``: Slurm's one line
for every node), from which the engine's plug-in picks this node's spec.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from .. import AGENT_HELLO, __version__

if TYPE_CHECKING:
    from ..config import LaunchConfig
    from ..store.client import StoreAddress


class JobSpec(NamedTuple):
    """What the head sends one node's agent (it holds the store's secret: stdin only).
    As JSON (``to_dict``): ``{"config": LaunchConfig.to_dict(), "store": [host, port],
    "token": secret, "node": NodeOptions' keyword arguments (node_id set; the others
    default), "env": {variables for the agent and its workers}, "master_addr": the
    address to announce as MASTER_ADDR}``. ``node`` is kept as keyword arguments so that
    the head need not import the node agent's module to build a spec."""

    config: LaunchConfig
    store: StoreAddress
    node: dict[str, Any]  # NodeOptions(**node)
    env: dict[str, str]  # --env-all: set in the agent, which its workers inherit
    master_addr: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "store": [self.store.host, self.store.port],
            "token": self.store.token,
            "node": dict(self.node),
            "env": self.env,
            "master_addr": self.master_addr,
        }

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> JobSpec:
        from ..config import LaunchConfig
        from ..store.client import StoreAddress

        host, port = spec["store"]
        return cls(
            LaunchConfig.from_dict(spec["config"]),
            StoreAddress(host, port, spec["token"]),
            dict(spec["node"]),
            spec.get("env", {}),
            spec["master_addr"],
        )


def run_agent(spec: dict[str, Any]) -> int:
    """Run one node's agent for ``spec`` (a JobSpec as a dict; it holds the store's
    secret). Returns the restarts taken; raises as NodeAgent.run. Records its end in the
    store so the head can tell a finished agent from a lost one."""
    from ..rendezvous import Rendezvous
    from .guard import OrphanGuard
    from .node import NodeAgent, NodeOptions

    job = JobSpec.from_dict(spec)
    cfg, store, node = job.config, job.store, NodeOptions(**job.node)
    os.environ.update(job.env)  # --env-all: the agent and its workers inherit them
    guard = OrphanGuard()
    try:
        return NodeAgent(cfg, store, node, guard, master_addr=job.master_addr).run()
    finally:
        guard.close()
        try:
            assert node.node_id is not None  # the head sets it for every agent
            # short: when the head (and its store) is gone, nobody is left to tell
            with store.connect(5, connect_timeout=0.5) as c:
                Rendezvous(c, cfg.run_id, 0, 1).record_agent_exit(node.node_id)
        except Exception:  # the store is gone; the head (if alive) sees the channel close
            pass


def main() -> NoReturn:
    """``python -m distlaunch agent``: say hello, read the spec, run; exits with the
    workers' failure or stop signal code (the head reports those), a DistlaunchError's
    code (said here), or 0 when stdin ends before a spec (the head started nothing)."""
    print(AGENT_HELLO, __version__, flush=True)
    # the imports run while the head waits for the other hosts' hellos; the version in
    # the hello matched, so only a broken install fails here
    try:
        from ..errors import DistlaunchError, LaunchInterrupted, WorkerFailedError
        from ..report import say
        from .node import NodeAgent  # noqa: F401  (loads the rest before the spec arrives)
    except ImportError as e:
        print(f"distlaunch agent: cannot start here: {e} (reinstall distlaunch)", file=sys.stderr)
        os._exit(1)

    line = sys.stdin.readline()
    code = 0
    if line:
        try:
            spec = json.loads(line)
            if "engine" in spec:  # an engine's own message (Slurm: one line for every node)
                from ..engine import plugin

                spec = plugin(spec["engine"]).agent_spec(spec, os.environ)
            run_agent(spec)
        except (WorkerFailedError, LaunchInterrupted) as e:
            code = e.exit_code
        except DistlaunchError as e:
            say(f"error: {e}")
            code = e.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the CLI: every process of this node ended; skip the teardown
