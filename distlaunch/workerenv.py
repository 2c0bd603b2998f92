"""The builder half of the worker environment contract (``env.py`` holds the tables of
names and the reader): what a worker's environment is, from its identity and the
launcher's. Standard library only and no dataclasses: the single-node fast lane
(``quick.py``) builds its workers' environments before it imports anything else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from .agent.guard import OrphanGuard
    from .env import WorkerIdentity
    from .topology import WorkerSlot

# The host of a single node's store (it listens on loopback only; workers are told it).
STORE_HOST = "127.0.0.1"
MAX_RESTARTS = 10000  # --max-restarts' bound (TORCHELASTIC_MAX_RESTARTS)
# A worker's progress record (DISTLAUNCH_PROGRESS_FILE, read and written by ``progress``).
PROGRESS_SIZE = 128
PROGRESS_MAGIC = b"DLP1"

# Where the workers' shared-memory segments are (named after ``shm_prefix``).
SHM_DIR = "/dev/shm"


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in a Slurm job (``SLURM_JOB_ID`` set: an allocation's
    head, which starts its agents through srun, or a step's task), where the fast lane
    (``quick.start``) declines. The one rule for both: the head need not load the lane
    there. Pure."""
    return "SLURM_JOB_ID" in environ


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """True in a task started by ``srun`` (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set;
    a batch script or salloc's shell has no ``SLURM_STEP_ID``). Here, below ``env``
    (which re-exports it): a Slurm agent's signal relay asks it before its workers'
    spawn. Pure."""
    env = os.environ if environ is None else environ
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def shm_prefix(run_id: str, agent_pid: int, rnd: int | None = None) -> str:
    """Name prefix of the shared-memory segments of one agent's workers (in one round)."""
    return f"distlaunch_{run_id}_{agent_pid}_" + ("" if rnd is None else f"r{rnd}_")


def make_scratch(run_id: str, guard: OrphanGuard) -> str:
    """This agent's new private directory ``distlaunch_<run id>_XXXXXXXX`` (workers'
    error and progress files) in the first temporary directory that takes it, in
    ``tempfile.gettempdir``'s order ($TMPDIR, $TEMP, $TMP, /tmp, /var/tmp, /usr/tmp, the
    working directory); it and the agent's shared-memory segments are the guard's to
    remove if the agent dies. Raises FileNotFoundError as ``tempfile.mkdtemp`` does when
    none takes it. (Not ``tempfile``: it and what it loads cost ~5 ms before the fast
    lane's first spawn.)"""
    dirs = [d for d in (os.environ.get(n) for n in ("TMPDIR", "TEMP", "TMP")) if d]
    dirs += ["/tmp", "/var/tmp", "/usr/tmp"]
    try:
        dirs.append(os.getcwd())
    except OSError:  # the working directory was removed (as tempfile skips it)
        pass
    for d in dirs:
        for _ in range(10):
            path = os.path.abspath(os.path.join(d, f"distlaunch_{run_id}_{os.urandom(4).hex()}"))
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            except OSError:
                break
            guard.clean_up(guard.literal(path))  # (a pattern: $TMPDIR may hold "[")
            guard.clean_up(os.path.join(SHM_DIR, shm_prefix(run_id, os.getpid())) + "*")
            return path
    raise FileNotFoundError(2, f"No usable temporary directory found in {dirs}")


# mpirun front ends (Open MPI, MPICH/Intel MPI). Never PMIX_*, PMI_FD, PMI_PORT or
# PRTE_LAUNCHED: those make a real MPI library try to contact a PMI server and fail.
MPI_VARS = {
    "OMPI_COMM_WORLD_RANK": "RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_NODE_RANK": "GROUP_RANK",
    "PMI_RANK": "RANK",
    "PMI_SIZE": "WORLD_SIZE",
    "MPI_LOCALRANKID": "LOCAL_RANK",
    "MPI_LOCALNRANKS": "LOCAL_WORLD_SIZE",
}

# Inherited variables from other launchers / schedulers that would be wrong in a worker.
# The Slurm task variables of the agent's own srun step (one task per node) are removed,
# not rewritten: Lightning and submitit read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and
# would all take themselves for rank 0; without them they use the torchrun variables.
# Job-level variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURMD_NODENAME) stay: true
# for the worker too.
STALE_VARS = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_GTIDS",
    "SLURM_TASK_PID",
    "PMI_FD",
    "PMI_PORT",
    "PMI_ID",
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "PMIX_SERVER_URI2",
    "PMIX_SERVER_URI3",
    "PMIX_SERVER_URI4",
    "PMIX_SERVER_URI21",
    "PMIX_SECURITY_MODE",
    "PRTE_LAUNCHED",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_NODE_RANK",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
)


def omp_notice(count: int) -> str:
    """What the launcher says when it sets ``OMP_NUM_THREADS=1`` for ``count`` workers
    of a node (torchrun says as much), once per launch: the fast lane or the launcher."""
    return (
        f"setting OMP_NUM_THREADS=1 for each of the {count} workers "
        f"on this node; set it yourself to choose another value"
    )


