"""RunOptions: `distlaunch run`'s options by their parameter names, each value parsed and
bounds-checked once (the CLI and ``modes`` build it; an agent, which reads a
``config.LaunchConfig``, never loads this module: ~2 ms of dataclasses less before its
workers start).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .config import (
    StdSpec,
    parse_filters,
    parse_nproc_per_node,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std,
)
from .errors import ConfigError


def parse_nnodes(text: str) -> NodeCount:
    """torchrun's ``--nnodes``: ``N`` -> (N, None), ``MIN:MAX`` -> (MIN, MAX)."""
    lo, sep, hi = text.partition(":")
    try:
        return NodeCount(int(lo), int(hi) if sep else None, text)
    except ValueError:
        raise ConfigError(
            f"--nnodes {text!r} is invalid: give a number of nodes N or a range MIN:MAX"
        ) from None


@dataclass(frozen=True)
class NodeCount:
    """``--nnodes``: ``min`` nodes, up to ``max`` (None: exactly ``min``); shown as given."""

    min: int
    max: int | None
    text: str

    def __str__(self) -> str:
        return self.text


# Options parsed from their text here (each parser raises ConfigError naming the option),
# in the order their errors are reported.
_RUN_PARSERS = {
    "nnodes": parse_nnodes,
    "nproc_per_node": parse_nproc_per_node,
    "redirects": lambda v: parse_std(v, "--redirects"),
    "tee": lambda v: parse_std(v, "--tee"),
    "local_ranks_filter": parse_ranks_filter,
    "rdzv_conf": parse_rdzv_conf,
    "duplicate_stdout_filters": parse_filters,
    "duplicate_stderr_filters": parse_filters,
}


@dataclass(frozen=True, eq=False)  # parsed once, never compared: no __eq__/__hash__ to build
class RunOptions:
    """`distlaunch run`'s options by their parameter names, built once (``parse``) from
    the command line, the job file (--config) and PET_* variables (click merges those
    three), and a scheduler's variables (merged by ``modes``, see engine/). The text
    options of ``_RUN_PARSERS`` are parsed here; click has converted the others (ints,
    floats, choices). Every field is used by ``modes.resolve`` (its import-time check),
    and every `run` option is a field (cli's)."""

    script: str
    script_args: tuple[str, ...]
    given: frozenset[str]  # the names set by the user (or a scheduler), not defaulted
    # workers
    nproc_per_node: int
    module: bool
    no_python: bool
    run_path: bool
    role: str
    env_names: tuple[str, ...]
    env_file: tuple[str, ...]
    bind_to: str
    gpus_per_rank: int | None
    virtual_local_rank: bool
    numa_binding: str | None
    stdin: str
    start_method: str  # accepted for torchrun compatibility (cli's help says why)
    # nodes and rendezvous
    nnodes: NodeCount
    node_rank: int
    master_addr: str | None
    master_port: int | None
    run_id: str | None
    standalone: bool
    rdzv_endpoint: str | None
    rdzv_id: str | None
    rdzv_backend: str
    rdzv_conf: tuple[tuple[str, str], ...]
    local_addr: str | None
    store_token_file: str | None
    # hosts and SSH
    hosts: str | None
    hostfile: str | None
    include: str | None
    exclude: str | None
    launcher: str
    store_addr: str | None
    remote_python: str | None
    remote_cwd: str | None
    ssh_port: int | None
    ssh_user: str | None
    ssh_key: str | None
    ssh_config: str | None
    ssh_accept_new_host_keys: bool
    env_all: bool
    # output
    log_dir: str | None
    redirects: StdSpec
    tee: StdSpec
    local_ranks_filter: frozenset[int] | None
    prefix_host: bool
    no_prefix: bool
    event_log_handler: str | None  # accepted for torchrun compatibility, ignored
    logs_specs: str | None  # accepted for torchrun compatibility, ignored
    duplicate_stdout_filters: tuple[str, ...]
    duplicate_stderr_filters: tuple[str, ...]
    # supervision
    max_restarts: int
    monitor_interval: float
    stop_timeout: float
    min_nodes: int | None
    signals_to_handle: str | None
    hang_timeout: float
    stacks_on_failure: bool
    dedup_output: bool

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every field's name."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def parse(
        cls, script: str, script_args: tuple[str, ...], options: Mapping[str, Any], given: frozenset[str]
    ) -> RunOptions:
        """The options of `run SCRIPT SCRIPT_ARGS` (``options``: click's values by name).
        Raises ConfigError for a bad value (the first in ``_RUN_PARSERS``' order),
        TypeError for a name that is no field."""
        values = dict(options)
        for name, parse in _RUN_PARSERS.items():
            values[name] = parse(values[name])
        return cls(script=script, script_args=tuple(script_args), given=given, **values)

    def replace(self, **changes: Any) -> RunOptions:
        import dataclasses

        return dataclasses.replace(self, **changes)
