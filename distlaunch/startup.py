"""The launcher's start-up without the cyclic garbage collector.

Start-up allocates tens of thousands of objects that live as long as the process
(modules, classes, functions) and makes next to no reference cycles, yet its
allocations trigger some 25 young-generation collections and a few older ones: ~5 ms of
a ~85 ms single-node launch. ``pause_gc`` turns the collector off for `run` (from the
start of the pre-parsed form, ``preparse``; from click's ``run`` callback) and for an
engine's agent (``agent/entry.py``, from its hello); ``resume_gc`` turns it back on, with
what start-up made moved to the permanent generation (``gc.freeze``: later collections
skip it), once the workers' supervision starts (``WorkerGroup.run``; a head over Slurm
once its agents run, over SSH before paramiko connects, ``head.run_hosts``; an agent
before its node agent runs) or the mode turns out to be another (``command.run_parsed``).
Reference counting frees everything else meanwhile, as always.
"""

from __future__ import annotations

import gc
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the fast lane's path)
if TYPE_CHECKING:
    from typing import NoReturn

_paused = False


def pause_gc() -> None:
    """Turn the collector off until ``resume_gc`` (a no-op where it is off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume_gc() -> None:
    """Turn the collector back on if ``pause_gc`` turned it off (else a no-op), after
    freezing what exists now into the permanent generation. Idempotent."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()


def leave(code: int) -> NoReturn:
    """End the process with ``code`` (``os._exit`` after flushing stdout and stderr)."""
    # By now every process the command started has ended and been reaped, and the
    # output threads have drained; what is left of the interpreter's own teardown
    # (freeing every module's objects, no atexit work of ours) costs ~12 ms per run.
    srun = sys.modules.get("distlaunch.remote.srun")
    if srun is not None:  # a Slurm agent step started early and never taken over
        srun.end_early()
    quick = sys.modules.get("distlaunch.quick")
    if quick is not None and quick.early is not None:  # the fast lane's, never taken over
        quick.early.abandon()  # (its workers and scratch: not left to the guard)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away: nothing more to say
            pass
    os._exit(code)
