"""What each worker of a round is started with: its command line, its environment, where
its output goes (``LaunchSpec``). The node agent builds a round's specs here; so does the
single-node launcher for its first round, before the rest of the agent (rendezvous,
observer, events) is imported: this module imports only what starting a worker needs.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from .. import progress, workerenv
from ..config import STD_ERR, STD_OUT, LaunchConfig
from ..env import lookup, python_exec
from ..errors import LaunchInterrupted
from ..numa import rank_bindings
from ..topology import WorkerSlot
from ..workerenv import shm_prefix
from .group import LaunchSpec, WorkerGroup
from .guard import OrphanGuard, remove_tree
from .output import DuplicateLines, StreamSink, warn_once
from .process import WorkerProcess
from .signals import SignalRelay, parse_signals

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import NamedTuple

    from .lane import Started
    from .merged import DedupConsole

    class StoreFields(NamedTuple):
        """What a worker's environment says of the store (``store.client.StoreAddress``'s
        fields, without importing the store)."""

        host: str
        port: int
        token: str

else:  # the same record, without typing's NamedTuple
    from collections import namedtuple

    StoreFields = namedtuple("StoreFields", "host port token")


# torchrun's --run-path: the script runs through runpy.run_path in the interpreter
# (sys.argv as with `python SCRIPT ARGS`; sys.path[0] is the working directory).
RUN_PATH = "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"


def worker_argv(cfg: LaunchConfig, python: str | None = None) -> list[str]:
    """The workers' command line; ``python`` defaults to :func:`env.python_exec`."""
    python = python or python_exec()
    if cfg.no_python:
        return [cfg.entrypoint, *cfg.args]
    if cfg.module:
        return [python, "-m", cfg.entrypoint, *cfg.args]
    if cfg.run_path:
        return [python, "-c", RUN_PATH, cfg.entrypoint, *cfg.args]
    return [python, cfg.entrypoint, *cfg.args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def make_scratch(cfg: LaunchConfig, guard: OrphanGuard) -> str:
    """This agent's new scratch directory (``workerenv.make_scratch``)."""
    return workerenv.make_scratch(cfg.run_id, guard)


def log_root(cfg: LaunchConfig) -> str | None:
    """<log-dir>/<run-id>, or None without --log-dir."""
    return os.path.join(cfg.log_dir, cfg.run_id) if cfg.log_dir else None


def worker_env(
    cfg: LaunchConfig,
    slot: WorkerSlot,
    base: Mapping[str, str],
    restart_count: int,
    master: tuple[str, int],
    store: StoreFields | None,
    error_file: str | None = None,
    shm: str | None = None,
    agent_store: bool = False,
    progress_file: str | None = None,
) -> dict[str, str]:
    """The environment of the worker in ``slot`` (``store`` None: without the store's
    variables, as --dry-run shows them)."""
    if cfg.env:
        base = {**base, **dict(cfg.env)}
    env = workerenv.slot_env(
        slot,
        base,
        run_id=cfg.run_id,
        restart_count=restart_count,
        max_restarts=cfg.max_restarts,
        role=cfg.role,
        master=master,
        store=store,
        error_file=error_file,
        shm=shm,
        agent_store=agent_store,
        progress_file=progress_file,
        python=not cfg.no_python,  # (workers write to pipes: see slot_env)
    )
    if cfg.signals_to_handle:  # torchrun passes its --signals-to-handle on in this variable
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in parse_signals(cfg.signals_to_handle))
    if cfg.hang_timeout > 0:  # NCCL's own trace of a hang, next to ours
        from .watch import nccl_trace_env  # only then: it sits above the launch path

        env.update(nccl_trace_env(base, log_root(cfg))[0])
    return env


