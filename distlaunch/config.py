"""LaunchConfig: the validated job every node's agent runs (program, workers per node,
supervision, output), whatever the launch mode; the mode and its nodes are decided in
``modes.py``. RunOptions, `distlaunch run`'s options, each value parsed and bounds-checked
once, is in ``run_options.py`` (the CLI's and ``modes``'; an agent, which reads a
LaunchConfig, never loads it).

Option meanings follow torchrun (``torch.distributed.run``); checks that need no I/O
beyond the file system happen here, so every bad value is reported before anything
starts (ConfigError -> exit code 2).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from .errors import ConfigError
from .topology import MAX_SLOTS_PER_NODE
from .workerenv import MAX_RESTARTS as MAX_RESTARTS  # (the fast lane checks it too)

# torchrun's Std values: which of a worker's streams an option applies to.
STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3


@dataclass(frozen=True)
class StdSpec:
    """torchrun's ``--redirects``/``--tee`` value: one Std for all local ranks
    (``"3"``) or per local rank (``"0:1,1:2"``; unlisted ranks get NONE)."""

    default: int = STD_NONE
    per_rank: tuple[tuple[int, int], ...] = ()

    def for_rank(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default)

    @property
    def any(self) -> bool:
        return bool(self.default or any(v for _, v in self.per_rank))


def parse_std(value: str | int | None, option: str) -> StdSpec:
    """torchrun's ``--redirects``/``--tee`` value; ConfigError naming ``option``."""
    if value is None or value == "":
        return StdSpec()
    text = str(value).strip()
    bad = ConfigError(
        f"{option} {text!r} is invalid: use 0 (none), 1 (stdout), 2 (stderr), "
        f"3 (both), or per local rank like '0:3,1:2'"
    )
    if re.fullmatch(r"[0-3]", text):
        return StdSpec(int(text))
    pairs = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-3])\s*", item)
        if not m:
            raise bad
        pairs.append((int(m.group(1)), int(m.group(2))))
    return StdSpec(STD_NONE, tuple(pairs))


# Run ids name log directories and store keys: no path separators, no '.'/'..', no
# leading '-' (an option to a command), bounded length.
RUN_ID_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


