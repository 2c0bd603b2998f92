"""Errors raised by :mod:`distlaunch.collectives`.

The hierarchy itself lives in :mod:`distlaunch.errors`; this module re-exports the
collective branch and adds :class:`CollectiveArgumentError` for bad arguments found
locally (before any communication), so callers can catch it as ``ValueError`` too.
"""

from __future__ import annotations

from ..errors import (  # noqa: F401  (re-exported)
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    PeerLostError,
)


class CollectiveArgumentError(CollectiveError, ValueError):
    """An argument is unusable: a non-contiguous or read-only buffer, an unsupported
    dtype, a bitwise reduction on floats, a rank outside the group, a wrong list length.
    Raised on the calling rank only, before anything is sent."""


class NotInitializedError(CollectiveError, RuntimeError):
    """A function needs the default process group and init_process_group() was not called
    (or destroy_process_group() was)."""
