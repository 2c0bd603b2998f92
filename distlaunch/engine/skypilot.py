"""The SkyPilot engine: on a node of a multi-node SkyPilot task, `distlaunch run train.py`
with no flags is that node's launcher, as in a Kubernetes pod (``engine/pods.py``, whose
helpers it uses). Starts no agents.

What SkyPilot sets on every node (skypilot-org/skypilot ``sky/skylet/constants.py``; the
task's run command gets them): ``SKYPILOT_NODE_RANK`` (this node, 0 = the head),
``SKYPILOT_NODE_IPS`` (every node's address, one a line, the head first),
``SKYPILOT_NUM_NODES``, ``SKYPILOT_NUM_GPUS_PER_NODE``, ``SKYPILOT_TASK_ID`` (the same on
every node of the task and across a managed job's recoveries). Filled when not given:
nodes ``SKYPILOT_NUM_NODES``, else the count of addresses (one line when they disagree);
node rank ``SKYPILOT_NODE_RANK``; master the first address; port ``MASTER_PORT``, else
29500 (torchrun's); workers per node ``SKYPILOT_NUM_GPUS_PER_NODE`` when more than 0
(``PET_NPROC_PER_NODE`` or the flag win); the run id from the task id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..env import lookup
from ..errors import ConfigError
from . import AgentLaunch, EnginePlugin, Placement
from .pods import NO_AGENTS, OWN_RENDEZVOUS, inside_a_job, place_node, read

if TYPE_CHECKING:
    from ..hosts import Host
    from ..run_options import RunOptions

__all__ = ["PLUGIN", "SkyPilotPlugin"]


class SkyPilotPlugin:
    """The SkyPilot engine in the registry (``engine.EnginePlugin``)."""

    local_agent_in_process = True  # no agents: never asked
    fills_around_given = True  # as pods: PET_* and flags win, the rest is filled

    def detect(self, environ: Mapping[str, str]) -> Placement | None:
        has = read(environ, "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS")
        return "node" if len(has) == 2 and not inside_a_job(environ) else None

    def check(self, environ: Mapping[str, str]) -> None:
        if self.detect(environ) is None:
            raise ConfigError(
                "--launcher skypilot needs a SkyPilot task's node (SKYPILOT_NODE_RANK and "
                "SKYPILOT_NODE_IPS set); drop --launcher skypilot here"
            )

    def node_options(
        self, environ: Mapping[str, str], options: Mapping[str, Any], given: frozenset[str]
    ) -> dict[str, Any]:
        """This node's place from SkyPilot's variables (see the module docstring). The
        addresses are IPs: nothing to wait for. Raises ConfigError."""
        if given & set(OWN_RENDEZVOUS):
            return {}
        ips = (lookup("SKYPILOT_NODE_IPS", environ) or "").split()  # one a line
        gpus = [(n, v) for n, v in read(environ, "SKYPILOT_NUM_GPUS_PER_NODE") if v != "0"]
        task = read(environ, "SKYPILOT_TASK_ID")
        readings = {
            "nnodes": [*read(environ, "SKYPILOT_NUM_NODES"), ("SKYPILOT_NODE_IPS' lines", str(len(ips)))],
            "node_rank": read(environ, "SKYPILOT_NODE_RANK"),
            "nproc_per_node": gpus,
            "master_addr": [("SKYPILOT_NODE_IPS' first line", ips[0])] if ips else [],
            "master_port": read(environ, "MASTER_PORT"),
        }
        return place_node(
            readings,
            options,
            given,
            [task[0][1]] if task else [],
            "SKYPILOT_NODE_IPS is empty",
            "skypilot",
        )

    def discover(self, opts: RunOptions, environ: Mapping[str, str]) -> list[Host]:
        raise ConfigError(NO_AGENTS.format(name="skypilot"))

    def engine(self) -> Any:
        raise ConfigError(NO_AGENTS.format(name="skypilot"))

    def describe(self, hosts: Mapping[int, Host], launch: AgentLaunch) -> str:
        raise ConfigError(NO_AGENTS.format(name="skypilot"))

    def agent_spec(self, message: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        raise ConfigError(NO_AGENTS.format(name="skypilot"))


PLUGIN: EnginePlugin = SkyPilotPlugin()  # mypy checks it against the protocol