def build_worker_env(
    ident: WorkerIdentity,
    base: Mapping[str, str],
    error_file: str | None = None,
    set_omp_threads: bool = False,
) -> dict[str, str]:
    """Return the full environment for one worker: ``base`` cleaned of stale launcher
    variables, plus the torchrun, MPI-style and ``DISTLAUNCH_*`` names of ``ident``.

    ``set_omp_threads`` sets ``OMP_NUM_THREADS=1`` when ``base`` has none (torchrun does
    the same when several workers share a node).
    """
    env = {k: v for k, v in base.items() if k not in STALE_VARS and not k.startswith("PMIX_")}
    values = {
        "RANK": ident.rank,
        "LOCAL_RANK": ident.local_rank,
        "WORLD_SIZE": ident.world_size,
        "LOCAL_WORLD_SIZE": ident.local_world_size,
        "GROUP_RANK": ident.node_rank,
        "GROUP_WORLD_SIZE": ident.num_nodes,
        "ROLE_RANK": ident.rank,
        "ROLE_NAME": ident.role,
        "ROLE_WORLD_SIZE": ident.world_size,
        "MASTER_ADDR": ident.master_addr,
        "MASTER_PORT": ident.master_port,
        "TORCHELASTIC_RESTART_COUNT": ident.restart_count,
        "TORCHELASTIC_MAX_RESTARTS": ident.max_restarts,
        "TORCHELASTIC_RUN_ID": ident.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(ident.agent_store),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "DISTLAUNCH_RUN_ID": ident.run_id,
        "DISTLAUNCH_NODE_ID": ident.node_id,
    }
    for mpi_name, source in MPI_VARS.items():
        values[mpi_name] = values[source]
    if ident.shm_prefix is not None:
        values["DISTLAUNCH_SHM_PREFIX"] = ident.shm_prefix
    else:
        env.pop("DISTLAUNCH_SHM_PREFIX", None)
    if ident.progress_file is not None:
        values["DISTLAUNCH_PROGRESS_FILE"] = ident.progress_file
    else:
        env.pop("DISTLAUNCH_PROGRESS_FILE", None)
    if ident.store_port is not None:
        values["DISTLAUNCH_STORE_ADDR"] = ident.store_addr
        values["DISTLAUNCH_STORE_PORT"] = ident.store_port
        values["DISTLAUNCH_STORE_TOKEN"] = ident.store_token or ""
    else:
        for name in ("DISTLAUNCH_STORE_ADDR", "DISTLAUNCH_STORE_PORT", "DISTLAUNCH_STORE_TOKEN"):
            env.pop(name, None)
    if error_file is not None:
        values["TORCHELASTIC_ERROR_FILE"] = error_file
    else:
        env.pop("TORCHELASTIC_ERROR_FILE", None)
    if set_omp_threads and "OMP_NUM_THREADS" not in base:
        values["OMP_NUM_THREADS"] = 1
    env.update((k, str(v)) for k, v in values.items())
    return env


def slot_env(
    slot: WorkerSlot,
    base: Mapping[str, str],
    *,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    role: str,
    master: tuple[str, int],
    store: tuple[str, int, str] | None,
    error_file: str | None,
    shm: str | None,
    agent_store: bool,
    progress_file: str | None,
    python: bool,
) -> dict[str, str]:
    """The environment of the worker in ``slot`` (``build_worker_env`` of its identity;
    ``store``: host, port and secret, None without the store's variables; ``python``:
    the worker is a Python interpreter, told not to hold its prints, since it writes to
    pipes). One place for the launcher (``specs.worker_env``) and the fast lane, which
    passes anything with a ``WorkerSlot``'s fields."""
    from types import SimpleNamespace  # (WorkerIdentity is a dataclass: not this early)

    ident = SimpleNamespace(
        rank=slot.rank,
        local_rank=slot.local_rank,
        world_size=slot.world_size,
        local_world_size=slot.local_world_size,
        node_rank=slot.node_rank,
        num_nodes=slot.num_nodes,
        node_id=str(slot.node_rank),
        run_id=run_id,
        restart_count=restart_count,
        max_restarts=max_restarts,
        role=role,
        master_addr=master[0],
        master_port=master[1],
        store_addr=store[0] if store else None,
        store_port=store[1] if store else None,
        store_token=store[2] if store else None,
        shm_prefix=shm,
        agent_store=agent_store,
        progress_file=progress_file,
    )
    i: WorkerIdentity = ident  # type: ignore[assignment]
    env = build_worker_env(i, base, error_file, set_omp_threads=slot.local_world_size > 1)
    if python:
        env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def create_progress(path: str) -> None:
    """Create (or reset) a zeroed progress record at ``path`` (mode 0600) for one worker
    (``progress.create``). Raises OSError."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, PROGRESS_MAGIC + bytes(PROGRESS_SIZE - len(PROGRESS_MAGIC)))
    finally:
        os.close(fd)
