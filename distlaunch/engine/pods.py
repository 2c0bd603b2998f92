"""The Kubernetes pods engine: in a pod that kubeflow's PyTorchJob, kubeflow trainer v2's
TrainJob or a JobSet started, `distlaunch run train.py` with no flags is one node's
launcher, its place read from the variables the operator set. It starts no agents (one
launcher per pod, "node" placement, as Slurm's under srun); the SkyPilot engine
(``engine/skypilot.py``) shares its helpers.

What each operator sets (the sources read):

- PyTorchJob, kubeflow/training-operator ``pkg/controller.v1/pytorch/envvar.go``,
  ``master.go``, ``elastic.go`` (v1.7 to v1.9, removed from the repository in #2389):
  ``MASTER_ADDR`` = ``PET_MASTER_ADDR`` = ``<job>-master-0`` (the master pod's
  service), ``MASTER_PORT`` = ``PET_MASTER_PORT`` = the master container's port named
  ``pytorchjob-port``; ``RANK`` = ``PET_NODE_RANK`` = the pod's replica index (workers:
  index + 1): the *pod's* node rank, which torchrun reads as ``--node-rank``;
  ``WORLD_SIZE`` = pods x ``nprocPerNode`` (1 when not a number; before v1.7: pods);
  ``PET_NPROC_PER_NODE`` = ``spec.nprocPerNode``; ``PET_NNODES`` = the pod count
  (elastic: ``MIN:MAX`` of the workers, with ``PET_RDZV_ENDPOINT`` =
  ``<job>-worker-0:<port>``, ``PET_RDZV_BACKEND`` = c10d, ``PET_RDZV_ID``,
  ``PET_RDZV_CONF``, ``PET_MAX_RESTARTS``). Operators before v1.7 set only
  ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` (pods).
- TrainJob, kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go`` (constants
  in ``pkg/constants/constants.go``): ``PET_NNODES`` = numNodes, ``PET_NPROC_PER_NODE``
  (a number, auto, cpu or gpu), ``PET_NODE_RANK`` = the pod's
  ``batch.kubernetes.io/job-completion-index``, ``PET_MASTER_ADDR`` =
  ``<trainjob>-node-0-0.<trainjob>`` (JobSet's name of pod 0), ``PET_MASTER_PORT`` =
  29500 (``ContainerTrainerPort``); no ``MASTER_ADDR``.
- JobSet, kubernetes-sigs/jobset ``pkg/controllers/jobset_controller.go``,
  ``pkg/util/placement/placement.go``, ``pkg/constants/constants.go``: sets no variable
  itself. Its pods are Indexed Job pods (Kubernetes sets ``JOB_COMPLETION_INDEX``), named
  ``<jobset>-<rjob>-<job index>-<pod index>`` and reachable as ``<that>.<subdomain>``
  (the headless service; subdomain defaults to the JobSet's name, not-ready addresses
  published by default). The restart attempt is the label and annotation
  ``jobset.sigs.k8s.io/restart-attempt``: a manifest exposes it with the downward API,
  here as ``JOBSET_RESTART_ATTEMPT`` (JobSet's own e2e test names it RESTART_ATTEMPT),
  and it becomes part of the run id, so that a restarted JobSet never meets the keys
  of the attempt before it (``DISTLAUNCH_STORE_TOKEN`` is used as it is, unmixed).

Sources in order (the first set wins; one line when a later one disagrees, as when a
flag disagrees with them: flags beat variables): nodes ``PET_NNODES``, else
``WORLD_SIZE`` (operators before v1.7); node rank ``PET_NODE_RANK``, ``RANK``,
``JOB_COMPLETION_INDEX``; workers per node ``PET_NPROC_PER_NODE``; master
``PET_MASTER_ADDR``, ``MASTER_ADDR`` (never 127.0.0.1 on a multi-node job: one line
instead); port ``PET_MASTER_PORT``, ``MASTER_PORT``, else 29500 (torchrun's). With a
rendezvous endpoint (elastic: ``PET_RDZV_ENDPOINT``) or --standalone, nothing is filled:
that is torchrun's c10d launch as given. The operators' RANK and WORLD_SIZE name the pod,
not a worker: the launcher sets both per worker (``env.build_worker_env``).

A pod's name resolves only once its pod exists: a node other than 0 waits for the
master's name (and every node for an elastic endpoint's host), saying so in one line,
for at most the join timeout (``--rdzv-conf join_timeout``, 600 s).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..env import lookup
from ..errors import ConfigError
from ..report import say
from . import AgentLaunch, EnginePlugin, Placement

if TYPE_CHECKING:
    from ..hosts import Host
    from ..run_options import RunOptions

__all__ = ["PLUGIN", "PodsPlugin", "Reading", "fill", "wait_resolvable"]

JOIN_TIMEOUT = 600.0  # seconds: NodeOptions.join_timeout's default (--rdzv-conf join_timeout)
DEFAULT_PORT = 29500  # torchrun's --master-port default
_RETRY = 1.0  # seconds between lookups of a name that does not resolve yet

# (variable, value) pairs for one option, the first set one first: what wins
Reading = list[tuple[str, str]]

# Any of these set in a pod: its operator started a distributed job.
_SIGNS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "MASTER_ADDR", "PET_RDZV_ENDPOINT")

# A launch of any of these options names the rendezvous itself: the pod's nodes and
# master are not filled (torchrun's c10d launch, e.g. PyTorchJob's elastic policy).
OWN_RENDEZVOUS = ("rdzv_endpoint", "standalone")


def inside_a_job(environ: Mapping[str, str]) -> bool:
    """True in a worker of a launcher (distlaunch's or torchrun's: TORCHELASTIC_RUN_ID is
    set for each): a launch from there is the program's own, and MASTER_ADDR, RANK and
    WORLD_SIZE are the outer job's, not an operator's."""
    return lookup("TORCHELASTIC_RUN_ID", environ) is not None


def read(environ: Mapping[str, str], *names: str) -> Reading:
    """The set, non-empty variables of ``names`` with their values, in that order."""
    return [(n, v.strip()) for n in names if (v := lookup(n, environ) or "").strip()]


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; fix the pod's manifest") from None


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def fill(
    readings: Mapping[str, Reading], options: Mapping[str, Any], given: frozenset[str]
) -> dict[str, Any]:
    """The value of each option of ``readings`` that the user did not give: its first
    reading. One line for each later reading that disagrees with the first, and for a
    given option whose value disagrees with it (the given one wins: flags beat
    variables). Values are strings, as on a command line. Pure but for those lines."""
    out: dict[str, Any] = {}
    for option, reading in readings.items():
        if not reading:
            continue
        (name, value), *others = reading
        for other, seen in others:
            if seen != value:
                say(f"{name}={value} wins over {other}={seen} (both give {_flag(option)})")
        if option not in given:
            out[option] = value
        elif str(options.get(option)) != value:
            say(f"{_flag(option)} {options.get(option)} wins over {name}={value}")
    return out


def wait_resolvable(host: str, timeout: float, what: str) -> None:
    """Block until ``host`` resolves (a pod's name exists once its pod does), for at most
    ``timeout`` seconds, trying every second; says once that it waits. Raises ConfigError
    (one line naming the host and where it came from) when it never resolves."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return
        except OSError as e:
            problem = e.strerror or str(e)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(
                f"{host} ({what}) did not resolve within {timeout:g} s ({problem}); check the name "
                f"and that its pod runs, or raise --rdzv-conf join_timeout"
            )
        if not said:
            say(f"waiting up to {timeout:g} s for {host} ({what}) to resolve: its pod may be starting")
            said = True
        time.sleep(min(_RETRY, left))


def join_timeout(options: Mapping[str, Any]) -> float:
    """--rdzv-conf's join timeout (torchrun's ``timeout`` too) in seconds, else 600."""
    from ..config import RDZV_ALIASES, parse_rdzv_conf

    for key, value in parse_rdzv_conf(options.get("rdzv_conf")):
        if RDZV_ALIASES.get(key, key) == "join_timeout":
            try:
                return float(value)
            except ValueError:
                break  # LaunchConfig's check says it in its line
    return JOIN_TIMEOUT


def endpoint_host(options: Mapping[str, Any]) -> str | None:
    """The host of --rdzv-endpoint HOST:PORT (brackets of IPv6 removed), if given."""
    text = options.get("rdzv_endpoint")
    if not text:
        return None
    host = str(text).rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host or None


def place_node(
    readings: Mapping[str, Reading],
    options: Mapping[str, Any],
    given: frozenset[str],
    run_id_parts: Sequence[str],
    master_hint: str,
    engine: str = "pods",
) -> dict[str, Any]:
    """The per-node options of a static job from ``readings`` (``fill``), the run id
    from ``engine``, the master's endpoint and ``run_id_parts`` (unless given), after waiting for
    the master's name on nodes other than 0. ``master_hint`` ends the line when a
    multi-node job has no master address. Raises ConfigError."""
    from ..config import run_id_from

    filled = fill(readings, options, given)
    for option in ("node_rank", "master_port"):  # click's types for these options
        if option in filled:
            filled[option] = _int(readings[option][0][0], filled[option])
    merged = {**options, **filled}
    nodes_text = str(merged.get("nnodes") or "1")
    nnodes = _int("the node count", nodes_text.partition(":")[0])
    node_rank = _int("the node rank", str(merged.get("node_rank") or 0))
    addr = merged.get("master_addr")
    if nnodes > 1 and not addr:
        raise ConfigError(
            f"this pod is node {node_rank} of {nnodes} but no variable names the master (node 0): "
            f"{master_hint}, or give --master-addr"
        )
    if nnodes <= 1:  # one node: its launcher's own store on loopback, as without a pod
        return {k: v for k, v in filled.items() if k == "nproc_per_node"}
    port = int(merged.get("master_port") or DEFAULT_PORT)
    if "run_id" not in given and "rdzv_id" not in given:
        filled["run_id"] = run_id_from("-".join([engine, str(addr), str(port), *run_id_parts]))
    if node_rank != 0:
        source = next((n for n, _ in readings.get("master_addr", ())), "--master-addr")
        wait_resolvable(str(addr), join_timeout(options), f"the master's address, from {source}")
    return filled


class PodsPlugin:
    """The Kubernetes pods engine in the registry (``engine.EnginePlugin``): "node" in a
    pod whose operator set the variables of a distributed job (see the module docstring)."""

    local_agent_in_process = True  # no agents: never asked
    fills_around_given = True  # PET_* reach the options as given ones

    def detect(self, environ: Mapping[str, str]) -> Placement | None:
        if lookup("KUBERNETES_SERVICE_HOST", environ) is None or inside_a_job(environ):
            return None
        # a JobSet sets nothing but the index (pod 0 too: its launcher must not bind
        # 127.0.0.1 while the others look for it)
        signs = read(environ, *_SIGNS)
        return "node" if signs or lookup("JOB_COMPLETION_INDEX", environ) is not None else None

    def check(self, environ: Mapping[str, str]) -> None:
        if self.detect(environ) is None:
            raise ConfigError(
                "--launcher pods needs a pod of a PyTorchJob, TrainJob or JobSet (KUBERNETES_SERVICE_HOST "
                "and PET_NNODES, PET_MASTER_ADDR or MASTER_ADDR set); drop --launcher pods here"
            )

    def node_options(
        self, environ: Mapping[str, str], options: Mapping[str, Any], given: frozenset[str]
    ) -> dict[str, Any]:
        """This pod's nodes, node rank, workers per node and master, from the operator's
        variables in the order the module docstring gives. Blocks while the master's name
        does not resolve (join timeout). Raises ConfigError: a multi-node job without a
        master address, a node count unknown to a pod other than 0, a bad number."""
        if given & set(OWN_RENDEZVOUS):
            host = endpoint_host(options)
            if host is not None:  # elastic: every launcher binds or reaches it
                wait_resolvable(host, join_timeout(options), "the rendezvous endpoint's host")
            return {}
        readings = {
            "nnodes": read(environ, "PET_NNODES"),
            "node_rank": read(environ, "PET_NODE_RANK", "RANK", "JOB_COMPLETION_INDEX"),
            "nproc_per_node": read(environ, "PET_NPROC_PER_NODE"),
            "master_addr": read(environ, "PET_MASTER_ADDR", "MASTER_ADDR"),
            "master_port": read(environ, "PET_MASTER_PORT", "MASTER_PORT"),
        }
        world = read(environ, "WORLD_SIZE")
        if world and not readings["nnodes"]:  # operators before v1.7: WORLD_SIZE = pods
            readings["nnodes"] = world
        elif world and readings["nnodes"]:
            _check_world_size(readings["nnodes"][0][1], world[0][1], readings["nproc_per_node"])
        if not readings["nnodes"] and "nnodes" not in given:
            rank = readings["node_rank"][0] if readings["node_rank"] else None
            if rank is not None and rank[1] != "0":
                raise ConfigError(
                    f"{rank[0]}={rank[1]} but no variable gives the node count: set PET_NNODES "
                    f"in the pod's manifest (the Job's parallelism), or give --nnodes"
                )
        attempt = read(environ, "JOBSET_RESTART_ATTEMPT")
        return place_node(
            readings,
            options,
            given,
            [f"attempt{attempt[0][1]}"] if attempt else [],
            f"set PET_MASTER_ADDR to pod 0's name, {_master_hint(environ)}",
        )

    def discover(self, opts: RunOptions, environ: Mapping[str, str]) -> list[Host]:
        raise ConfigError(NO_AGENTS.format(name="pods"))

    def engine(self) -> Any:
        raise ConfigError(NO_AGENTS.format(name="pods"))

    def describe(self, hosts: Mapping[int, Host], launch: AgentLaunch) -> str:
        raise ConfigError(NO_AGENTS.format(name="pods"))

    def agent_spec(self, message: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        raise ConfigError(NO_AGENTS.format(name="pods"))


# the per-node engines start no agents: -H with --launcher NAME has nothing to start them
NO_AGENTS = (
    "--launcher {name} runs one launcher per node and starts no agents: drop -H/--hostfile "
    "(run `distlaunch run` on every node) or use --launcher ssh"
)


def _check_world_size(nnodes: str, world: str, nproc: Reading) -> None:
    """PyTorchJob's WORLD_SIZE is pods x nprocPerNode (pods before v1.7): one line when it
    is neither (PET_NNODES wins)."""
    nodes = _int("PET_NNODES", nnodes.partition(":")[0])
    per = nproc[0][1] if nproc else "1"
    fits = {nodes, nodes * int(per)} if per.isdigit() else {nodes}
    if _int("WORLD_SIZE", world) not in fits:
        say(
            f"PET_NNODES={nnodes} wins over WORLD_SIZE={world} (the operator's pods x "
            f"workers per pod would be {' or '.join(map(str, sorted(fits)))})"
        )


def _master_hint(environ: Mapping[str, str]) -> str:
    """Pod 0's name as JobSet forms it from this pod's (``<jobset>-<rjob>-<job>-<pod>``)."""
    m = re.fullmatch(r"(.+)-\d+-\d+", lookup("HOSTNAME", environ) or "")
    if m:
        return f"e.g. {m.group(1)}-0-0.<subdomain> (JobSet's headless service; subdomain: the JobSet's name)"
    return "e.g. <job>-master-0 (PyTorchJob) or <jobset>-<rjob>-0-0.<jobset> (JobSet)"


PLUGIN: EnginePlugin = PodsPlugin()  # mypy checks it against the protocol
