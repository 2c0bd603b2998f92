"""A narrow pre-parser for the common single-node form of `distlaunch run`, tried before
click is imported (click and `run`'s ~60 options cost ~20 ms of a ~100 ms launch):

    distlaunch run [--nproc-per-node N | --nproc-per-node=N] [--max-restarts R | --max-restarts=R]
                   [--standalone] [--] SCRIPT.py [ARGS...]

N and R are decimal digits; each option at most once; SCRIPT ends in ``.py`` and does not start
with ``-``; everything after it is the script's, untouched (as click passes it). It
yields exactly what click's parsing of the same command line gives ``run``
(tests/test_preparse.py compares the two on generated command lines and environments)
and declines (None) anything else: other options, abbreviations, --help, a value it
does not know click would read the same way, an environment variable click would read
as an option's value (``PET_*``, ``TORCH_ELASTIC_*``; to be safe also ``TORCHELASTIC_*``,
``DISTLAUNCH_*``) or click's completion variable. A Slurm allocation's variables are
not among them (click reads none), so the head over an allocation takes it too, after
``__main__`` started the agent step. Declined command lines go to click unchanged, so
usage errors, --help and exit codes stay click's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from .workerenv import in_slurm_job

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~3 ms)
if TYPE_CHECKING:
    from typing import Any, NoReturn

    Parsed = tuple[str, tuple[str, ...], dict[str, Any], frozenset[str]]

# `run`'s parameters as click passes them when none is given (cli.run's defaults;
# tests/test_preparse.py checks them against click's).
DEFAULTS: dict[str, Any] = {
    "nproc_per_node": "1",
    "nnodes": "1",
    "node_rank": 0,
    "master_addr": None,
    "master_port": None,
    "max_restarts": 0,
    "monitor_interval": 0.1,
    "module": False,
    "no_python": False,
    "role": "default",
    "run_id": None,
    "log_dir": None,
    "redirects": "0",
    "tee": "0",
    "dedup_output": False,
    "local_ranks_filter": None,
    "standalone": False,
    "stop_timeout": 30.0,
    "hang_timeout": 0.0,
    "stacks_on_failure": True,
    "start_method": "spawn",
    "event_log_handler": None,
    "hosts": None,
    "hostfile": None,
    "include": None,
    "exclude": None,
    "launcher": "auto",
    "store_addr": None,
    "remote_python": None,
    "remote_cwd": None,
    "ssh_port": None,
    "ssh_user": None,
    "ssh_key": None,
    "ssh_config": None,
    "ssh_accept_new_host_keys": False,
    "env_names": (),
    "env_file": (),
    "env_all": False,
    "prefix_host": False,
    "min_nodes": None,
    "rdzv_endpoint": None,
    "rdzv_id": None,
    "rdzv_backend": "c10d",
    "rdzv_conf": None,
    "local_addr": None,
    "store_token_file": None,
    "bind_to": "auto",
    "gpus_per_rank": None,
    "virtual_local_rank": False,
    "numa_binding": None,
    "no_prefix": False,
    "logs_specs": None,
    "duplicate_stdout_filters": None,
    "duplicate_stderr_filters": None,
    "stdin": "0",
    "run_path": False,
    "signals_to_handle": None,
}
# Variables whose presence sends the command line to click: those click reads as option
# values (PET_*, TORCH_ELASTIC_SHUTDOWN_TIMEOUT), click's completion switch, and, to be
# safe, the rest of the families the launcher reads.
DECLINE_PREFIXES = ("PET_", "TORCH_ELASTIC_", "TORCHELASTIC_", "DISTLAUNCH_", "_DISTLAUNCH_")
# The count options it takes (digits only), by the parameter name click gives them.
COUNTS = {"--nproc-per-node": "nproc_per_node", "--max-restarts": "max_restarts"}


def parse(argv: list[str], environ: Mapping[str, str]) -> Parsed | None:
    """``argv`` (after the program name) as (script, script_args, options, given), as
    click would give `run` (``command.run_parsed``'s arguments), or None: not the narrow
    form, or an environment that click would read."""
    if argv[:1] != ["run"] or any(k.startswith(DECLINE_PREFIXES) for k in environ):
        return None
    options = dict(DEFAULTS)
    given: set[str] = set()
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break
        name, eq, value = arg.partition("=")
        if name == "--standalone" and not eq and "standalone" not in given:
            options["standalone"] = True
            given.add("standalone")
            i += 1
        elif name in COUNTS and COUNTS[name] not in given:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if not (value.isascii() and value.isdigit()):  # a count (int() reads it as click does)
                return None
            key = COUNTS[name]  # --nproc-per-node: click passes it as text; --max-restarts: an int
            options[key] = value if key == "nproc_per_node" else int(value)
            given.add(key)
            i += 1
        else:
            return None
    if i >= len(argv) or argv[i].startswith("-") or not argv[i].endswith(".py"):
        return None
    return argv[i], tuple(argv[i + 1 :]), options, frozenset(given)


def main(argv: list[str]) -> None:
    """Run `distlaunch ARGV` through the pre-parser and exit (as ``cli.main`` would);
    return without doing anything when it declines (the caller goes on to click)."""
    parsed = parse(argv, os.environ)
    if parsed is None:
        return
    run(parsed)


def run(parsed: Parsed) -> NoReturn:
    """Run a pre-parsed `run` to its end and exit with ``cli.main``'s code and report:
    through the fast lane (``quick.py``) where it takes the job, else the full path."""
    import errno
    import time

    start_cpu = time.process_time()  # (quick.Early.import_delay)
    from .errors import DistlaunchError
    from .report import Reporter, install
    from .startup import leave, pause_gc

    # The fast lane declines in a Slurm job (quick.start): its head does not load it (~6 ms
    # of CPU while the agent step starts: guard, relay, threading, ctypes).
    lane = not in_slurm_job(os.environ)
    if lane:
        from . import quick
    pause_gc()  # until the workers' supervision starts (startup.py)
    install(Reporter(live=sys.stderr.isatty()))  # as cli.main
    try:
        early = quick.start(parsed) if lane else None
        if early is not None:
            if quick.wait(early, early.import_delay(start_cpu)):
                quick.finish(early)
                leave(0)
            script, script_args, options, given = parsed  # the full path takes them over:
            parsed = script, script_args, {**options, "run_id": early.run_id}, given  # same run id
        from .command import run_parsed

        run_parsed(*parsed)
    except (EOFError, KeyboardInterrupt) as e:  # click's Abort: a blank line, exit 130
        from .command import report_abort

        leave(report_abort(e))
    except DistlaunchError as e:
        from .command import report_error

        report_error(e)
        leave(e.exit_code)
    except OSError as e:  # click's main ends a broken pipe with exit code 1
        if e.errno != errno.EPIPE:
            raise
        leave(1)
    finally:
        loaded = sys.modules.get("distlaunch.quick")  # (whether or not the lane was tried)
        if loaded is not None and loaded.early is not None:  # never taken over (an error on the full path)
            loaded.early.abandon()
    leave(0)
