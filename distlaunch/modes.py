"""Which launch mode a `distlaunch run` is, decided once from its options.

``resolve`` turns the parsed options of `run` into one mode description, and nothing
after it looks at flag combinations again:

| description | options | who hosts the store |
|---|---|---|
| ``SingleNode`` | neither of the below | this launcher, on loopback |
| ``StaticNodes`` | ``--nnodes N`` (N > 1) | node 0, on ``--master-addr:--master-port`` |
| ``DynamicNodes`` | ``--rdzv-endpoint HOST:PORT`` | the launcher that binds it first |
| ``HeadNodes`` | ``-H`` / ``--hostfile``; ``--include`` alone; Slurm's allocation | this head |

Each carries ``job``, the validated :class:`~distlaunch.config.LaunchConfig` every node's
agent runs, plus what only that mode needs. Every bad value or combination raises
:class:`~distlaunch.errors.ConfigError` here, before anything starts. Option values that
come from elsewhere than the command line (a job file, the environment of a scheduler)
are merged into the options before they are parsed once (``run_options.RunOptions``): a job
file and PET_* by click, a scheduler's variables here, from the engine that detects it
(``engine.detect``: Slurm under srun, a Kubernetes pod, a SkyPilot node). The engine of
head mode is one registry lookup (``engine.plugin``). ``--include``/``--exclude`` without
a host list pick slots of ``localhost`` (DeepSpeed's).

Pure apart from ``LaunchConfig.validate`` (file checks) and, for head mode only, reading
a hostfile or asking the engine for its nodes; head mode's modules are imported only
when it is chosen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from .config import LaunchConfig, run_id_from
from .engine import DEFAULT as DEFAULT_ENGINE
from .engine import Placement, detect, plugin
from .errors import ConfigError
from .run_options import RunOptions
from .topology import MAX_NODES
from .workerenv import STORE_HOST

if TYPE_CHECKING:
    from .hosts import Host
    from .remote.ssh import SSHOptions

STATIC_MASTER_ADDR, STATIC_MASTER_PORT = "127.0.0.1", 29500  # torchrun's static defaults


@dataclass(frozen=True)
class SingleNode:
    """One node: the launcher hosts the store on loopback (random port and secret)."""

    job: LaunchConfig
    nnodes: ClassVar[int] = 1
    node_rank: ClassVar[int] = 0

    def store_text(self) -> str:
        """Where the store will be, for --dry-run."""
        return f"{STORE_HOST}:<port chosen at start>"


@dataclass(frozen=True)
class StaticNodes:
    """Per-node launch with fixed membership (torchrun's static rendezvous): node 0
    hosts the store at ``job.master_addr:job.master_port``; every node reads the same
    secret (``store_token_file``, see secret.py)."""

    job: LaunchConfig
    nnodes: int
    node_rank: int
    store_token_file: str | None = None

    def store_text(self) -> str:
        return f"{self.job.master_addr}:{self.job.master_port} (hosted by node 0)"

    def store_endpoint(self) -> tuple[str, int]:
        """Where node 0 hosts the store: ``job.master_addr:job.master_port`` (both set:
        ``resolve`` fills in this mode's defaults)."""
        addr, port = self.job.master_addr, self.job.master_port
        assert addr is not None and port is not None
        return addr, port


@dataclass(frozen=True)
class DynamicNodes:
    """Per-node launch through the store at ``endpoint`` (torchrun's c10d backend):
    ``nnodes`` to ``max_nodes`` nodes, node ranks by arrival. ``node_rank`` only places
    this node in a --dry-run's rank guess."""

    job: LaunchConfig
    endpoint: str  # as given, e.g. "[::1]:29400"
    host: str  # brackets removed
    port: int
    nnodes: int
    max_nodes: int
    node_rank: int = 0
    store_token_file: str | None = None
    local_addr: str | None = None  # announced as MASTER_ADDR if this node becomes node 0
    is_host: bool | None = None  # --rdzv-conf is_host: must (True) / must not (False) host

    def store_text(self) -> str:
        if self.port == 0:
            return f"{self.host}:<a free port> (hosted by this launcher)"
        return f"{self.endpoint} (hosted by the launcher that binds it first)"


@dataclass(frozen=True)
class HeadOptions:
    """What only head mode (-H / --hostfile) needs."""

    hosts: tuple[Host, ...]  # slots resolved, in node-rank order
    ssh: SSHOptions | None  # --ssh-* with a host list; None: the nodes come from the engine
    store_addr: str | None = None
    remote_python: str | None = None
    remote_cwd: str | None = None
    env_all: bool = False
    prefix_host: bool = False
    min_nodes: int | None = None  # drop failing/lost hosts while this many remain
    engine: str = DEFAULT_ENGINE  # how agents start: a name of the registry (engine.ENGINES)


@dataclass(frozen=True)
class HeadNodes:
    """Head mode: this machine has an engine start an agent per host and hosts the store."""

    job: LaunchConfig
    head: HeadOptions


NodeMode = SingleNode | StaticNodes | DynamicNodes  # run by launcher.py
Mode = SingleNode | StaticNodes | DynamicNodes | HeadNodes

# --ssh-* options -> remote.ssh.SSHOptions fields.
_SSH_FIELDS = {
    "ssh_port": "port",
    "ssh_user": "user",
    "ssh_key": "key_file",
    "ssh_accept_new_host_keys": "accept_new_host_keys",
    "ssh_config": "config_file",
}


def resolve(
    script: str,
    script_args: tuple[str, ...],
    options: Mapping[str, Any],
    given: frozenset[str] = frozenset(),
    environ: Mapping[str, str] | None = None,
) -> Mode:
    """The mode description of `distlaunch run SCRIPT SCRIPT_ARGS` with ``options`` (the
    `run` command's parameters by name, as click passes them; ``given``: the names set
    on the command line, in a job file or a PET_* variable, not defaulted). ``environ``
    (default os.environ) tells whether a scheduler started this launch or runs it (an
    engine's ``detect``: Slurm's step or allocation). Raises ConfigError for any bad
    value or combination."""
    env = os.environ if environ is None else environ
    placed = _place(options, given, env)
    if placed is not None and placed[1] == "node":  # what the user gave (e.g. --run-id) stays
        filled = plugin(placed[0]).node_options(env, options, given)
        options = {**options, **{k: v for k, v in filled.items() if k not in given}}
    mode = _resolve(RunOptions.parse(script, script_args, options, given), placed, env)
    _check_ranks_filter(mode)
    return mode


def _resolve(o: RunOptions, placed: tuple[str, Placement] | None, env: Mapping[str, str]) -> Mode:
    nnodes, max_nodes = o.nnodes.min, o.nnodes.max
    if o.hosts or o.hostfile:
        _check_head_only(o, nnodes, max_nodes)
    if o.standalone:
        nnodes = 1
    kw: dict[str, Any] = {name: getattr(o, name) for name in _LAUNCH_FIELDS}
    kw.update(
        entrypoint=o.script,
        args=o.script_args,
        prefix=not o.no_prefix,
        env=worker_env(o.env_names, o.env_file),
    )
    endpoint = o.rdzv_endpoint
    if _rdzv_backend(o.rdzv_backend) == "static" and endpoint is not None:
        # torchrun's static backend: the endpoint is node 0's store, ranks from --node-rank;
        # port 0 on one node is a free port, as torch's TCPStore binds it there
        addr, port = parse_endpoint(endpoint, allow_zero=True)
        _check_free_port(endpoint, port, max_nodes or nnodes)
        kw["master_addr"], kw["master_port"] = addr, port or None
        endpoint = None
    static = endpoint is None and nnodes > 1
    if kw["master_port"] == 0:  # torch's TCPStore: port 0 binds a free port
        if static:
            raise ConfigError(
                f"--master-port 0 picks a free port on node 0, which the other {nnodes - 1} node(s) "
                f"cannot know; give a port, e.g. --master-port {STATIC_MASTER_PORT} (the default)"
            )
        kw["master_port"] = None  # one node: a free port, chosen at start
    if static:
        kw["master_addr"] = kw["master_addr"] or STATIC_MASTER_ADDR
        kw["master_port"] = kw["master_port"] or STATIC_MASTER_PORT
    run_id = o.rdzv_id or o.run_id or _default_run_id(endpoint, static, kw["master_port"])
    if run_id:
        kw["run_id"] = run_id
    _check_nodes(o.nnodes.text, nnodes, max_nodes, o.node_rank, endpoint)
    _check_signals(o.signals_to_handle)
    job = LaunchConfig(**kw).validate()
    if o.hosts or o.hostfile:
        return HeadNodes(job, _head_options(o))
    if placed is not None and placed[1] == "head":
        hosts = plugin(placed[0]).discover(o, env)
        return HeadNodes(job, _head(o, hosts, None, placed[0]))
    if o.include is not None or o.exclude is not None:
        return _local_selection(o, job, per_node=endpoint is not None or static or placed is not None)
    if endpoint is not None:
        host, port = parse_endpoint(endpoint, allow_zero=True)
        return DynamicNodes(
            job,
            endpoint,
            host,
            port,
            nnodes,
            max_nodes or nnodes,
            o.node_rank,
            o.store_token_file,
            o.local_addr,
            job.rdzv_is_host(),
        )
    if static:
        return StaticNodes(job, nnodes, o.node_rank, o.store_token_file)
    return SingleNode(job)


def _check_ranks_filter(mode: Mode) -> None:
    """--local-ranks-filter names local ranks that exist on some node (else it would
    hide every line of output, silently)."""
    shown = mode.job.local_ranks_filter
    if not shown:
        return
    most = mode.job.nproc_per_node
    if isinstance(mode, HeadNodes):
        from .hosts import slots_of

        most = max(map(slots_of, mode.head.hosts))
    if max(shown) >= most:
        raise ConfigError(
            f"--local-ranks-filter {','.join(map(str, sorted(shown)))}: no node runs local rank "
            f"{max(shown)} ({most} worker(s) per node at most); give local ranks from 0 to {most - 1}"
        )


# A per-node launch's own options: given any of them, a launch under a scheduler (srun)
# is taken as the user wrote it (no scheduler defaults).
_PER_NODE = frozenset({"nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "standalone"})


def _place(
    o: Mapping[str, Any], given: frozenset[str], env: Mapping[str, str]
) -> tuple[str, Placement] | None:
    """The engine that applies to this launch without a host list and where it puts it
    (``engine.detect``: Slurm's "node" under srun, "head" in an allocation), or None
    (a host list, per-node options, or no engine applies). Raises ConfigError when
    --launcher names an engine that cannot run here (Slurm outside an allocation)."""
    launcher = o.get("launcher") or "auto"
    if launcher != "auto":
        plugin(launcher).check(env)
    if o.get("hosts") or o.get("hostfile"):
        return None
    placed = detect(launcher, env)
    if placed is not None and given & _PER_NODE:
        # per-node options given: the launch as written, unless the engine fills around
        # them (pods: PET_* variables are given options there, see engine.EnginePlugin)
        return placed if placed[1] == "node" and plugin(placed[0]).fills_around_given else None
    return placed


def _local_selection(o: RunOptions, job: LaunchConfig, per_node: bool) -> HeadNodes:
    """DeepSpeed's --include/--exclude without a hostfile pick among this machine's slots
    (deepspeed/launcher/runner.py: the pool is then ``localhost``; DeepSpeed's has every
    GPU, ours --nproc-per-node slots): ``--include localhost:1`` runs one worker with
    CUDA_VISIBLE_DEVICES=1, as ``-H localhost:N --include localhost:1`` does. Raises
    ConfigError in a per-node launch, whose launcher starts only its own node's workers."""
    if per_node:
        flag = "--include" if o.include is not None else "--exclude"
        raise ConfigError(
            f"{flag} picks hosts of -H/--hostfile (or slots of a single-node launch); a "
            f"per-node launch cannot use it: drop {flag} and set CUDA_VISIBLE_DEVICES on each node"
        )
    n = job.nproc_per_node
    try:
        return HeadNodes(job, _head_options(o.replace(hosts=f"localhost:{n}")))
    except ConfigError as e:  # the implicit list is not what the user wrote: say it
        raise ConfigError(f"{e} (without -H the list is localhost with --nproc-per-node {n} slots)") from None


def _rdzv_backend(name: str) -> str:
    """torchrun's --rdzv-backend: c10d or static; etcd is refused with the reason."""
    if name in ("etcd", "etcd-v2"):
        raise ConfigError(
            f"--rdzv-backend {name} is not supported: distlaunch hosts its own authenticated "
            f"store; use --rdzv-backend c10d with --rdzv-endpoint HOST:PORT (the launcher "
            f"that binds it hosts it, or run `distlaunch store` there)"
        )
    if name not in ("c10d", "static"):
        raise ConfigError(f"--rdzv-backend {name!r} is unknown; use c10d or static")
    return name


def _check_signals(text: str | None) -> None:
    """torchrun's --signals-to-handle: any signal the launcher can catch (SIGINT, SIGTERM,
    SIGHUP, SIGQUIT stop the job; SIGUSR1/SIGUSR2 are forwarded; any other one named stops
    the job too, as torchrun's handlers do)."""
    from .agent.signals import parse_signals

    try:
        parse_signals(text)
    except ValueError as e:
        raise ConfigError(f"{e}; name signals like SIGTERM,SIGUSR1") from None


def _default_run_id(endpoint: str | None, static: bool, master_port: int | None) -> str | None:
    """Per-node launches need the same run id on every node without being told one: it
    comes from the shared endpoint or port. None: a random one (LaunchConfig's default)."""
    if endpoint is not None:  # HOST:0 is this launcher's alone: a random one
        return None if parse_endpoint(endpoint, allow_zero=True)[1] == 0 else run_id_from(f"job-{endpoint}")
    if static:
        return f"job{master_port}"
    return None


def parse_endpoint(text: str, allow_zero: bool = False) -> tuple[str, int]:
    """``--rdzv-endpoint HOST:PORT`` (IPv6 in brackets) as (host, port); port 0 (a free
    port, as torchrun) only with ``allow_zero``. ConfigError if malformed."""
    host, _, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if (
        not host
        or not port.isdigit()
        or len(port) > 5
        or not (0 if allow_zero else 1) <= int(port) < 65536
        or (":" in host and not bracketed)
    ):
        raise ConfigError(
            f"--rdzv-endpoint {text!r} is invalid: give HOST:PORT, e.g. node0:29400 or [::1]:29400"
        )
    return (host[1:-1] if bracketed else host), int(port)


def _check_nodes(text: str, nnodes: int, max_nodes: int | None, node_rank: int, endpoint: str | None) -> None:
    """The node count, this node's rank and the rendezvous fit together."""
    if not 1 <= nnodes <= MAX_NODES or (max_nodes or 1) > MAX_NODES:
        raise ConfigError(f"--nnodes {text} is invalid: give 1 to {MAX_NODES} nodes")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"--node-rank {node_rank} is invalid with --nnodes {nnodes}: give a value from 0 to {nnodes - 1}"
        )
    if max_nodes is not None and max_nodes < nnodes:
        raise ConfigError(f"--nnodes {text} is invalid: MAX must be at least MIN")
    if endpoint is not None:
        _check_free_port(endpoint, parse_endpoint(endpoint, allow_zero=True)[1], max_nodes or nnodes)
    elif max_nodes is not None:
        raise ConfigError(
            f"--nnodes {text} needs --rdzv-endpoint HOST:PORT (a `distlaunch "
            f"store`, or the first launcher there)"
        )


def _check_free_port(endpoint: str, port: int, nodes: int) -> None:
    """torchrun's --rdzv-endpoint HOST:0 (a free port) is for one node only."""
    if port == 0 and nodes > 1:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint} picks a free port, which the other nodes cannot "
            f"know; give a port, e.g. {endpoint[:-1]}29400"
        )


def worker_env(names: Sequence[str], files: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """--env-file FILE (dotenv) and -x NAME / NAME=VALUE / GLOB (mpirun): variables set
    for every worker on every node; -x wins over a file, a later file over an earlier."""
    if not names and not files:  # the common case, without remote.command's imports:
        # what shipped_env ships for no names (PYTHONPATH, always)
        path = os.environ.get("PYTHONPATH")
        return () if path is None else (("PYTHONPATH", path),)
    from .remote.command import env_file, shipped_env  # no paramiko: remote/__init__ is light

    out: dict[str, str] = {}
    for path in files:
        out.update(env_file(path))
    out.update(shipped_env(os.environ, list(names), False))
    return tuple(sorted(out.items()))


def _check_head_only(o: RunOptions, nnodes: int, max_nodes: int | None) -> None:
    """torchrun's per-node options name what head mode (-H/--hostfile) sets itself: the
    head hosts the store, the host list gives the nodes in node-rank order and each
    node's MASTER_ADDR is the address SSH reached. Given together they were ignored;
    raises ConfigError naming the first one. --rdzv-id stays: it is the run id here too."""
    drop = "drop one of them"
    clashes = [
        (
            o.rdzv_endpoint is not None,
            f"--rdzv-endpoint {o.rdzv_endpoint}",
            f"the head hosts the store: {drop}",
        ),
        (
            o.rdzv_backend == "static",
            "--rdzv-backend static",
            f"the head hosts the store and ranks the nodes: {drop}",
        ),
        (
            nnodes > 1 or max_nodes is not None,
            f"--nnodes {o.nnodes}",
            "the host list sets the nodes: drop --nnodes",
        ),
        (
            o.node_rank != 0,
            f"--node-rank {o.node_rank}",
            f"the host list's order sets the node ranks: {drop}",
        ),
        (
            o.local_addr is not None,
            f"--local-addr {o.local_addr}",
            "the head's address is --store-addr: use that",
        ),
    ]
    for clash, given, why in clashes:
        if clash:
            raise ConfigError(f"{given} is for per-node launches; with -H/--hostfile {why}")


def _head_options(o: RunOptions) -> HeadOptions:
    """Head mode over a host list (-H/--hostfile), agents started by the engine
    --launcher names (SSH by default)."""
    from .hosts import check_one_local, filter_hosts, parse_host_list, parse_hostfile, resolve_slots
    from .remote.ssh import SSHOptions

    if o.hosts and o.hostfile:
        raise ConfigError("give either -H/--hosts or --hostfile, not both")
    hosts = parse_host_list(o.hosts) if o.hosts else parse_hostfile(o.hostfile or "")
    hosts = filter_hosts(resolve_slots(hosts, o.nproc_per_node), o.include, o.exclude)
    check_one_local(hosts)
    ssh = SSHOptions(**{field: getattr(o, name) for name, field in _SSH_FIELDS.items()})
    return _head(o, hosts, ssh, DEFAULT_ENGINE if o.launcher == "auto" else o.launcher)


def _head(o: RunOptions, hosts: Sequence[Host], ssh: SSHOptions | None, engine: str) -> HeadOptions:
    """Head mode over ``hosts`` (a host list, or the nodes an engine discovered). Raises
    ConfigError when --min-nodes asks for more nodes than there are."""
    if o.min_nodes is not None and o.min_nodes > len(hosts):
        raise ConfigError(
            f"--min-nodes {o.min_nodes} is more than the {len(hosts)} host(s) "
            f"listed; give at most {len(hosts)}"
        )
    return HeadOptions(tuple(hosts), ssh, engine=engine, **{name: getattr(o, name) for name in _HEAD_FIELDS})


# Where each RunOptions field goes: a LaunchConfig or HeadOptions field of the same name,
# an SSHOptions field (_SSH_FIELDS), or read by resolve itself. Checked on import: a
# field nothing reads would be an option silently dropped.
_RUN_NAMES = RunOptions.names()
_LAUNCH_FIELDS = tuple(f.name for f in fields(LaunchConfig) if f.name in _RUN_NAMES and f.name != "run_id")
_HEAD_FIELDS = tuple(
    f.name for f in fields(HeadOptions) if f.name in _RUN_NAMES and f.name not in ("hosts", "ssh")
)
_READ_BY_RESOLVE = frozenset(
    {
        "script",
        "script_args",
        "given",
        "nnodes",
        "node_rank",
        "run_id",
        "standalone",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_backend",
        "local_addr",
        "store_token_file",
        "hosts",
        "hostfile",
        "include",
        "exclude",
        "launcher",
        "env_names",
        "env_file",
        "no_prefix",
    }
)
# torchrun's options accepted without effect (their --help says why)
_NO_EFFECT = frozenset({"start_method", "event_log_handler", "logs_specs"})


def _check_every_option_used() -> None:
    unused = _RUN_NAMES - {*_LAUNCH_FIELDS, *_HEAD_FIELDS, *_SSH_FIELDS} - _READ_BY_RESOLVE - _NO_EFFECT
    if unused:
        raise TypeError(f"RunOptions fields that no mode uses: {', '.join(sorted(unused))}")


_check_every_option_used()
