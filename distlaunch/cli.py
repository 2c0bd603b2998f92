"""The command line: parses, dispatches, and installs the reporter every layer tells the
user through (``report.py``).
Exit codes come from the errors themselves (``exit_code``: 0 success; the first failed
worker's code, signal N -> 128+N; 2 bad usage). `run` resolves its options into a launch
mode (``modes.py``) and hands it to ``launcher`` or ``head``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from . import __version__
from .command import leave, one_line, report_abort, report_error, run_parsed
from .engine import NAMES as ENGINE_NAMES
from .errors import ConfigError, DistlaunchError
from .report import Reporter, install, say

if TYPE_CHECKING:
    from .launcher import Plan
    from .modes import HeadNodes
    from .store import StoreServer

SECRET_VARS = ("DISTLAUNCH_STORE_TOKEN",)
F = TypeVar("F", bound=Callable[..., Any])


def _dashes(name: str) -> str:
    """torchrun's underscore spellings (--nproc_per_node) are the dashed options."""
    return name.replace("_", "-")


# `distlaunch run --help` sections, in order; options without one are listed first.
WORKERS, NODES, HOSTS, OUTPUT, SUPERVISION = (
    "Workers",
    "Nodes and rendezvous",
    "Hosts and SSH",
    "Output",
    "Supervision",
)


