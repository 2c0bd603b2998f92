"""The worker environment contract: one table of names, a builder (launcher side) and a
reader (worker side).

Names and meanings follow torchrun (``torch.distributed.run``) so that unmodified
``torch.distributed`` programs using ``init_method="env://"`` work. In per-node static
launches ``MASTER_PORT`` is the agents' store, which also serves torch's TCPStore protocol,
and ``TORCHELASTIC_USE_AGENT_STORE`` is ``True`` (torchrun's one port per job); elsewhere it
is ``False``: ``MASTER_PORT`` is left free and rank 0's torch binds it, as with a plain
``env://`` launch. distlaunch's own store is announced under ``DISTLAUNCH_*``.

This module is imported by workers (``distlaunch.collectives``): keep it to the standard
library.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import ConfigError
from .hostlist import expand_hostlist, parse_tasks_per_node

# the builder and its two tables live in workerenv (no dataclasses: the fast lane uses them)
from .workerenv import MPI_VARS as MPI_VARS
from .workerenv import STALE_VARS as STALE_VARS
from .workerenv import build_worker_env as build_worker_env
from .workerenv import in_slurm_step as in_slurm_step

# name -> meaning. The builder sets every one of these (OMP_NUM_THREADS only when unset).
TORCHRUN_VARS = {
    "RANK": "global rank of the worker, 0..WORLD_SIZE-1",
    "LOCAL_RANK": "rank of the worker on its node, 0..LOCAL_WORLD_SIZE-1",
    "WORLD_SIZE": "number of workers in the job",
    "LOCAL_WORLD_SIZE": "number of workers on this node",
    "GROUP_RANK": "node rank (rank of this node's agent)",
    "GROUP_WORLD_SIZE": "number of nodes",
    "ROLE_RANK": "rank among workers of the same role (one role: equals RANK)",
    "ROLE_NAME": "the role (--role, default 'default')",
    "ROLE_WORLD_SIZE": "number of workers of the same role",
    "MASTER_ADDR": "address of rank 0's node, for the program's own rendezvous",
    "MASTER_PORT": "a port free for the program's own use on rank 0's node",
    "TORCHELASTIC_RESTART_COUNT": "how many times the worker group was restarted",
    "TORCHELASTIC_MAX_RESTARTS": "--max-restarts",
    "TORCHELASTIC_RUN_ID": "the run id (--run-id)",
    "TORCHELASTIC_USE_AGENT_STORE": "True in per-node static launches, where MASTER_PORT is the "
    "store's port serving torch's TCPStore protocol (torchrun's one port per job); else False: "
    "MASTER_PORT is free and torch's rank 0 hosts its own store",
    "TORCHELASTIC_ERROR_FILE": "where torch's @record writes a structured error (read for the summary)",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "signals torch's elastic code handles",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "passed through, default 1 (as torchrun)",
}

DISTLAUNCH_VARS = {
    "DISTLAUNCH_STORE_ADDR": "host of distlaunch's key-value store",
    "DISTLAUNCH_STORE_PORT": "port of distlaunch's key-value store",
    "DISTLAUNCH_STORE_TOKEN": "the job's secret for the store (environment only, never argv)",
    "DISTLAUNCH_RUN_ID": "the run id; namespaces store keys and shared-memory names",
    "DISTLAUNCH_NODE_ID": "identity of this node as assigned by the launcher (not a hostname)",
    "DISTLAUNCH_SHM_PREFIX": "name prefix (under /dev/shm) for every shared-memory segment the "
    "workers of this node create in this round; the launcher removes "
    "prefix* when the round ends and after a crash",
    "DISTLAUNCH_PROGRESS_FILE": "this worker's progress record (distlaunch.progress: heartbeat() and "
    "the operation in flight), read by its agent for --hang-timeout and `distlaunch top`",
}

# Settings the user may give workers; read once by init_process_group
# (distlaunch.collectives), never set by the launcher.
COLLECTIVES_VARS = {
    "DISTLAUNCH_SHM": "0 disables the shared-memory collectives (TCP only)",
    "DISTLAUNCH_SHM_SLOT": "bytes per shared-memory data buffer (default 4 MiB)",
    "DISTLAUNCH_SHM_CHUNK": "bytes per chunk of a large shared-memory all_reduce (default 2 MiB)",
    "DISTLAUNCH_SHM_SPIN": "counter checks before a shared-memory waiter sleeps (default 400)",
    "DISTLAUNCH_SHM_YIELD": "0: spin without sched_yield while waiting on shared memory",
    "DISTLAUNCH_COLL_HOST": "address the collectives transport listens on (default: the one "
    "routing to the store)",
}

# Read by per-node launchers and by env:// / tcp:// init (distlaunch.secret).
SECRET_VARS = {
    "DISTLAUNCH_STORE_TOKEN_FILE": "a file (yours, mode 600) holding the store secret",
    "XDG_CONFIG_HOME": "where the per-user secret file lives (distlaunch/secret below it)",
    "XDG_RUNTIME_DIR": "where this user's running jobs are listed for ps/top/stacks (else XDG_CONFIG_HOME)",
}

# Read by init_process_group() when no launcher set RANK/WORLD_SIZE: processes started
# by srun or mpiexec (``scheduler_identity``). Slurm's names are srun's output environment
# (srun(1)); MPICH's hydra and Open MPI's mpirun set the MPI ones.
SCHEDULER_VARS = {
    "SLURM_PROCID": "srun: the task's global rank -> rank",
    "SLURM_STEP_NUM_TASKS": "srun: tasks in the step -> world size (else SLURM_NTASKS)",
    "SLURM_NTASKS": "srun: tasks in the step, when SLURM_STEP_NUM_TASKS is not set",
    "SLURM_LOCALID": "srun: the task's rank on its node -> local rank",
    "SLURM_STEP_TASKS_PER_NODE": "srun: tasks per node of the step ('2(x3),1') -> local world size",
    "SLURM_NODEID": "srun: the node's index in the step",
    "SLURMD_NODENAME": "srun: the Slurm node's name -> node identity (shared memory between tasks "
    "of one Slurm node only, even with several slurmd on one machine)",
    "SLURM_STEP_NODELIST": "srun: the step's nodes; its first node hosts the store (rank 0 runs there)",
    "SLURM_JOB_ID": "srun: with SLURM_STEP_ID, the store port (unless MASTER_PORT) and the token's context",
    "SLURM_STEP_ID": "srun: the step id (set only inside a step started by srun: the detection)",
    "PMI_RANK": "MPICH hydra / Intel MPI: rank",
    "PMI_SIZE": "MPICH hydra / Intel MPI: world size",
    "MPI_LOCALRANKID": "MPICH hydra: local rank",
    "MPI_LOCALNRANKS": "MPICH hydra: ranks on this host",
    "PMI_HOSTNAME": "MPICH hydra: this host's name -> node identity",
    "OMPI_COMM_WORLD_RANK": "Open MPI: rank",
    "OMPI_COMM_WORLD_SIZE": "Open MPI: world size",
    "OMPI_COMM_WORLD_LOCAL_RANK": "Open MPI: local rank",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "Open MPI: ranks on this host",
    "MASTER_ADDR": "overrides where the store is (srun: the first node of the step; mpiexec: "
    "127.0.0.1 when every rank is on this host, else required)",
    "MASTER_PORT": "overrides the store's port (srun: 20000 + (16 * job id + step id) mod 6000; "
    "mpiexec: 26000 + the parent process id (hydra's proxy, Open MPI's daemon) mod 6000)",
}

# Read by the launcher and its engines (never set by distlaunch for workers).
LAUNCHER_VARS = {
    "CUDA_VISIBLE_DEVICES": "the NVIDIA GPUs this launch may use (counted, placed per rank: devices.py)",
    "HIP_VISIBLE_DEVICES": "AMD: the GPUs this launch may use (after CUDA_VISIBLE_DEVICES)",
    "ROCR_VISIBLE_DEVICES": "AMD: the GPUs this launch may use (after HIP_VISIBLE_DEVICES)",
    "OMP_NUM_THREADS": "unset with several workers per node: each worker gets 1 (said once), as torchrun",
    "PYTHON_EXEC": "the workers' interpreter (torchrun's override; default: the launcher's)",
    "SLURM_JOB_ID": "a Slurm allocation: without a host list the head starts agents through srun",
    "SLURM_JOB_NODELIST": "the allocation's nodes (SLURM_NODELIST on older releases)",
    "SLURM_NODELIST": "the allocation's nodes, older releases",
    "SLURM_NTASKS_PER_NODE": "slots per node of the allocation (before SLURM_TASKS_PER_NODE)",
    "SLURM_TASKS_PER_NODE": "slots per node of the allocation ('2(x3),1')",
    "DISTLAUNCH_LAUNCH_PORT": "distlaunch.launch(): the caller's store port, for its workers",
    "DISTLAUNCH_LAUNCH_TOKEN": "distlaunch.launch(): the caller's store secret, for its workers",
    "DISTLAUNCH_SYSFS_ROOT": "for tests only: a directory tree read instead of / for GPUs "
    "(proc/driver/nvidia) and NUMA (sys/...); NVML is then not asked",
    "ZE_AFFINITY_MASK": "Intel Level Zero's visible devices: counted by --nproc-per-node xpu",
    "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "torchrun's output line prefix, with ${rank}, "
    "${local_rank} and ${role_name} (default [RANK]: )",
}


# Read by the per-node engines of Kubernetes pods and SkyPilot nodes (engine/pods.py,
# engine/skypilot.py: each names the operator source it follows); never set by distlaunch.
POD_VARS = {
    "KUBERNETES_SERVICE_HOST": "set by Kubernetes in every container: this launcher runs in a pod",
    "PET_NNODES": "PyTorchJob / TrainJob: the node (pod) count, or MIN:MAX (elastic)",
    "PET_NODE_RANK": "PyTorchJob / TrainJob: this pod's node rank",
    "PET_NPROC_PER_NODE": "PyTorchJob / TrainJob: workers per pod (a number, auto, cpu, gpu)",
    "PET_MASTER_ADDR": "PyTorchJob (since 1.7) / TrainJob: pod 0's name; wins over MASTER_ADDR",
    "PET_MASTER_PORT": "PyTorchJob (since 1.7) / TrainJob: node 0's port; wins over MASTER_PORT",
    "PET_RDZV_ENDPOINT": "PyTorchJob elastic: HOST:PORT of the c10d rendezvous",
    "JOB_COMPLETION_INDEX": "Kubernetes Indexed Job (JobSet, TrainJob): this pod's index -> node rank",
    "JOBSET_RESTART_ATTEMPT": "JobSet: the jobset.sigs.k8s.io/restart-attempt label, given by the manifest "
    "through the downward API; part of the run id",
    "HOSTNAME": "a pod's name (JobSet: <jobset>-<rjob>-<job index>-<pod index>), for hints",
    "SKYPILOT_NODE_RANK": "SkyPilot: this node's rank",
    "SKYPILOT_NODE_IPS": "SkyPilot: the nodes' addresses, one a line, the head (rank 0) first",
    "SKYPILOT_NUM_NODES": "SkyPilot: the node count",
    "SKYPILOT_NUM_GPUS_PER_NODE": "SkyPilot: GPUs per node -> workers per node when more than 0",
    "SKYPILOT_TASK_ID": "SkyPilot: the task's id (the same on every node) -> the run id",
}


@dataclass(frozen=True)
class WorkerIdentity:
    """Everything the launcher tells one worker about itself and the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    node_id: str
    run_id: str
    restart_count: int = 0
    max_restarts: int = 0
    role: str = "default"
    master_addr: str = "localhost"
    master_port: int = 29500
    store_addr: str | None = None
    store_port: int | None = None
    store_token: str | None = None
    shm_prefix: str | None = None
    # MASTER_PORT is the agents' store, which also serves torch's TCPStore protocol
    # (per-node static launches, as torchrun's agent store)
    agent_store: bool = False
    progress_file: str | None = None  # DISTLAUNCH_PROGRESS_FILE (distlaunch.progress)


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(
                f"environment variable {name} is not set; start the program with 'distlaunch run' or set it"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def read_worker_env(environ: Mapping[str, str] | None = None) -> WorkerIdentity:
    """Read a worker's identity from its environment (``os.environ`` by default).

    Requires RANK and WORLD_SIZE; the rest default as for a single-node job (local rank =
    rank, one node). The store fields are None when no ``DISTLAUNCH_STORE_PORT`` is set.
    Raises ConfigError naming a missing or non-integer variable.
    """
    e = os.environ if environ is None else environ
    rank = _int(e, "RANK")
    world_size = _int(e, "WORLD_SIZE")
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size})")
    node_rank = _int(e, "GROUP_RANK", 0)
    store_port = e.get("DISTLAUNCH_STORE_PORT")
    return WorkerIdentity(
        rank=rank,
        local_rank=_int(e, "LOCAL_RANK", rank),
        world_size=world_size,
        local_world_size=_int(e, "LOCAL_WORLD_SIZE", world_size),
        node_rank=node_rank,
        num_nodes=_int(e, "GROUP_WORLD_SIZE", 1),
        node_id=e.get("DISTLAUNCH_NODE_ID", str(node_rank)),
        run_id=e.get("DISTLAUNCH_RUN_ID", e.get("TORCHELASTIC_RUN_ID", "none")),
        restart_count=_int(e, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_int(e, "TORCHELASTIC_MAX_RESTARTS", 0),
        role=e.get("ROLE_NAME", "default"),
        master_addr=e.get("MASTER_ADDR", "localhost"),
        master_port=_int(e, "MASTER_PORT", 29500),
        store_addr=e.get("DISTLAUNCH_STORE_ADDR") if store_port else None,
        store_port=int(store_port) if store_port else None,
        store_token=e.get("DISTLAUNCH_STORE_TOKEN") if store_port else None,
        shm_prefix=e.get("DISTLAUNCH_SHM_PREFIX"),
    )


@dataclass(frozen=True)
class SchedulerIdentity:
    """A process started by srun or mpiexec rather than a launcher (``scheduler_identity``)."""

    source: str  # "slurm" or "mpi"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_id: str  # processes with the same node id share memory
    store_host: str | None  # MASTER_ADDR, else 127.0.0.1 (mpi, one host), else None
    store_node: str | None  # slurm: the step's first node, whose address hosts the store
    store_port: int
    context: str  # public, separates jobs in the store token (secret.shared_token)


TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import TypeVar

    T = TypeVar("T")
# Store ports derived when nothing names one, below Linux's ephemeral ports (32768-60999);
# srun's and mpiexec's halves are disjoint, so a Slurm step and an mpiexec job that share
# a node never derive the same port.
SLURM_PORTS, MPI_PORTS = range(20000, 26000), range(26000, 32000)


def lookup(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of variable ``name`` in ``environ`` (default os.environ), None when
    unset. Every variable distlaunch reads by name goes through here, so that each has a
    row in one of this module's tables; KeyError for a name in none (a programming
    error, found by the first test that reads it)."""
    if name not in _KNOWN:
        raise KeyError(f"{name} is in no table of distlaunch.env; add it where it belongs")
    e = os.environ if environ is None else environ
    return e.get(name)


def python_exec(environ: Mapping[str, str] | None = None) -> str:
    """The interpreter that runs the workers' scripts: ``PYTHON_EXEC`` when set (torchrun's
    override, read on each node), else this interpreter (``sys.executable``)."""
    return lookup("PYTHON_EXEC", environ) or sys.executable


def resolver_name(host: str) -> bytes:
    """``host`` as socket's resolvers (getaddrinfo, gethostbyname, create_connection)
    should get it: bytes, ASCII as it is. A str would make them import the idna codec
    (~3 ms of CPU, which every agent would pay for "127.0.0.1"). Raises socket.gaierror
    (an OSError, as the resolvers raise for a bad name) for a name IDNA cannot encode,
    where they would raise UnicodeError."""
    try:
        return host.encode("ascii") if host.isascii() else host.encode("idna")
    except UnicodeError as e:
        raise socket.gaierror(socket.EAI_FAIL, f"{host!r} is not a valid host name ({e})") from None


def route_source(host: str) -> str | None:
    """This machine's address on the route to ``host``: 127.0.0.1 for a loopback host,
    else the route's source address (a UDP connect picks the route and sends nothing);
    None when ``host`` does not resolve or has no route. Blocks on name resolution."""
    try:
        addr = socket.gethostbyname(resolver_name(host))  # type: ignore[arg-type]  # it takes bytes
        if addr.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def scheduler_identity(environ: Mapping[str, str] | None = None) -> SchedulerIdentity | None:
    """The rank, world size, node and store location of a process that srun (a step:
    SLURM_STEP_ID and SLURM_PROCID set) or mpiexec (PMI_RANK/PMI_SIZE: MPICH hydra,
    Intel MPI; OMPI_COMM_WORLD_RANK/SIZE: Open MPI) started, or None when neither did.
    See SCHEDULER_VARS for every variable read and the defaults. Pure. Raises
    ConfigError for a malformed variable, or for mpiexec across hosts without
    MASTER_ADDR."""
    e = os.environ if environ is None else environ
    port = _int(e, "MASTER_PORT", 0) or None
    if in_slurm_step(e):
        job, step = _int(e, "SLURM_JOB_ID"), _int(e, "SLURM_STEP_ID")
        nodes = _parse(expand_hostlist, e, "SLURM_STEP_NODELIST")
        world = _int(e, "SLURM_STEP_NUM_TASKS", _int(e, "SLURM_NTASKS", 0) or None)
        per_node = _parse(parse_tasks_per_node, e, "SLURM_STEP_TASKS_PER_NODE")
        node_index = _int(e, "SLURM_NODEID")
        if not nodes or not 0 <= node_index < len(per_node):
            raise ConfigError(f"SLURM_NODEID={node_index} is not a node of SLURM_STEP_NODELIST")
        return SchedulerIdentity(
            source="slurm",
            rank=_int(e, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(e, "SLURM_LOCALID"),
            local_world_size=per_node[node_index],
            node_id=f"slurm:{e.get('SLURMD_NODENAME') or nodes[node_index]}",
            store_host=e.get("MASTER_ADDR") or None,
            store_node=nodes[0],
            store_port=port or SLURM_PORTS[(16 * job + step) % len(SLURM_PORTS)],
            context=f"slurm:{job}.{step}",
        )
    for rank_var, size_var, local, local_size in (
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
    ):
        if rank_var in e and size_var in e:
            rank, world = _int(e, rank_var), _int(e, size_var)
            local_world = _int(e, local_size, world)
            host = e.get("MASTER_ADDR") or None
            if host is None and local_world != world:
                raise ConfigError(
                    f"mpiexec started ranks on several hosts ({size_var}={world}, {local_world} here): "
                    f"set MASTER_ADDR (and MASTER_PORT) to rank 0's host for the store"
                )
            port = port or MPI_PORTS[os.getppid() % len(MPI_PORTS)]
            return SchedulerIdentity(
                source="mpi",
                rank=rank,
                world_size=world,
                local_rank=_int(e, local, rank),
                local_world_size=local_world,
                node_id=f"mpi:{e.get('PMI_HOSTNAME') or socket.gethostname()}",
                store_host=host or "127.0.0.1",
                store_node=None,
                store_port=port,
                context=f"port:{port}",
            )
    return None


def _parse(fn: Callable[[str], list[T]], e: Mapping[str, str], name: str) -> list[T]:
    try:
        return fn(e.get(name, ""))
    except ValueError as err:
        raise ConfigError(f"environment variable {name}: {err}") from None


def slurm_node_addresses(names: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each Slurm node's address as Slurm knows it (``NodeAddr`` of ``scontrol show
    node``; nodes need no DNS name). Blocks (one scontrol call). Raises ConfigError when
    scontrol fails or omits a node."""
    import re
    import subprocess  # only where Slurm nodes are looked up

    try:
        cp = subprocess.run(
            ["scontrol", "show", "node", "-o", ",".join(names)],
            capture_output=True,
            text=True,
            timeout=30,
            env=None if env is None else dict(env),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"cannot ask Slurm for the nodes' addresses (scontrol: {e})") from None
    found = {}
    for line in cp.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            found[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    missing = [n for n in names if n not in found]
    if missing:
        why = cp.stderr.strip().splitlines()[-1:] or ["not found"]
        raise ConfigError(f"scontrol show node {','.join(missing)}: {why[0]}")
    return {n: found[n] for n in names}


def slurm_node_address(name: str) -> str:
    """Where Slurm node ``name`` is reached: the name itself when it resolves (the usual
    case), else its NodeAddr (``slurm_node_addresses``). Blocks. Raises ConfigError."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return slurm_node_addresses([name])[name]


_KNOWN = frozenset(
    {
        *TORCHRUN_VARS,
        *MPI_VARS,
        *DISTLAUNCH_VARS,
        *COLLECTIVES_VARS,
        *SECRET_VARS,
        *SCHEDULER_VARS,
        *LAUNCHER_VARS,
        *POD_VARS,
    }
)