def build_specs(
    cfg: LaunchConfig,
    slots: list[WorkerSlot],
    rnd: int,
    master: tuple[str, int],
    restarts: int,
    store: StoreFields,
    base_env: Mapping[str, str],
    scratch: str,
    *,
    host_label: str = "",
    prefix_host: bool = False,
    agent_store: bool = False,
    create_files: bool = True,
) -> list[LaunchSpec]:
    """Round ``rnd``'s specs for this node's ``slots``: environment (error and progress
    files in ``scratch``), CPU/GPU binding, output sinks (--redirects, --tee, --log-dir,
    prefixes, --dedup-output), stdin. Raises ConfigError when this node has too few GPUs
    for its binding."""
    specs = []
    merged: dict[int, DedupConsole] = {}
    if cfg.dedup_output:  # only then: the launch path does not import it
        from .merged import DedupConsole

        merged = {fd: DedupConsole(fd) for fd in (1, 2)}
    root = log_root(cfg)
    argv = worker_argv(cfg)
    # this node's own devices and CPUs (raises ConfigError: too few GPUs here)
    bindings = rank_bindings(cfg, len(slots), base_env, os.sched_getaffinity(0))
    for slot in slots:
        attempt_dir = None
        if root:  # torchrun's layout: attempt_<restart count>/<rank>
            attempt_dir = os.path.join(root, f"attempt_{restarts}", str(slot.rank))
            try:
                os.makedirs(attempt_dir, exist_ok=True)
            except OSError as e:  # disk full, EIO ...: this worker runs without log files
                warn_once(
                    "logs",
                    f"cannot create {attempt_dir} ({e.strerror}); "
                    f"worker logs there are dropped, the job goes on",
                )
                attempt_dir = None
        error_file = os.path.join(scratch, f"error_{rnd}_{slot.rank}.json")
        path = os.path.join(scratch, f"progress_{rnd}_{slot.rank}")
        progress_file: str | None = path
        if create_files:
            try:
                progress.create(path)
            except OSError:  # the scratch dir's disk is full: the rank is watched by its output
                progress_file = None
        elif not os.path.exists(path):  # (the fast lane's, which its worker may be using)
            progress_file = None  # the fast lane could not make it either
        env = worker_env(
            cfg,
            slot,
            base_env,
            restarts,
            master,
            store,
            error_file,
            shm_prefix(cfg.run_id, os.getpid(), rnd),
            agent_store,
            progress_file,
        )
        binding = bindings[slot.local_rank]
        env.update(binding.env)  # its devices; LOCAL_RANK=0 under --virtual-local-rank
        label = f"{host_label}:{slot.rank}" if prefix_host else str(slot.rank)
        out, err = _sinks(cfg, slot, attempt_dir, label, base_env)
        for sink in (out, err):  # --dedup-output: the node's merger prints their lines
            if sink.console_fd in merged:
                sink.dedup, sink.rank = merged[sink.console_fd], slot.rank
        stdin = cfg.stdin == "all" or (cfg.stdin == "0" and slot.rank == 0)
        specs.append(LaunchSpec(slot, argv, env, out, err, error_file, binding.cpus, stdin))
    return specs


def _sinks(
    cfg: LaunchConfig, slot: WorkerSlot, attempt_dir: str | None, label: str, base_env: Mapping[str, str]
) -> tuple[StreamSink, StreamSink]:
    """Where each stream goes, per torchrun's --redirects/--tee and --log-dir."""
    lr = slot.local_rank
    redirected = cfg.redirects.for_rank(lr)
    shown = cfg.local_ranks_filter is None or lr in cfg.local_ranks_filter
    template = lookup("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", base_env)
    if template:  # torchrun's: string.Template over role_name, rank, local_rank, used as is
        from string import Template

        text = Template(template).safe_substitute(role_name=cfg.role, rank=slot.rank, local_rank=lr)
    else:
        text = f"[{label}]: "
    prefix = text.encode() if cfg.prefix else b""
    sinks = []
    filters = {"stdout": cfg.duplicate_stdout_filters, "stderr": cfg.duplicate_stderr_filters}
    for bit, fd, name in ((STD_OUT, 1, "stdout"), (STD_ERR, 2, "stderr")):
        console = fd if shown and not redirected & bit else None
        log = os.path.join(attempt_dir, f"{name}.log") if attempt_dir else None
        dup = None
        if filters[name] and attempt_dir:  # torchrun's filtered_<stream>.log of the attempt
            dup = DuplicateLines(
                filters[name], os.path.join(os.path.dirname(attempt_dir), f"filtered_{name}.log")
            )
        sinks.append(StreamSink(prefix, console, log, keep_tail=fd == 2, duplicate=dup))
    return sinks[0], sinks[1]


@dataclass(frozen=True, eq=False)  # never compared: no __eq__/__hash__ built at import
class FirstRound:
    """Round 0's workers of a single-node launch, started before its agent runs
    (``start_first_round``, ``start_planned_round``); the agent joins round 0 with them."""

    group: WorkerGroup
    scratch: str  # the agent's scratch directory (error and progress files)
    master_port: int

    def discard(self) -> None:
        """For a caller whose agent never ran them: stop the workers with the grace of
        --stop-timeout (``WorkerGroup.close``; a no-op once the agent ran the group) and
        remove the scratch directory."""
        self.group.close()
        remove_tree(self.scratch)


def start_first_round(
    cfg: LaunchConfig,
    slots: list[WorkerSlot],
    master_addr: str,
    store: StoreFields,
    guard: OrphanGuard,
    relay: SignalRelay,
) -> FirstRound:
    """Start round 0's workers of a single node now, as the agent would start them once
    seated (a single node's seat is known in advance: every rank is here), so that
    their interpreters start while the launcher imports and builds the rest. The guard
    watches each process group from its spawn, ``relay`` forwards signals to them from
    then on, and the scratch directory and segments are the guard's to clean up.
    MASTER_PORT is --master-port, else a free port. Raises ConfigError (this node's
    GPUs do not fit the binding), SpawnError, or LaunchInterrupted (a stop signal came
    before the first spawn); nothing is left running then."""
    master = (master_addr, cfg.master_port or free_port())
    return _start_round_zero(cfg, slots, master, store, guard, relay, dict(os.environ))