class _GroupedOption(click.Option):
    """An option that names its --help section."""

    def __init__(self, *args: Any, group: str | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.group = group


class _GroupedCommand(click.Command):
    """Lists its options in --help by section (``_GroupedOption.group``), and takes
    unambiguous prefixes of its long options (``--max-restart 0``), as torchrun does
    through argparse's ``allow_abbrev``; an ambiguous prefix is a usage error naming
    the candidates."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _expand_prefixes(self.get_params(ctx), args, ctx))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str | None, list[tuple[str, str]]] = {None: []}
        for name in (WORKERS, NODES, HOSTS, OUTPUT, SUPERVISION):
            sections[name] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):
                sections.setdefault(getattr(param, "group", None), []).append(record)
        for group, records in sections.items():
            if records:
                with formatter.section(group or "Options"):
                    formatter.write_dl(records)


def _expand_prefixes(params: list[click.Parameter], args: list[str], ctx: click.Context) -> list[str]:
    """``args`` with each abbreviated long option before the script (the first
    positional, or ``--``) spelled out: a prefix of exactly one long option (after
    torchrun's underscore spellings become dashes) becomes that option; an exact name
    always wins. Raises click.UsageError for a prefix of several."""
    names: dict[str, click.Option] = {}
    for p in params:
        if isinstance(p, click.Option):
            names.update((n, p) for n in (*p.opts, *p.secondary_opts))
    longs = [n for n, p in names.items() if n.startswith("--") and not p.hidden]  # internal: exact only
    out = list(args)
    i = 0
    while i < len(out):
        arg = out[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break  # the script: the rest is its own
        name, eq, value = arg.partition("=")
        name = _dashes(name) if name.startswith("--") else name
        if name.startswith("--") and name not in longs:
            found = sorted(n for n in longs if n.startswith(name))
            if len(found) > 1:
                raise click.UsageError(f"option {name} is ambiguous: it could be {', '.join(found)}", ctx)
            if found:
                name = found[0]
                out[i] = name + eq + value
        opt = names.get(name)
        takes_value = opt is not None and not opt.is_flag and not opt.count
        i += 2 if takes_value and not eq else 1
    return out


def option(*names: str, group: str | None = None, **kw: Any) -> Callable[[F], F]:
    """A click option of `run` listed under ``group`` in --help. Grouped options also
    read ``PET_<NAME>`` (``--nproc-per-node``: ``PET_NPROC_PER_NODE``) when not given on
    the command line, as torchrun does (Kubeflow's PyTorchJob sets them)."""
    if group is not None:
        long = next(n for n in names if n.startswith("--"))
        kw.setdefault("envvar", "PET_" + long[2:].replace("-", "_").upper())
    return click.option(*names, cls=_GroupedOption, group=group, **kw)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="distlaunch")
def cli() -> None:
    """Launch, supervise and connect distributed Python programs (torchrun / mpirun style)."""


def _load_config(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    """Eager --config: the job file's values become the defaults that command-line options
    override (click's default_map); each value is checked against its option's type."""
    if path is None:
        return None
    from .config import load_job_file

    params = {p.name: p for p in ctx.command.params}
    defaults: dict[str, object] = {}
    job: dict[str, object] = {}
    for key, value, line in load_job_file(path):
        name = key.replace("-", "_")
        where = f"{path}:{line}: {key}"
        if name == "args":
            if not (isinstance(value, list) and all(isinstance(a, (str, int, float)) for a in value)):
                raise ConfigError(f"{where}: give a list of arguments")
            job[name] = [str(a) for a in value]
            continue
        if name == "script":
            if not isinstance(value, str):
                raise ConfigError(f"{where}: give the script's path as a string")
            job[name] = value
            continue
        if name == "env":
            name, value = "env_names", _env_entries(value, where)
        elif name == "hosts" and isinstance(value, list):
            value = ",".join(map(str, value))
        param = params.get(name)
        if (
            param is None
            or name in ("config", "print_config", "root_cause_file")
            or not isinstance(param, click.Option)
        ):
            raise ConfigError(
                f"{where}: unknown option; see 'distlaunch run --help' for the names (dashes or underscores)"
            )
        try:
            defaults[name] = param.type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise ConfigError(f"{where}: {e.format_message()}") from None
        if isinstance(value, bool) and not param.is_flag:
            raise ConfigError(f"{where}: {value!r} is not a valid value for {param.opts[0]}")
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta["job_file"] = job
    return path


def _env_entries(value: object, where: str) -> list[str]:
    if isinstance(value, dict):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigError(f"{where}: give a mapping NAME: value, or a list of names to ship")


@cli.command(
    cls=_GroupedCommand, context_settings={"allow_interspersed_args": False, "token_normalize_func": _dashes}
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="Read options (and script, args, env, hosts) from a YAML job file; options given here override it.",
)
@option("--print-config", is_flag=True, help="Print the merged options as YAML and exit.")
@option(
    "--nproc-per-node",
    group=WORKERS,
    default="1",
    show_default=True,
    metavar="N|auto|cpu|gpu|xpu",
    help="Workers on this node: a number, or auto (GPUs if any, else CPUs), cpu, gpu (the "
    "GPUs CUDA/HIP/ROCR_VISIBLE_DEVICES leave visible, else NVML's, else the driver's), "
    "xpu (Intel GPUs: ZE_AFFINITY_MASK entries, else Intel render nodes).",
)
@option(
    "--nnodes",
    group=NODES,
    default="1",
    show_default=True,
    metavar="N|MIN:MAX",
    help="Number of nodes in a per-node launch; MIN:MAX admits a varying number (with --rdzv-endpoint).",
)
@option(
    "--node-rank", group=NODES, default=0, show_default=True, type=int, help="Rank of this node, 0..nnodes-1."
)
@option(
    "--master-addr",
    group=NODES,
    default=None,
    metavar="HOST",
    help="Address of rank 0's node, exported as MASTER_ADDR (default: localhost).",
)
@option(
    "--master-port",
    group=NODES,
    default=None,
    type=int,
    metavar="PORT",
    help="Port exported as MASTER_PORT. One node: for the program's own rendezvous "
    "(default or 0: a free port; must be free). Per-node launches (--nnodes N): node 0's store "
    "(default 29500), where torch's init_process_group(env://) finds a TCPStore (one port "
    "per job, as torchrun).",
)
@option(
    "--max-restarts",
    group=SUPERVISION,
    default=0,
    show_default=True,
    type=int,
    help="Restart the whole worker group this many times after a worker fails.",
)
@option(
    "--monitor-interval",
    group=SUPERVISION,
    default=0.1,
    show_default=True,
    type=float,
    metavar="SECONDS",
    help="Accepted for torchrun compatibility; distlaunch is event-driven and sees exits at once.",
)
@option(
    "-m", "--module", group=WORKERS, is_flag=True, help="Run SCRIPT as a Python module (python -m SCRIPT)."
)
@option(
    "--no-python",
    group=WORKERS,
    is_flag=True,
    help="Run SCRIPT as a program, without the Python interpreter.",
)
@option("--role", group=WORKERS, default="default", show_default=True, help="Role name (ROLE_NAME).")
@option(
    "--run-id",
    group=NODES,
    default=None,
    help="Id of the job (default: random). Namespaces store keys and logs.",
)
@option(
    "--log-dir",
    group=OUTPUT,
    default=None,
    type=click.Path(file_okay=False),
    help="Also write each worker's stdout/stderr to LOG_DIR/RUN_ID/attempt_K/RANK/.",
)
@option(
    "-r",
    "--redirects",
    group=OUTPUT,
    default="0",
    show_default=True,
    metavar="STD",
    help="Send streams to log files only, not the console: 0 none, 1 stdout, "
    "2 stderr, 3 both, or per local rank like 0:3,1:2.",
)
@option(
    "-t",
    "--tee",
    group=OUTPUT,
    default="0",
    show_default=True,
    metavar="STD",
    help="Send streams to the console and to log files (values as --redirects).",
)
@option(
    "--dedup-output",
    group=OUTPUT,
    is_flag=True,
    help="Print identical lines of several ranks (within 0.2 s) once, as [0-7]: line; a "
    "rank's lines keep their order.",
)
@option(
    "--local-ranks-filter",
    group=OUTPUT,
    default=None,
    metavar="RANKS",
    help="Show only these local ranks' output on the console, e.g. 0 or 0,1.",
)
@option(
    "--standalone",
    group=NODES,
    is_flag=True,
    help="Single-node job with its own local rendezvous (implies --nnodes 1).",
)
@option(
    "--stop-timeout",
    "--shutdown-timeout",
    group=SUPERVISION,
    default=30.0,
    show_default=True,
    type=float,
    metavar="SECONDS",
    envvar=["PET_STOP_TIMEOUT", "PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"],
    help="Grace between SIGTERM and SIGKILL when stopping workers (torchrun's "
    "--shutdown-timeout and TORCH_ELASTIC_SHUTDOWN_TIMEOUT are the same).",
)
@option(
    "--hang-timeout",
    group=SUPERVISION,
    default=0.0,
    show_default=True,
    type=float,
    metavar="SECONDS",
    help="When no rank progresses (an output line, distlaunch.heartbeat(), a completed "
    "collective) for SECONDS, print every rank's stack grouped, name the odd ranks out, "
    "and stop the group as a failure (--max-restarts applies). Start-up, until a first sign "
    "of progress, gets at least 60 s. 0: off.",
)
@option(
    "--stacks-on-failure/--no-stacks-on-failure",
    group=SUPERVISION,
    default=True,
    show_default=True,
    help="When a worker fails, print where the other ranks were (their stacks, grouped) "
    "before stopping them. Needs py-spy.",
)
@option(
    "--start-method",
    group=WORKERS,
    default="spawn",
    type=click.Choice(["spawn", "fork", "forkserver"]),
    help="Accepted for torchrun compatibility: every worker is a new process running SCRIPT "
    "(what torchrun does for a script; the value mattered only for its function entry points).",
)
@option(
    "--event-log-handler",
    group=OUTPUT,
    default=None,
    metavar="NAME",
    help="Accepted for torchrun compatibility and ignored: distlaunch records its events in "
    "<log-dir>/<run-id>/events.jsonl.",
)
@option(
    "-H",
    "--hosts",
    group=HOSTS,
    default=None,
    metavar="HOST[:N],...",
    help="Start the job on these hosts over SSH from here, N workers each (default "
    "--nproc-per-node), e.g. node1:4,user@node2:4 or node[01-16]:8 (Slurm-style ranges).",
)
@option(
    "--hostfile",
    group=HOSTS,
    default=None,
    type=click.Path(dir_okay=False),
    help="Hosts from a file: OpenMPI 'host slots=N', DeepSpeed 'host slots=N', MPICH "
    "'host:N', one per line, names may hold ranges (node[01-16]); # comments.",
)
@option(
    "--include",
    group=HOSTS,
    default=None,
    metavar="HOSTS",
    help="Use only these hosts of the list, or some of their slots as DeepSpeed's "
    "--include: host1:0,2@host2 (the workers get CUDA_VISIBLE_DEVICES=0,2); ranges allowed. "
    "Without -H: slots of this machine (localhost:1).",
)
@option(
    "--exclude",
    group=HOSTS,
    default=None,
    metavar="HOSTS",
    help="Leave these hosts of the list out, or some of their slots: host1:1@host2 (DeepSpeed's --exclude).",
)
@option(
    "--launcher",
    group=HOSTS,
    default="auto",
    show_default=True,
    type=click.Choice(["auto", *ENGINE_NAMES]),
    help="How agents reach other nodes: ssh (with -H/--hostfile) or slurm (one srun step "
    "inside the allocation, never SSH). auto: slurm inside a Slurm allocation without a "
    "host list; under srun, one launcher per node with nodes, ranks and store from Slurm.",
)
@option(
    "--store-addr",
    group=HOSTS,
    default=None,
    metavar="ADDR",
    help="Address the head's store binds and announces (default: the address this "
    "machine uses to reach the first host).",
)
@option(
    "--remote-python",
    group=HOSTS,
    default=None,
    metavar="PATH",
    help="Interpreter on the hosts (default: the head's sys.executable).",
)
@option(
    "--remote-cwd",
    group=HOSTS,
    default=None,
    metavar="DIR",
    help="Working directory on the hosts (default: the head's).",
)
@option(
    "--ssh-port",
    group=HOSTS,
    default=None,
    type=click.IntRange(1, 65535),
    help="SSH port (overrides ~/.ssh/config).",
)
@option("--ssh-user", group=HOSTS, default=None, help="SSH user (overrides ~/.ssh/config).")
@option(
    "--ssh-key",
    group=HOSTS,
    default=None,
    type=click.Path(dir_okay=False),
    help="SSH private key file (overrides ~/.ssh/config).",
)
@option(
    "--ssh-config",
    group=HOSTS,
    default=None,
    type=click.Path(dir_okay=False),
    help="OpenSSH client config to read instead of ~/.ssh/config (like ssh -F).",
)
@option(
    "--ssh-accept-new-host-keys",
    group=HOSTS,
    is_flag=True,
    help="Accept and remember host keys not yet in known_hosts (changed keys are still refused).",
)
@option(
    "-x",
    "--env",
    "env_names",
    group=WORKERS,
    multiple=True,
    metavar="NAME[=VALUE]",
    help="Set this variable for every worker on every host: NAME (its value here), "
    "NAME=VALUE, or a glob such as 'NCCL_*' (repeatable; mpirun's -x).",
)
@option(
    "--env-file",
    group=WORKERS,
    multiple=True,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Set the variables of this dotenv file (NAME=value lines, quotes, # comments) "
    "for every worker on every host, like -x (repeatable; e.g. DeepSpeed's .deepspeed_env).",
)
@option(
    "--env-all",
    group=HOSTS,
    is_flag=True,
    help="Ship the whole environment except host-specific variables (SSH_*, DISPLAY, "
    "HOSTNAME, PWD, TERM, ...).",
)
@option("--prefix-host", group=OUTPUT, is_flag=True, help="Prefix output lines with [host:rank]: .")
@option(
    "--min-nodes",
    group=SUPERVISION,
    default=None,
    type=click.IntRange(min=1),
    metavar="N",
    help="With -H/--hostfile: drop a host whose agent is lost or whose workers fail in "
    "two consecutive rounds, and go on while N hosts remain (default: all).",
)
@option(
    "--rdzv-endpoint",
    group=NODES,
    default=None,
    metavar="HOST:PORT",
    help="Rendezvous store for per-node launches; node ranks are assigned by arrival. "
    "The launcher that can bind it hosts it, or run `distlaunch store` there. HOST:0 "
    "picks a free port (one node only, as torchrun).",
)
@option(
    "--rdzv-id",
    group=NODES,
    default=None,
    metavar="ID",
    help="Job id shared by every node's launcher (the run id).",
)
@option(
    "--rdzv-backend",
    group=NODES,
    default="c10d",
    show_default=True,
    metavar="c10d|static",
    help="torchrun's meaning: c10d (node ranks by arrival through --rdzv-endpoint) or "
    "static (ranks from --node-rank; --rdzv-endpoint, if given, is node 0's "
    "address:port). etcd is refused: distlaunch hosts its own store.",
)
@option(
    "--rdzv-conf",
    group=NODES,
    default=None,
    metavar="K=V,...",
    help="Rendezvous settings in seconds: join_timeout (600; torchrun's timeout too), "
    "last_call_timeout (3), heartbeat_interval (1; keep_alive_interval), "
    "heartbeat_timeout (15; or keep_alive_max_attempt x interval), "
    "exit_barrier_timeout (300), is_host (true: this launcher must host the store, "
    "false: it must not). read_timeout and close_timeout are accepted and have no effect.",
)
@option(
    "--local-addr",
    group=NODES,
    default=None,
    metavar="ADDR",
    help="With --rdzv-endpoint: the address this node announces (MASTER_ADDR if it "
    "becomes node 0), for hosts with several networks (default: the address that "
    "reaches the endpoint).",
)
@option(
    "--store-token-file",
    group=NODES,
    default=None,
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Per-node launches: read the store secret from FILE (yours, mode 600; the same "
    "on every node). Default: DISTLAUNCH_STORE_TOKEN, else DISTLAUNCH_STORE_TOKEN_FILE, "
    "else ~/.config/distlaunch/secret, created on first use.",
)
@option(
    "--bind-to",
    group=WORKERS,
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "core", "none"]),
    help="CPU affinity of the workers: auto splits this node's CPUs into one block per "
    "worker (round robin when there are more workers than CPUs; with GPUs placed by "
    "--gpus-per-rank/--virtual-local-rank, each worker's block is cut from its GPUs' NUMA "
    "node, shared with the workers whose GPUs are on that node), core gives each "
    "worker one CPU (several launchers on one host then share the lowest CPUs), "
    "none leaves affinity alone (torchrun's behaviour).",
)
@option(
    "--gpus-per-rank",
    group=WORKERS,
    default=None,
    type=click.IntRange(min=1),
    metavar="K",
    help="Give each worker K GPUs of this node's visible list (CUDA_VISIBLE_DEVICES' subset "
    "and order kept): local rank i gets entries i*K..i*K+K-1 as its CUDA_VISIBLE_DEVICES "
    "(HIP/ROCR for AMD), so cuda:0 is its first.",
)
@option(
    "--virtual-local-rank",
    group=WORKERS,
    is_flag=True,
    help="torchrun's: each worker sees exactly one GPU (its own) as cuda:0, and LOCAL_RANK=0.",
)
@option(
    "--numa-binding",
    group=WORKERS,
    default=None,
    type=click.Choice(["node", "socket", "exclusive", "core-complex"]),
    help="torchrun's: each worker's CPUs follow its GPU's NUMA node (node), socket, an "
    "exclusive share of the node's cores, or a last-level-cache complex; within this "
    "launcher's allowed CPUs. Without placement, local rank i drives GPU i.",
)
@option("--no-prefix", group=OUTPUT, is_flag=True, help="Do not prefix worker output lines with [rank]: .")
@option(
    "--logs-specs",
    group=OUTPUT,
    default=None,
    metavar="NAME",
    help="Accepted for torchrun compatibility and ignored: --log-dir, --redirects and "
    "--tee choose where the logs go.",
)
@option(
    "--duplicate-stdout-filters",
    group=OUTPUT,
    default=None,
    metavar="S1,S2",
    help="torchrun's: stdout lines of any worker that contain one of these strings are also "
    "written to LOG_DIR/RUN_ID/attempt_K/filtered_stdout.log (needs --log-dir).",
)
@option(
    "--duplicate-stderr-filters",
    group=OUTPUT,
    default=None,
    metavar="S1,S2",
    help="As --duplicate-stdout-filters, for stderr (filtered_stderr.log).",
)
@option(
    "--stdin",
    group=WORKERS,
    default="0",
    show_default=True,
    type=click.Choice(["0", "all", "none"]),
    help="Who reads this launcher's standard input: rank 0 (mpiexec's behaviour), all "
    "workers (torchrun's: they share it) or none (/dev/null). With -H, only workers on "
    "this machine can read it.",
)
@option(
    "--run-path",
    group=WORKERS,
    is_flag=True,
    help="Run SCRIPT with runpy.run_path inside the interpreter (torchrun's --run-path).",
)
@option(
    "--signals-to-handle",
    group=SUPERVISION,
    default=None,
    metavar="SIG,...",
    help="torchrun's option: distlaunch always forwards SIGINT, SIGTERM, SIGHUP, SIGQUIT "
    "(which stop the job), SIGUSR1 and SIGUSR2 to the workers; any other signal named here "
    "is passed to the workers and stops the job too, as torchrun does. Workers see the "
    "list in TORCHELASTIC_SIGNALS_TO_HANDLE.",
)
@option(
    "--dry-run", is_flag=True, help="Print the plan (ranks, command lines, environment) and start nothing."
)
@option("--root-cause-file", hidden=True, default=None, help="Internal: see command.root_cause_to.")
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx: click.Context, script: str | None, script_args: tuple[str, ...], **o: Any) -> None:
    """Start SCRIPT on every worker and supervise it. Everything after SCRIPT goes to the
    script untouched. Each option may also come from PET_<NAME> (e.g. PET_NNODES), as
    torchrun reads them (Kubeflow's PyTorchJob sets them); the command line wins."""
    job = ctx.meta.get("job_file", {})
    script_from_job = script is None
    if script_from_job:  # a command-line script replaces the job file's script and args
        script, script_args = job.get("script"), tuple(job.get("args", ()))
    if script is None:
        raise click.UsageError("Missing argument 'SCRIPT' (or 'script:' in the --config file).", ctx)
    root_cause_file = o.pop("root_cause_file")
    if o.pop("print_config"):
        _print_config(ctx, script, script_args, o, script_from_job)
        return
    dry_run = o.pop("dry_run")
    from click.core import ParameterSource

    given = frozenset(n for n in o if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None))
    from .startup import pause_gc, resume_gc

    pause_gc()  # as the pre-parsed form (preparse.run): until the workers' supervision starts
    try:
        run_parsed(
            script,
            script_args,
            o,
            given,
            dry_run=dry_run,
            root_cause_file=root_cause_file,
            show_head_plan=_print_head_plan,
            show_plan=_print_plan,
        )
    finally:  # a caller that invokes the command in-process goes on with its collector
        resume_gc()


# `run`'s parameters that the command consumes itself; every other one is a field of
# run_options.RunOptions, checked when this module is imported (an option nothing reads would
# be dropped silently).
_RUN_ONLY = frozenset({"script", "script_args", "print_config", "dry_run", "root_cause_file"})


def _check_run_options(command: click.Command) -> None:
    from .preparse import DEFAULTS
    from .run_options import RunOptions

    names = {p.name for p in command.params if p.expose_value and p.name} - _RUN_ONLY
    if names - RunOptions.names():
        raise TypeError(
            f"`run` options without a RunOptions field: {', '.join(sorted(names - RunOptions.names()))}"
        )
    if names ^ set(DEFAULTS):  # the pre-parser passes every option, defaulted as click does
        raise TypeError(
            f"preparse.DEFAULTS differs from `run`'s options in: {', '.join(sorted(names ^ set(DEFAULTS)))}"
        )


_check_run_options(run)


def _print_config(
    ctx: click.Context, script: str, args: tuple[str, ...], o: dict[str, Any], script_from_job: bool
) -> None:
    """The merged options as YAML, each line followed by where its value came from:
    the command line, a PET_* variable, the job file, or the default."""
    import yaml
    from click.core import ParameterSource

    params = {p.name: p for p in ctx.command.params}
    merged = {k: (list(v) if isinstance(v, tuple) else v) for k, v in o.items()}
    merged["env"] = merged.pop("env_names")
    merged.update(script=script, args=list(args))
    for key, value in merged.items():
        name = "env_names" if key == "env" else key
        source = ctx.get_parameter_source(name) if name in params else None
        if key in ("script", "args"):
            where = "from the job file" if script_from_job else "from the command line"
        elif source is ParameterSource.ENVIRONMENT:
            where = f"from {params[name].envvar}"
        elif source is ParameterSource.DEFAULT_MAP:
            where = "from the job file"
        elif source in (ParameterSource.DEFAULT, None):
            where = "default"
        else:
            where = "from the command line"
        line = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=True, width=1 << 20).strip()
        click.echo(f"{line[1:-1]}  # {where}")


