"""The head: plans the job, hosts the store, runs the local agent and reports the result.

Single node for now (``--nnodes 1``). Order matters at start-up: the orphan guard is
forked before the store's thread starts (forking a threaded process is unsafe).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

from .agent.group import LaunchSpec
from .agent.guard import OrphanGuard
from .agent.local import supervise
from .agent.output import StreamSink
from .config import STD_ERR, STD_OUT, LaunchConfig
from .env import WorkerIdentity, build_worker_env
from .errors import ConfigError
from .topology import WorkerSlot, assign_ranks

STORE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Plan:
    """The resolved job: who runs what, with which ranks."""

    cfg: LaunchConfig
    slots: list[WorkerSlot]  # this node's workers
    argv: list[str]
    master_addr: str
    master_port: int

    def identity(self, slot: WorkerSlot, restart_count: int, store_port: int | None,
                 token: str | None) -> WorkerIdentity:
        c = self.cfg
        return WorkerIdentity(
            rank=slot.rank, local_rank=slot.local_rank, world_size=slot.world_size,
            local_world_size=slot.local_world_size, node_rank=slot.node_rank,
            num_nodes=slot.num_nodes, node_id=str(slot.node_rank), run_id=c.run_id,
            restart_count=restart_count, max_restarts=c.max_restarts, role=c.role,
            master_addr=self.master_addr, master_port=self.master_port,
            store_addr=STORE_HOST if store_port else None, store_port=store_port,
            store_token=token)

    def worker_env(self, slot: WorkerSlot, restart_count: int = 0, store_port: int | None = None,
                   token: str | None = None, error_file: str | None = None,
                   base: dict[str, str] | None = None) -> dict[str, str]:
        env = build_worker_env(self.identity(slot, restart_count, store_port, token),
                               os.environ if base is None else base, error_file,
                               set_omp_threads=self.cfg.nproc_per_node > 1)
        if not self.cfg.no_python:
            # Workers write to pipes; without this Python holds their prints until exit.
            env.setdefault("PYTHONUNBUFFERED", "1")
        return env


def worker_argv(cfg: LaunchConfig) -> list[str]:
    if cfg.no_python:
        return [cfg.entrypoint, *cfg.args]
    if cfg.module:
        return [sys.executable, "-m", cfg.entrypoint, *cfg.args]
    return [sys.executable, cfg.entrypoint, *cfg.args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"--master-port {port} is already in use on this node; "
                                  f"choose another port or omit it to pick a free one") from None
            raise ConfigError(f"--master-port {port} cannot be bound ({e.strerror})") from None


def make_plan(cfg: LaunchConfig) -> Plan:
    """Resolve ranks, the worker command line and MASTER_ADDR/MASTER_PORT. Raises
    ConfigError when ``--master-port`` is taken."""
    if cfg.master_port is not None:
        _check_port_free(cfg.master_port)
    nodes = assign_ranks([cfg.nproc_per_node] * cfg.nnodes)
    return Plan(cfg, nodes[cfg.node_rank], worker_argv(cfg), cfg.master_addr or "localhost",
                cfg.master_port or _free_port())


class _Outputs:
    """Where each worker stream goes, per torchrun's --redirects/--tee and --log-dir."""

    def __init__(self, cfg: LaunchConfig, log_root: str | None):
        self.cfg = cfg
        self.log_root = log_root

    def sinks(self, slot: WorkerSlot, attempt_dir: str | None) -> tuple[StreamSink, StreamSink]:
        cfg, lr = self.cfg, slot.local_rank
        redirected = cfg.redirects.for_rank(lr)
        shown = cfg.local_ranks_filter is None or lr in cfg.local_ranks_filter
        prefix = f"[{slot.rank}]: ".encode() if cfg.prefix else b""
        out = []
        for bit, fd, name in ((STD_OUT, 1, "stdout"), (STD_ERR, 2, "stderr")):
            console = fd if shown and not redirected & bit else None
            log = os.path.join(attempt_dir, f"{name}.log") if attempt_dir else None
            out.append(StreamSink(prefix, console, log, keep_tail=fd == 2))
        return out[0], out[1]


def run(cfg: LaunchConfig, on_event: Callable[[str], None], plan: Plan | None = None) -> int:
    """Run the job to the end; return the number of restarts it took.

    Blocks. Raises WorkerFailedError, LaunchInterrupted, SpawnError or ConfigError (see
    ``supervise``); the store and the orphan guard are stopped in every case.
    """
    from .store import StoreServer  # not needed by --dry-run

    plan = plan or make_plan(cfg)
    log_root = None
    if cfg.log_dir:
        log_root = os.path.join(cfg.log_dir, cfg.run_id)
    elif cfg.redirects.any or cfg.tee.any:
        log_root = tempfile.mkdtemp(prefix=f"distlaunch_{cfg.run_id}_")
        on_event(f"worker logs go to {log_root}")
    scratch = tempfile.mkdtemp(prefix=f"distlaunch_{cfg.run_id}_err_")
    outputs = _Outputs(cfg, log_root)
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        on_event(f"setting OMP_NUM_THREADS=1 for each of the {cfg.nproc_per_node} workers "
                 f"on this node; set it yourself to choose another value")
    token = os.urandom(16).hex()
    guard = OrphanGuard()
    store = None
    try:
        store = StoreServer(STORE_HOST, 0, token=token)
        store.start()

        def build_specs(restart_count: int) -> list[LaunchSpec]:
            specs = []
            for slot in plan.slots:
                attempt_dir = None
                if log_root:
                    attempt_dir = os.path.join(log_root, f"attempt_{restart_count}", str(slot.rank))
                    os.makedirs(attempt_dir, exist_ok=True)
                error_file = os.path.join(scratch, f"error_{restart_count}_{slot.rank}.json")
                env = plan.worker_env(slot, restart_count, store.port, token, error_file)
                out, err = outputs.sinks(slot, attempt_dir)
                specs.append(LaunchSpec(slot, plan.argv, env, out, err, error_file))
            return specs

        return supervise(build_specs, cfg.max_restarts, cfg.stop_timeout, guard, on_event)
    finally:
        if store is not None:
            store.stop()
        guard.close()
        shutil.rmtree(scratch, ignore_errors=True)
