"""SSH plumbing for multi-node launches: connections (:mod:`.ssh`), pre-flight checks
(:mod:`.preflight`) and the remote command line (:mod:`.command`).

Importing this package does not import paramiko; only :mod:`.ssh` and :mod:`.preflight`
do, so single-node launches and :mod:`.command` stay light.
"""

from __future__ import annotations

from ..errors import DistlaunchError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (remote.srun's early start)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from concurrent.futures import Future
    from typing import Any, TypeVar

    T = TypeVar("T")

__all__ = ["RemoteError", "in_threads"]


class RemoteError(DistlaunchError):
    """Reaching or running something on a remote host failed.

    ``host`` names the host (as the user wrote it) when one host is concerned.
    ``transient`` is True for failures worth retrying (connection reset, no SSH banner:
    typically sshd's ``MaxStartups`` dropping a burst of connections); False for
    host-key, authentication, refused, unreachable and timeout failures.
    """

    def __init__(self, message: str, host: str | None = None, transient: bool = False):
        super().__init__(message)
        self.host = host
        self.transient = transient


def in_threads(fn: Callable[[T], Any], items: Sequence[T], max_workers: int, name: str) -> list[Future]:
    """``fn(item)`` for every item on up to ``max_workers`` threads (named ``name``_N);
    blocks until all have ended and returns their futures in ``items`` order (an
    exception stays in its future). The wait is timed so that a stop signal the kernel
    delivers to one of these threads still interrupts the caller at once: Python runs
    signal handlers in the main thread only when it runs Python code again, so an untimed
    wait would sleep until every call ended (an SSH banner timeout). When the caller is
    interrupted (LaunchInterrupted raised by the handler), the threads end on their own."""
    from concurrent.futures import ThreadPoolExecutor, wait  # not for a light import of this package

    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items))), thread_name_prefix=name)
    try:
        futures = [pool.submit(fn, item) for item in items]
        while wait(futures, timeout=0.1).not_done:
            pass
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return futures