def _print_head_plan(mode: HeadNodes) -> None:
    from .engine import plugin
    from .head import agent_launch
    from .hosts import slots_of
    from .topology import assign_ranks

    cfg, head = mode.job, mode.head
    env, launch = agent_launch(head)  # as head.run_hosts
    cmd = plugin(head.engine).describe(dict(enumerate(head.hosts)), launch)
    nodes = assign_ranks([slots_of(h) for h in head.hosts])
    click.echo(
        f"run id {cfg.run_id}: {sum(map(len, nodes))} workers on {len(nodes)} host(s), "
        f"max restarts {cfg.max_restarts}; the store secret goes over stdin (****)"
    )
    shipped = sorted(set(env) | {k for k, _ in cfg.env})
    for h, slots in zip(head.hosts, nodes):
        click.echo(f"node {slots[0].node_rank} {h.name}: ranks {slots[0].rank}..{slots[-1].rank}")
        click.echo(f"    agent: {cmd} (after checking the directory and the interpreter)")
        if h.devices is not None:
            click.echo(f"    CUDA_VISIBLE_DEVICES={','.join(map(str, h.devices))}")
        if shipped:  # values may be secrets: names only
            click.echo(f"    shipped over stdin: {' '.join(shipped)}")


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("op", default="all_reduce", metavar="[OP]")
@click.option(
    "--nproc-per-node",
    "--nproc_per_node",
    default="2",
    show_default=True,
    metavar="N",
    help="Workers on this node (or on each host without a slot count).",
)
@click.option(
    "-H",
    "--hosts",
    default=None,
    metavar="HOST[:N],...",
    help="Measure across these hosts (started over SSH, as distlaunch run -H).",
)
@click.option(
    "--sizes",
    default="8B..64MiB",
    show_default=True,
    metavar="MIN..MAX",
    help="Message sizes in bytes per rank, doubling from MIN to MAX (B, KiB, MiB, GiB).",
)
@click.option("--dtype", default="float32", show_default=True, help="Element type.")
@click.option(
    "--iters",
    default=None,
    type=int,
    metavar="N",
    help="Timed iterations per size, at least 1 (default: by size).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines instead of the table.")
