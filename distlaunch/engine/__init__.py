"""Engines: how the head starts one agent per node on other machines and watches them,
and how a launcher tells that a scheduler started it, one plug-in per way.

``ENGINES`` is the registry: one entry per engine, its plug-in (``PLUGIN``, an
:class:`EnginePlugin`) in ``engine/<module>.py``; choosing an engine is one lookup
(:func:`plugin`) and detecting one is a walk over the entries (:func:`detect`). Each
plug-in says whether it applies here (``detect``), discovers its nodes, connects (its
:class:`AgentEngine` class's ``connect``), describes its agent command for
``--dry-run``, and picks an agent's own spec out of what the head sent (the agent side):

- ``ssh``: one SSH connection per host, one exec per agent (paramiko, imported only
  when it connects); nodes from -H/--hostfile.
- ``slurm``: every agent in one ``srun`` step inside the user's allocation; nodes from
  the allocation; under ``srun`` (a step), one launcher per node with its place from
  Slurm's variables.
- ``pods``: a Kubernetes pod started by kubeflow's PyTorchJob, trainer v2's TrainJob or
  a JobSet: one launcher per pod, its place from the operator's variables (MASTER_ADDR,
  PET_*, JOB_COMPLETION_INDEX, the JobSet restart attempt); never starts agents.
- ``skypilot``: a SkyPilot task's node (SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS): the same,
  one launcher per node.

An engine starts ``python -m distlaunch agent`` (``agent/entry.py``) with each node's job
spec on the agent's stdin (the spec holds the store's secret: never on a command line),
relays the agents' output to this process's stdout/stderr as whole lines, reports each
agent's end with its status, and kills a node's recorded processes (``agent/kill.py``)
when its agent does not stop. Importing this package imports no engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from ..hosts import Host
    from ..remote.ssh import SSHOptions
    from ..run_options import RunOptions

__all__ = [
    "DEFAULT",
    "ENGINES",
    "NAMES",
    "AgentEngine",
    "AgentLaunch",
    "EngineEntry",
    "EnginePlugin",
    "OnEnd",
    "Placement",
    "detect",
    "entry",
    "plugin",
]

# (node id, exit status) of an agent that ended; the status is None or -1 when unknown
# (killed by a signal, connection lost).
OnEnd = Callable[[int, "int | None"], None]

# Where an engine that applies puts this launch: "node" (a scheduler started one
# launcher per node: the options come from its variables) or "head" (this machine
# starts the agents of the engine's nodes).
Placement = Literal["node", "head"]


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the registry."""

    name: str  # --launcher NAME, HeadOptions.engine
    module: str  # distlaunch.engine.<module> defines PLUGIN
    # Variables without one of which ``detect`` is not asked, so that a plain launch
    # imports no engine; empty: the engine is never detected, only named or implied.
    markers: tuple[str, ...] = ()


# The registry, in detection order. A new engine: a module with PLUGIN, and one entry.
ENGINES: tuple[EngineEntry, ...] = (
    EngineEntry("ssh", "ssh"),
    EngineEntry("slurm", "slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID")),
    # SkyPilot first: its tasks may run in Kubernetes pods too, and its variables say more
    EngineEntry("skypilot", "skypilot", ("SKYPILOT_NODE_RANK",)),
    EngineEntry("pods", "pods", ("KUBERNETES_SERVICE_HOST",)),
)
NAMES = tuple(e.name for e in ENGINES)  # --launcher's choices besides "auto"
DEFAULT = "ssh"  # the engine of a host list without --launcher


@dataclass(frozen=True)
class AgentLaunch:
    """How every agent of a head-mode job is started, on any node: the interpreter, the
    working directory, the variables on its command line (nothing secret: only
    PYTHONPATH, see remote.command), the head's version (the agents' hello must match)."""

    python: str
    cwd: str
    cmd_env: Mapping[str, str]
    version: str
    ssh: SSHOptions | None = None  # --ssh-* (the SSH engine's settings)


class AgentEngine(Protocol):
    """Agents on other machines, one per node id (the host's index in the host list)."""

    @classmethod
    def connect(cls, hosts: Mapping[int, Host], launch: AgentLaunch) -> AgentEngine:
        """Reach every host of ``hosts`` (node id -> host) and get ready to start the
        agents (Slurm: the agent step starts here). Blocks. Raises ConfigError when a
        node cannot be reached (nothing was started)."""

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


class EnginePlugin(Protocol):
    """What the registry knows of an engine (``engine/<module>.py``'s ``PLUGIN``)."""

    # The head's own host runs its agent in-process (SSH); False: every node's agent
    # goes through the engine, the head's too (Slurm: inside the job's step).
    local_agent_in_process: bool
    # "node" placement with per-node options given (--nnodes, --master-addr, ...): False,
    # the launch is taken as the user wrote it (Slurm under srun); True, the engine still
    # fills the options not given (``node_options``), and says where a given one wins
    # over its variables (Kubernetes pods: PET_* reach the options as given ones).
    fills_around_given: bool

    def detect(self, environ: Mapping[str, str]) -> Placement | None:
        """Where this engine puts a launch started in ``environ`` without a host list or
        per-node options: "node", "head", or None (it does not apply). Pure."""

    def check(self, environ: Mapping[str, str]) -> None:
        """``--launcher NAME`` named this engine: raise ConfigError when it cannot run
        here (Slurm outside an allocation)."""

    def node_options(
        self, environ: Mapping[str, str], options: Mapping[str, Any], given: frozenset[str]
    ) -> dict[str, Any]:
        """For "node": the `run` options (by name, as the command line gives them) the
        scheduler's variables fill; ``options``: all of them as click gives them, ``given`` the
        names the user set (these win: ``resolve`` keeps them). May block (a pod waits for
        its master's name to resolve). Raises ConfigError."""

    def discover(self, opts: RunOptions, environ: Mapping[str, str]) -> list[Host]:
        """For "head": the nodes and their slots, in node-rank order. Raises ConfigError."""

    def engine(self) -> type[AgentEngine]:
        """The engine class (importing what it needs)."""

    def describe(self, hosts: Mapping[int, Host], launch: AgentLaunch) -> str:
        """The agents' command line for ``--dry-run`` (nothing secret). Pure."""

    def agent_spec(self, message: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        """On a node: this agent's job spec out of the line the engine sent (a message
        naming this engine, see ``agent.entry``). Raises ConfigError."""


def entry(name: str) -> EngineEntry:
    """The registry entry named ``name``. Raises KeyError if there is none."""
    for e in ENGINES:
        if e.name == name:
            return e
    raise KeyError(f"no engine {name!r} (engines: {', '.join(NAMES)})")


def plugin(name: str) -> EnginePlugin:
    """The plug-in of engine ``name`` (imports its module). KeyError if unknown."""
    module = importlib.import_module(f"{__name__}.{entry(name).module}")
    found: EnginePlugin = module.PLUGIN
    return found


def detect(launcher: str, environ: Mapping[str, str]) -> tuple[str, Placement] | None:
    """The first engine, in registry order, that ``launcher`` ("auto" or an engine's
    name) allows and that applies in ``environ`` (``EnginePlugin.detect``), with its
    placement; None when none does. Imports only the engines whose markers are set."""
    for e in ENGINES:
        if launcher in ("auto", e.name) and any(m in environ for m in e.markers):
            placement = plugin(e.name).detect(environ)
            if placement is not None:
                return e.name, placement
    return None
