"""The restart policy of one node's agent: run the worker group; on a failure, while
restarts remain, start a new attempt with the restart count + 1 (torchrun's
``--max-restarts``). A stop signal ends the job without restart."""

from __future__ import annotations

from typing import Callable

from ..errors import LaunchInterrupted, WorkerFailedError
from .group import LaunchSpec, WorkerGroup
from .guard import OrphanGuard
from .process import WorkerFailure
from .signals import SignalRelay


def supervise(build_specs: Callable[[int], list[LaunchSpec]], max_restarts: int,
              stop_timeout: float, guard: OrphanGuard,
              on_event: Callable[[str], None]) -> int:
    """Run attempts until one succeeds; return the restart count it needed.

    ``build_specs(restart_count)`` gives the workers of an attempt. Blocks until the job
    ends. Raises WorkerFailedError (root cause attached) when the last allowed attempt
    fails, LaunchInterrupted when a stop signal arrived, SpawnError when a worker cannot
    be started. Must run on the main thread (it installs signal handlers).
    """
    group: WorkerGroup | None = None
    relay = SignalRelay(lambda: group.live() if group else ())
    try:
        for restart_count in range(max_restarts + 1):
            group = WorkerGroup(build_specs(restart_count), relay, guard, stop_timeout)
            result = group.run()
            if result.stop_signal is not None:
                raise LaunchInterrupted(result.stop_signal)
            if result.failure is None:
                return restart_count
            if restart_count == max_restarts:
                raise WorkerFailedError(describe(result.failure), result.failure,
                                        result.failure.exit_code)
            on_event(f"worker group failed ({describe(result.failure)}); restarting "
                     f"(restart {restart_count + 1} of {max_restarts})")
    finally:
        relay.restore()


def describe(f: WorkerFailure) -> str:
    return f"rank {f.rank} (local rank {f.local_rank}) on node {f.node_rank} {f.how}"