@click.option(
    "--plot",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also draw bandwidth against size to this PNG (needs matplotlib).",
)
@click.argument("run_options", nargs=-1, type=click.UNPROCESSED)
def bench(
    op: str,
    nproc_per_node: str,
    hosts: str | None,
    sizes: str,
    dtype: str,
    iters: int | None,
    as_json: bool,
    plot: str | None,
    run_options: tuple[str, ...],
) -> None:
    """Measure the collective OP (all_reduce by default; the benchmarked entries of the
    op table, and send_recv), nccl-tests style: rank 0 prints size, count, dtype, time,
    algbw, busbw and a correctness check per size. Extra options go to distlaunch run
    (e.g. --ssh-config). Bad --sizes, --dtype or --iters exit 2 before any worker starts."""
    from .collectives.bench import OPS, parse_options

    if op not in OPS:  # the op table's benchmarked ops (collectives/optable.py), and send_recv
        raise ConfigError(f"bench {op!r} is not a benchmarked operation: give one of {', '.join(OPS)}")
    try:
        parse_options(sizes, dtype, iters)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    args = [
        "--nproc-per-node",
        nproc_per_node,
        *(["-H", hosts] if hosts else []),
        *run_options,
        "-m",
        "distlaunch.collectives.bench",
        op,
        "--sizes",
        sizes,
        "--dtype",
        dtype,
    ]
    args += [
        *(["--iters", str(iters)] if iters is not None else []),
        *(["--json"] if as_json else []),
        *(["--plot", plot] if plot else []),
    ]
    # errors propagate to main(), which maps them to messages and exit codes
    run.main(args=["--no-prefix", *args], prog_name="distlaunch run", standalone_mode=False)


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL (generated from this command tree).

    Enable it with, e.g., `eval "$(distlaunch completion bash)"` in ~/.bashrc, or copy the
    files in completions/ to your shell's completion directory.
    """
    from click.shell_completion import get_completion_class

    comp_class = get_completion_class(shell)
    assert comp_class is not None  # click has all the choices built in
    comp = comp_class(cli, {}, "distlaunch", "_DISTLAUNCH_COMPLETE")
    click.echo(comp.source())


@cli.command()
def ps() -> None:
    """List your running jobs on this host: run id, start time, world size, hosts."""
    from .observe.viewer import ps as show

    show()


@cli.command()
@click.argument("run_id", required=False)
@click.option("--once", is_flag=True, help="Print one table and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one table as JSON (for scripts) and exit.")
def top(run_id: str | None, once: bool, as_json: bool) -> None:
    """A live table of every rank of a running job: pid, state, CPU, memory, the
    operation in flight, its last output line. RUN_ID may be left out when one job runs."""
    from .observe.viewer import top as show

    show(run_id, once, as_json)


@cli.command()
@click.argument("run_id", required=False)
@click.option("--all", "full", is_flag=True, help="Every frame, not only the user's code.")
@click.option(
    "--native",
    is_flag=True,
    help="Native (C/C++) frames too, where py-spy can unwind them (slower: ~0.2 s a rank).",
)
def stacks(run_id: str | None, full: bool, native: bool) -> None:
    """Every rank's Python stack of a running job, ranks with identical stacks grouped.
    RUN_ID may be left out when one job runs."""
    from .observe.viewer import stacks as read

    click.echo(read(run_id, full, native=native))


@cli.command(hidden=True)
def agent() -> None:
    """Internal: one node's agent, started by the head (``agent/entry.py``)."""
    from .agent.entry import main

    main()


