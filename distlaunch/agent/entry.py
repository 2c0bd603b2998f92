"""``distlaunch agent``: the entry point of an agent an engine started on another machine
(``engine/``), with its job spec as one JSON line on stdin.

The spec: ``{"config": LaunchConfig.to_dict(), "store": [host, port], "token": secret,
"node": NodeOptions as a dict (node_id set), "env": {variables for the agent and its
workers}, "master_addr": the address to announce as MASTER_ADDR}``.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import LaunchConfig
from ..rendezvous import Rendezvous
from .guard import OrphanGuard
from .node import NodeAgent, NodeOptions, StoreAddress


def run_agent(spec: dict[str, Any]) -> int:
    """Run one node's agent for ``spec`` (see the module docstring; it holds the store's
    secret). Returns the restarts taken; raises as NodeAgent.run. Records its end in the
    store so the head can tell a finished agent from a lost one."""
    from ..store import StoreClient

    cfg = LaunchConfig.from_dict(spec["config"])
    os.environ.update(spec.get("env", {}))  # --env-all: the agent and its workers inherit them
    host, port = spec["store"]
    store = StoreAddress(host, port, spec["token"])
    guard = OrphanGuard()
    try:
        return NodeAgent(
            cfg, store, NodeOptions(**spec["node"]), guard, master_addr=spec["master_addr"]
        ).run()
    finally:
        guard.close()
        try:
            # short: when the head (and its store) is gone, nobody is left to tell
            with StoreClient(host, port, token=store.token, timeout=5, connect_timeout=0.5) as c:
                Rendezvous(c, cfg.run_id, 0, 1).record_agent_exit(spec["node"]["node_id"])
        except Exception:  # the store is gone; the head (if alive) sees the channel close
            pass
