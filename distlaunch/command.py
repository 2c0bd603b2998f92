"""The click-free half of `distlaunch run` and of every way out of the CLI: what runs once
`run`'s options are parsed (``run_parsed``: by click in ``cli``, or by the narrow
pre-parser of the common single-node form in ``preparse``), how an error is shown
(``report_error``) and how the process ends (``leave``). Kept apart from ``cli`` so that
the pre-parsed path never imports click; both paths run this same code.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .errors import DistlaunchError, LaunchInterrupted, WorkerFailedError, stop_behind
from .report import say
from .startup import leave as leave  # re-exported: the CLI's way out

if TYPE_CHECKING:
    from .rounds import WorkerFailure


def run_parsed(
    script: str,
    script_args: tuple[str, ...],
    options: Mapping[str, Any],
    given: frozenset[str],
    *,
    dry_run: bool = False,
    root_cause_file: str | None = None,
    show_head_plan: Any = None,
    show_plan: Any = None,
) -> None:
    """Resolve the launch mode of `run SCRIPT SCRIPT_ARGS` with ``options`` (`run`'s
    parameters by name, as click passes them; ``given``: the names not defaulted) and run
    it to its end, or show its plan (``dry_run``: ``show_head_plan(mode)`` /
    ``show_plan(plan)``, cli's printers). Blocks. Raises ConfigError and every error of
    ``launcher.run`` / ``head.run_hosts``."""
    from .modes import HeadNodes, SingleNode, resolve
    from .startup import resume_gc

    mode = resolve(script, script_args, options, given)
    # may wait long for other nodes before its workers (head mode: from the agents' start)
    if not isinstance(mode, (SingleNode, HeadNodes)):
        resume_gc()
    if isinstance(mode, HeadNodes):
        if dry_run:
            show_head_plan(mode)
            return
        from .head import run_hosts

        with root_cause_to(root_cause_file):
            restarts = run_hosts(mode.job, mode.head)
        if restarts:
            say(f"all workers succeeded after {restarts} restart(s)")
        return
    from . import launcher

    plan = launcher.make_plan(mode)
    if dry_run:
        show_plan(plan)
        return
    with root_cause_to(root_cause_file):
        restarts = launcher.run(mode, plan)
    if restarts:
        say(f"all {len(plan.slots)} workers succeeded after {restarts} restart(s)")


@contextlib.contextmanager
def root_cause_to(path: str | None) -> Iterator[None]:
    """For ``distlaunch.launch()`` (``--root-cause-file PATH``, hidden): the first failed
    worker goes to PATH as JSON (``{"rank": R, "exit_code": C}``), so that its exception
    names the rank the summary names, and the summary leaves out the worker's stderr:
    its traceback was in the worker's output, and launch() raises it (one report)."""
    try:
        yield
    except WorkerFailedError as e:
        if path is not None and e.failure is not None:
            import dataclasses
            import json

            with open(path, "w") as f:
                json.dump({"rank": e.failure.rank, "exit_code": e.exit_code}, f)
            e.failure = dataclasses.replace(e.failure, stderr_tail="", error_file_text=None)
        raise


def report_error(e: DistlaunchError) -> None:
    """The user's view of the error that ends the launcher: a worker failure's root
    cause, a stop signal, or one line."""
    if isinstance(e, WorkerFailedError) and e.failure is not None:
        _print_root_cause(e, e.failure)
    elif isinstance(e, LaunchInterrupted):
        say(f"stopped by signal {e.signum}; workers stopped")
    else:
        say(f"error: {one_line(str(e))}")


def report_abort(e: BaseException, blank: bool = True) -> int:
    """The exit code of a launcher ended by Ctrl-C's KeyboardInterrupt (or click's Abort,
    after which click wrote the blank line itself: ``blank=False``): 130 after a blank
    line, as click; but a second Ctrl-C that cut short the handling of the first stop
    signal reports that stop (one line, its code)."""
    stop = stop_behind(e)
    if stop is None:
        if blank:
            sys.stderr.write("\n")
        return 130
    report_error(stop)
    return stop.exit_code


def one_line(text: str) -> str:
    """A multi-line message (e.g. one line per unreachable host) as one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(ln if ln.endswith(":") or i == len(lines) - 1 else ln + ";" for i, ln in enumerate(lines))


def _print_root_cause(e: DistlaunchError, f: WorkerFailure) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(f.timestamp))
    say("=" * 24 + " root cause (first failed worker) " + "=" * 24)
    say(
        f"rank {f.rank} (local rank {f.local_rank}) on node {f.node_rank} ({f.host}), "
        f"pid {f.pid}: {f.how} at {when}"
    )
    if f.cause:
        say(f.cause)
    trace = _error_file_trace(f.error_file_text) or f.stderr_tail
    if trace and not f.hang:
        say("last lines of its stderr:" if trace is f.stderr_tail else "its recorded error:")
        for line in trace.splitlines():
            sys.stderr.write(f"    {line}\n")
    if f.stacks:
        say("where the ranks of its node were:" if f.hang else "where the other ranks of its node were:")
        for line in f.stacks.splitlines():
            sys.stderr.write(f"    {line}\n")
    say(f"exiting with code {e.exit_code}")


def _error_file_trace(text: str | None) -> str | None:
    """The traceback torch.distributed.elastic's @record wrote, if any."""
    if not text:
        return None
    import json

    try:
        msg = json.loads(text)["message"]
        return msg["extraInfo"]["py_callstack"] if isinstance(msg, dict) else str(msg)
    except (ValueError, KeyError, TypeError):
        return None