@cli.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0 for every interface).",
)
@click.option(
    "--port",
    default=29400,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0: any free port, printed at start).",
)
def store(host: str, port: int) -> None:
    """Run a standalone rendezvous store until Ctrl-C or SIGTERM.

    The secret comes from DISTLAUNCH_STORE_TOKEN; if unset, one is generated and shown
    once on stderr. Clients must present it (HMAC challenge; never sent in clear). An
    address that cannot be bound exits 2 before anything is served.
    """
    import os

    from .env import lookup
    from .errors import StoreError
    from .store import StoreServer

    given_token = lookup("DISTLAUNCH_STORE_TOKEN")
    token = given_token or os.urandom(16).hex()
    server = StoreServer(host, port, token)
    try:
        server.start()
    except StoreError as e:
        # socket.create_server's OSError adds "(while attempting to bind on address ...)"
        why = str(getattr(e.__cause__, "strerror", None) or e).split(" (while attempting")[0]
        raise ConfigError(
            f"--host {host} --port {port} cannot be bound ({why}); choose a free --port "
            f"(0 picks one) and, for --host, an address of this machine"
        ) from None

    def ready(server: StoreServer) -> None:
        say(f"store listening on {host}:{server.port}")
        if given_token is None:
            say(f"generated secret (export it for clients): DISTLAUNCH_STORE_TOKEN={token}")

    server.serve_forever(on_ready=ready)


