"""The one exception hierarchy of distlaunch (a leaf module: imports nothing of ours).

Library code raises these; only ``distlaunch.cli`` turns them into messages. Each error
carries the exit code the launcher ends with (``exit_code``, as click's exceptions do), so
the CLI maps an error by that attribute, never by its type or text. Third-party errors are
wrapped with ``raise ... from``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the fast lane's path)

if TYPE_CHECKING:  # for annotations only: this module stays a leaf at run time
    from collections.abc import Sequence

    from .rounds import WorkerFailure


class DistlaunchError(Exception):
    """Root of every error distlaunch raises on purpose; ``exit_code`` is what the
    launcher exits with when this error ends it (1 unless a subclass says otherwise)."""

    exit_code: int = 1


class ConfigError(DistlaunchError, ValueError):
    """Bad usage or configuration, found before anything starts (exit code 2)."""

    exit_code = 2


# --- store -------------------------------------------------------------------------------


class StoreError(DistlaunchError):
    """The key-value store failed a request."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A blocking store call (get, wait, connect) ran past its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to the store could not be made or was lost."""


class StoreAuthError(StoreConnectionError):
    """The store refused the connection: the secret token did not match."""


class StoreProtocolError(StoreError):
    """A frame broke the store protocol (malformed, oversized, unknown type)."""


# --- launching -----------------------------------------------------------------------------


class RendezvousError(DistlaunchError):
    """Agents could not agree on a rendezvous round (membership, ranks)."""


class SpawnError(DistlaunchError):
    """A worker process could not be started (e.g. the executable is missing)."""


class WorkerFailedError(DistlaunchError):
    """The worker group failed and no restarts remain.

    ``failure`` is the root cause (the first worker that failed in the last attempt);
    ``exit_code`` is what the launcher should exit with (signal N gives 128+N).
    """

    def __init__(self, message: str, failure: WorkerFailure | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.failure = failure
        self.exit_code = exit_code


class LaunchInterrupted(DistlaunchError):
    """The launcher was told to stop by a signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        self.exit_code = 128 + signum


def stop_behind(e: BaseException) -> LaunchInterrupted | None:
    """The stop signal's LaunchInterrupted whose handling ``e`` cut short, if any: a
    KeyboardInterrupt from a second Ctrl-C that landed once the signal relay had put
    Python's handler back, while the first was still being handled (or click's Abort
    made of it)."""
    seen: BaseException | None = e
    for _ in range(16):  # a chain, not a cycle, but bounded all the same
        if seen is None or isinstance(seen, LaunchInterrupted):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# --- collectives ---------------------------------------------------------------------------


class CollectiveError(DistlaunchError):
    """A collective or point-to-point operation failed.

    ``seq``: the sequence number of the failed collective, once the process group knows
    it (None before). ``missing_ranks`` / ``unreachable_ranks``: global ranks that had not
    called the operation / could not be asked, set by a timeout diagnosis (empty
    otherwise)."""

    seq: int | None = None
    missing_ranks: Sequence[int] = ()
    unreachable_ranks: Sequence[int] = ()
    _from_abort: bool = False  # raised because a peer sent ABORT: not reported again


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the group timeout; names the missing ranks."""


class CollectiveMismatchError(CollectiveError, ValueError):
    """Ranks called the same collective with different shape, dtype, op or root."""


class PeerLostError(CollectiveError, ConnectionError):
    """A peer rank's connection dropped (the peer died) during an operation."""