def run_id_from(text: str) -> str:
    """A valid run id made from ``text`` (e.g. an endpoint ``[::1]:29400``): every other
    character becomes '-'. Pure."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", text).lstrip(".-")[:128] or "job"


TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import Any, TypedDict

    class RdzvOptions(TypedDict, total=False):
        """--rdzv-conf keys (torchrun's names where torchrun has one), each a NodeOptions
        field, in seconds: RDZV_KEYS."""

        join_timeout: float
        heartbeat_timeout: float
        heartbeat_interval: float
        exit_barrier_timeout: float
        last_call_timeout: float


# RdzvOptions' keys, each a NodeOptions field (tests/test_pure.py)
RDZV_KEYS = frozenset(
    {"join_timeout", "heartbeat_timeout", "heartbeat_interval", "exit_barrier_timeout", "last_call_timeout"}
)
# torchrun's other --rdzv-conf keys (torch.distributed.elastic.rendezvous: the dynamic
# handler's settings and the c10d backend's): "timeout" is the overall join timeout;
# keep_alive_interval / keep_alive_max_attempt are the heartbeat (a node is lost after
# interval x attempts without one); is_host says whether this launcher hosts the store.
RDZV_ALIASES = {"timeout": "join_timeout", "keep_alive_interval": "heartbeat_interval"}
# Accepted and without effect: distlaunch's store reads do not time out on their own
# (join_timeout bounds the rendezvous), and a round closes at once through its stop key.
RDZV_NO_EFFECT = frozenset({"read_timeout", "close_timeout"})
TORCHRUN_RDZV_KEYS = frozenset(RDZV_ALIASES) | RDZV_NO_EFFECT | {"keep_alive_max_attempt", "is_host"}


# --stdin: rank 0 only (mpiexec), every worker (torchrun: they inherit it), nobody.
STDIN_MODES = ("0", "all", "none")
HEARTBEAT_INTERVAL = 1.0  # seconds between a node's heartbeats (NodeOptions' default)


def parse_rdzv_conf(text: str | None) -> tuple[tuple[str, str], ...]:
    """torchrun's ``--rdzv-conf k1=v1,k2=v2``."""
    if not text:
        return ()
    pairs = []
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(
                f"--rdzv-conf item {item!r} is invalid: use key=value pairs separated by commas"
            )
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def parse_nproc_per_node(value: str | int) -> int:
    """torchrun's ``--nproc-per-node``: a positive int, or ``auto`` (GPUs if any, else
    CPUs), ``cpu`` (CPU count), ``gpu`` (the GPUs this process may use:
    ``devices.node_gpus``, which honours CUDA/HIP/ROCR_VISIBLE_DEVICES; an error without
    any) or ``xpu`` (Intel GPUs: ``devices.xpu_count``; an error without any)."""
    text = str(value).strip().lower()
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        from .devices import node_gpus, require_gpus

        visible = node_gpus(os.environ)
        if text == "auto":
            return len(visible) or os.cpu_count() or 1
        return require_gpus(visible)
    if text == "xpu":
        from .devices import xpu_count

        n, source = xpu_count(os.environ)
        if n == 0:
            raise ConfigError(
                f"--nproc-per-node xpu: no Intel GPU found on this node ({source}); give a number or 'cpu'"
            )
        return n
    try:
        n = int(text) if len(text) <= 12 else MAX_SLOTS_PER_NODE + 1  # int() of 5000 digits fails
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node {value!r} is not a number; give a positive integer or one of "
            f"auto, cpu, gpu, xpu"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {n} is invalid: give at least 1")
    if n > MAX_SLOTS_PER_NODE:
        raise ConfigError(
            f"--nproc-per-node {text} is more than the {MAX_SLOTS_PER_NODE} workers "
            f"one node may run; give a smaller number"
        )
    return n


def parse_filters(value: str | None) -> tuple[str, ...]:
    """torchrun's ``--duplicate-stdout-filters a,b``: substrings, blanks dropped."""
    return tuple(f for f in (value or "").split(",") if f.strip())


def parse_ranks_filter(value: str | None) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1``; None (no filter) when empty."""
    if not value:
        return None
    try:
        ranks = frozenset(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter {value!r} is invalid: give local ranks separated by commas, like '0,1'"
        ) from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--local-ranks-filter {value!r} has a negative rank")
    return ranks


@dataclass(frozen=True)
class LaunchConfig:
    """The job every node's agent runs (the head sends it to remote agents as JSON).
    Build with ``LaunchConfig(...)`` and call ``validate()``; all durations are float
    seconds."""

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    module: bool = False
    no_python: bool = False
    role: str = "default"
    run_id: str = field(default_factory=lambda: os.urandom(6).hex())
    log_dir: str | None = None
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    local_ranks_filter: frozenset[int] | None = None
    stop_timeout: float = 30.0
    prefix: bool = True
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    run_path: bool = False  # torchrun's --run-path: the script runs through runpy.run_path
    stdin: str = "0"  # who reads the launcher's stdin: STDIN_MODES
    env: tuple[tuple[str, str], ...] = ()  # -x NAME[=VALUE]: set for every worker
    bind_to: str = "auto"  # CPU affinity of the workers: topology.BIND_MODES
    gpus_per_rank: int | None = None  # devices placed per local rank (numa.rank_bindings)
    virtual_local_rank: bool = False  # torchrun's: one device each as cuda:0, LOCAL_RANK=0
    numa_binding: str | None = None  # torchrun's --numa-binding: numa.NUMA_MODES
    signals_to_handle: str | None = None  # torchrun's: also forwarded, in TORCHELASTIC_SIGNALS_TO_HANDLE
    duplicate_stdout_filters: tuple[str, ...] = ()  # torchrun's: matching lines also to a file
    duplicate_stderr_filters: tuple[str, ...] = ()
    hang_timeout: float = 0.0  # seconds without progress of any rank before a hang (0: off)
    stacks_on_failure: bool = True  # the survivors' stacks when a worker fails (needs py-spy)
    dedup_output: bool = False  # identical lines of several ranks printed once, [0-7]: line

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (the head sends it to remote agents)."""
        import dataclasses

        d = dataclasses.asdict(self)
        d["local_ranks_filter"] = sorted(self.local_ranks_filter) if self.local_ranks_filter else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LaunchConfig:
        d = dict(d)
        d["args"] = tuple(d["args"])
        d["redirects"] = StdSpec(d["redirects"]["default"], tuple(map(tuple, d["redirects"]["per_rank"])))
        d["tee"] = StdSpec(d["tee"]["default"], tuple(map(tuple, d["tee"]["per_rank"])))
        d["rdzv_conf"] = tuple(map(tuple, d["rdzv_conf"]))
        d["env"] = tuple(map(tuple, d["env"]))
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            d[name] = tuple(d[name])
        if d["local_ranks_filter"] is not None:
            d["local_ranks_filter"] = frozenset(d["local_ranks_filter"])
        return cls(**d)

    def rdzv_options(self) -> RdzvOptions:
        """--rdzv-conf as agent options (seconds), torchrun's names mapped to ours.
        Raises ConfigError for unknown keys or values that are not positive numbers."""
        out: dict[str, float] = {}
        attempts: float | None = None
        for key, raw in self.rdzv_conf:
            if key not in RDZV_KEYS and key not in TORCHRUN_RDZV_KEYS:
                known = ", ".join(sorted(RDZV_KEYS | TORCHRUN_RDZV_KEYS))
                raise ConfigError(f"--rdzv-conf key {key!r} is unknown; use {known}")
            if key == "is_host":
                self.rdzv_is_host()
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"--rdzv-conf {key}={raw!r} is invalid: give a positive number of seconds")
            if key == "keep_alive_max_attempt":
                attempts = value
            elif key not in RDZV_NO_EFFECT:
                out[RDZV_ALIASES.get(key, key)] = value
        if attempts is not None and "heartbeat_timeout" not in out:
            out["heartbeat_timeout"] = attempts * out.get("heartbeat_interval", HEARTBEAT_INTERVAL)
        return out  # type: ignore[return-value]  # its keys are checked against RDZV_KEYS above

    def rdzv_is_host(self) -> bool | None:
        """--rdzv-conf is_host (torchrun's c10d backend): True, this launcher must host the
        store at the endpoint; False, it must not try; None, whoever binds it first.
        Raises ConfigError for a value that is not a boolean."""
        for key, raw in self.rdzv_conf:
            if key == "is_host":
                value = raw.strip().lower()
                if value in ("1", "true", "yes", "y"):
                    return True
                if value in ("0", "false", "no", "n"):
                    return False
                raise ConfigError(f"--rdzv-conf is_host={raw!r} is invalid: give true or false")
        return None

    def validate(self) -> LaunchConfig:
        """Raise ConfigError (one line naming the bad value and the fix) or return self."""
        given = [
            f
            for f, on in (
                ("--module", self.module),
                ("--no-python", self.no_python),
                ("--run-path", self.run_path),
            )
            if on
        ]
        if len(given) > 1:
            raise ConfigError(f"{' and '.join(given)} cannot be combined; choose one")
        if self.stdin not in STDIN_MODES:
            raise ConfigError(f"--stdin {self.stdin!r} is invalid: give {', '.join(STDIN_MODES)}")
        self.rdzv_options()
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts {self.max_restarts} is invalid: give 0 to {MAX_RESTARTS}")
        if not (0 <= self.stop_timeout < math.inf):  # also refuses nan
            raise ConfigError(
                f"--stop-timeout {self.stop_timeout} is invalid: give a finite number of seconds, 0 or more"
            )
        if not (0 <= self.hang_timeout < math.inf):
            raise ConfigError(
                f"--hang-timeout {self.hang_timeout} is invalid: give a finite number of seconds, 0 (off) "
                f"or more"
            )
        if not (0 < self.monitor_interval < math.inf):
            raise ConfigError(
                f"--monitor-interval {self.monitor_interval} is invalid: give a positive number of seconds"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is invalid: give 1..65535")
        if not RUN_ID_RE.fullmatch(self.run_id):
            raise ConfigError(
                f"--run-id {self.run_id!r} is invalid: use up to 128 letters, "
                f"digits, '.', '_' and '-', starting with a letter, digit or '_'"
            )
        from .topology import BIND_MODES

        if self.bind_to not in BIND_MODES:
            raise ConfigError(f"--bind-to {self.bind_to!r} is invalid: give one of {', '.join(BIND_MODES)}")
        self._check_devices()
        self._check_entrypoint()
        if self.log_dir is not None:
            self._check_log_dir(self.log_dir)
        return self

    def _check_devices(self) -> None:
        if self.gpus_per_rank is not None and self.gpus_per_rank < 1:
            raise ConfigError(f"--gpus-per-rank {self.gpus_per_rank} is invalid: give at least 1")
        if self.numa_binding is not None:
            from .numa import NUMA_MODES  # (only then: a head never loads numa otherwise)

            if self.numa_binding not in NUMA_MODES:
                raise ConfigError(
                    f"--numa-binding {self.numa_binding!r} is invalid: give one of {', '.join(NUMA_MODES)}"
                )
            if self.bind_to != "auto":
                raise ConfigError(
                    f"--numa-binding {self.numa_binding} and --bind-to {self.bind_to} both set the "
                    f"workers' CPUs; drop one"
                )
        if (self.duplicate_stdout_filters or self.duplicate_stderr_filters) and self.log_dir is None:
            raise ConfigError(
                "--duplicate-stdout-filters/--duplicate-stderr-filters write their lines under "
                "--log-dir; give --log-dir DIR"
            )

    def _check_entrypoint(self) -> None:
        if self.module:
            if not re.fullmatch(r"[A-Za-z_][\w.]*", self.entrypoint):
                raise ConfigError(f"--module {self.entrypoint!r} is not a module name")
        elif self.no_python:
            import shutil  # (with bz2, lzma, fnmatch: only for --no-python)

            if shutil.which(self.entrypoint) is None:
                raise ConfigError(
                    f"--no-python: program {self.entrypoint!r} not found on PATH or not executable"
                )
        elif not os.path.isfile(self.entrypoint):
            raise ConfigError(
                f"script {self.entrypoint!r} not found; check the path "
                f"(use -m for a module, --no-python for a program)"
            )

    @staticmethod
    def _check_log_dir(log_dir: str) -> None:
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"--log-dir {log_dir!r} cannot be created ({e.strerror}); choose a writable directory"
            ) from None
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"--log-dir {log_dir!r} is not writable; choose a writable directory")


def load_job_file(path: str) -> list[tuple[str, object, int]]:
    """Read a YAML job file: a mapping of option names to values. Returns (key, value,
    line) triples, line 1-based, in file order. Raises ConfigError naming the file (and
    line) when it cannot be read, is not YAML, or is not a mapping with string keys."""
    import yaml  # only when a job file is used

    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path!r} cannot be read ({e.strerror})") from None
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return []
            if not isinstance(node, yaml.MappingNode):
                raise ConfigError(
                    f"{path}:{node.start_mark.line + 1}: the job file must be a "
                    f"mapping of option names to values"
                )
            out = []
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                    raise ConfigError(f"{path}:{line}: keys must be option names")
                out.append((key_node.value, loader.construct_object(value_node, deep=True), line))
            return out
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