def _print_plan(plan: Plan) -> None:
    """The variables every worker gets alike once, then per rank only those that differ
    (of the ones set or changed from this environment); -x values and the store secret
    as ****; a port chosen at start as such."""
    import os
    import shlex

    from .devices import node_gpus
    from .modes import DynamicNodes, SingleNode
    from .numa import places_gpus, rank_bindings
    from .topology import format_cpus

    c, mode = plan.cfg, plan.mode
    click.echo(
        f"run id {c.run_id}: {len(plan.slots)} workers on node {mode.node_rank} of "
        f"{mode.nnodes}, max restarts {c.max_restarts}"
    )
    click.echo(f"store: {mode.store_text()}, token DISTLAUNCH_STORE_TOKEN=****")
    bindings = rank_bindings(c, len(plan.slots), os.environ, os.sched_getaffinity(0))
    if places_gpus(c) or c.numa_binding:
        visible = node_gpus(os.environ)
        click.echo(f"GPUs of this node: {','.join(visible.ids) or 'none'} (from {visible.source})")
    hidden = set(SECRET_VARS) | {k for k, _ in c.env}  # -x values may be secrets
    envs = []
    for slot, binding in zip(plan.slots, bindings):
        full = {**plan.worker_env(slot), **binding.env}
        env = {k: v for k, v in full.items() if os.environ.get(k) != v}
        if plan.master_port is None:
            where = "this node" if isinstance(mode, SingleNode) else "node 0"
            env["MASTER_PORT"] = f"<a free port on {where}, chosen at start>"
        if isinstance(mode, DynamicNodes):  # whichever launcher becomes node 0 announces it
            env["MASTER_ADDR"] = "<node 0's address, announced at start>"
        envs.append({k: "****" if k in hidden else v for k, v in env.items()})
    same = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)}
    click.echo(f"every worker: {shlex.join(plan.argv)}")
    for k in sorted(same):
        click.echo(f"    {k}={same[k]}")
    for slot, env, b in zip(plan.slots, envs, bindings):
        own = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k not in same)
        where = f"local rank {slot.local_rank}, cpus {format_cpus(b.cpus)}"
        if b.devices is not None:
            where += f", devices {','.join(d.id for d in b.devices)}"
        if b.note:
            where += f", {b.note}"
        click.echo(f"rank {slot.rank} ({where}): {own}")


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: run the CLI and exit with the right code (``os._exit`` after
    flushing stdout and stderr: see ``_leave``)."""
    install(Reporter(live=sys.stderr.isatty()))  # the live status only on a terminal
    try:
        cli.main(args=argv, prog_name="distlaunch", standalone_mode=False)
    except click.exceptions.Exit as e:
        _leave(e.exit_code)
    except click.UsageError as e:
        cmd = e.ctx.command_path if e.ctx else "distlaunch"
        say(f"error: {e.format_message()} (see '{cmd} --help')")
        _leave(2)
    except click.Abort as e:  # click wrote a blank line
        _leave(report_abort(e, blank=False))
    except DistlaunchError as e:
        _report(e)
        _leave(e.exit_code)
    _leave(0)


# the click-free exit helpers, under the names this module's callers know
_report, _one_line, _leave = report_error, one_line, leave