def _start_round_zero(
    cfg: LaunchConfig,
    slots: list[WorkerSlot],
    master: tuple[str, int],
    store: StoreFields,
    guard: OrphanGuard,
    relay: SignalRelay,
    base_env: Mapping[str, str],
    host_label: str = "",
    prefix_host: bool = False,
) -> FirstRound:
    """Round 0's workers in ``slots``, started before the agent runs (both callers'
    common part: scratch directory and segments handed to the guard, the group started
    with ``relay`` forwarding to it; nothing left running when it raises)."""
    if relay.stop_signal is not None:  # stopped before anything started: start nothing
        raise LaunchInterrupted(relay.stop_signal)
    scratch = make_scratch(cfg, guard)
    group = None
    try:
        specs = build_specs(
            cfg, slots, 0, master, 0, store, base_env, scratch, host_label=host_label, prefix_host=prefix_host
        )
        group = WorkerGroup(specs, relay, guard, cfg.stop_timeout)
        relay.targets = group.live
        group.start()
    except BaseException:
        if group is not None:
            group.close()
        remove_tree(scratch)
        raise
    return FirstRound(group, scratch, master[1])


def adopt_first_round(
    cfg: LaunchConfig,
    slots: list[WorkerSlot],
    master_addr: str,
    store: StoreFields,
    early: Started,
    host_label: str = "",
    prefix_host: bool = False,
) -> FirstRound:
    """Round 0's workers of ``slots`` as the fast lane's spawn (``agent/lane.py``) started
    them (a single node's, or a Slurm agent's head-planned seat), taken over: their
    specs are built here as ``start_first_round`` / ``start_planned_round`` would build
    them (``host_label``, ``prefix_host``: their prefixes), and each must match what
    the worker was started with (command line, environment, CPUs), else RuntimeError (a
    bug: the fast lane must start exactly these workers)."""
    specs = build_specs(
        cfg,
        slots,
        0,
        (master_addr, early.master_port),
        0,
        store,
        early.base_env,
        early.scratch,
        host_label=host_label,
        prefix_host=prefix_host,
        create_files=False,
    )
    if len(specs) != len(early.workers):
        raise RuntimeError(f"the fast lane started {len(early.workers)} workers, not {len(specs)}")
    for spec, w in zip(specs, early.workers):
        differ = [
            name for name in ("argv", "env", "cpus", "stdin") if getattr(spec, name) != getattr(w, name)
        ]
        if differ:  # (the variables by name only: their values may be secrets)
            keys = sorted(k for k in {*spec.env, *w.env} if spec.env.get(k) != w.env.get(k))
            raise RuntimeError(
                f"the fast lane started rank {spec.slot.rank} unlike the launcher would: {differ} {keys}"
            )
    group = WorkerGroup(specs, early.relay, early.guard, cfg.stop_timeout)
    # first: a signal from here on reaches them through the group (start() sends a stop
    # signal to each the fast lane's relay had not sent it to)
    early.relay.targets = group.live
    adopted = [
        WorkerProcess.adopt(s.slot, w.argv, w.pid, w.stdout, w.stderr, w.pidfd, w.signalled, w.exited)
        for s, w in zip(specs, early.workers)
    ]
    for w in early.workers:  # the processes and descriptors are the adopted ones' now
        w.pid, w.stdout, w.stderr, w.pidfd = -1, -1, -1, None
    try:
        group.start(adopted)
    except BaseException:
        group.close()
        for p in adopted:  # (those start() had not taken yet)
            if p.returncode is None:
                p.signal_group(signal.SIGKILL)
                p.reap()
            p.stdout.close()
            p.stderr.close()
        raise
    return FirstRound(group, early.scratch, early.master_port)


if TYPE_CHECKING:  # the head builds it without importing this module
    from .jobspec import PlannedSeat


def start_planned_round(
    cfg: LaunchConfig,
    seat: PlannedSeat,
    count: int,
    store: StoreFields,
    guard: OrphanGuard,
    relay: SignalRelay,
    base_env: Mapping[str, str],
    host_label: str = "",
    prefix_host: bool = False,
) -> FirstRound:
    """A head-mode agent's round 0, started from the head's plan (``seat``; ``count``
    workers here) before the agent imports its rendezvous, observer and node agent: as
    ``start_first_round`` (the guard watches each worker from its spawn, ``relay``
    forwards signals to them, the scratch directory and segments are the guard's to
    clean up), with this node's environment (``base_env``: devices included) and host
    prefixes. Raises ConfigError (this node's GPUs), SpawnError, or LaunchInterrupted (a
    stop signal before the first spawn); nothing is left running then."""
    master = (seat.master_addr, seat.master_port)
    return _start_round_zero(
        cfg, seat.slots(count), master, store, guard, relay, base_env, host_label, prefix_host
    )
