"""The torch backend's exceptions: each is torch's ``DistBackendError`` and the matching
``distlaunch.collectives`` error."""

from __future__ import annotations

import torch.distributed as dist

from ..collectives.errors import (
    CollectiveArgumentError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
)


class DistlaunchBackendError(dist.DistBackendError, CollectiveError):
    """A collective failed (torch's DistBackendError and distlaunch's CollectiveError)."""


class DistlaunchTimeoutError(DistlaunchBackendError, CollectiveTimeoutError):
    """Not finished within the group timeout; names the ranks that did not arrive."""


class DistlaunchPeerLostError(DistlaunchBackendError, PeerLostError):
    """A peer's process died or its connection ended."""


class DistlaunchMismatchError(DistlaunchBackendError, CollectiveMismatchError):
    """Ranks called different operations (op, dtype, size, root or reduce op)."""


def _as_torch_error(e: BaseException) -> BaseException:
    """The torch-facing exception for a runtime failure (arguments errors and
    non-collective exceptions are returned unchanged)."""
    if isinstance(e, (DistlaunchBackendError, CollectiveArgumentError)) or not isinstance(e, CollectiveError):
        return e
    cls: type[DistlaunchBackendError] = DistlaunchBackendError
    if isinstance(e, CollectiveTimeoutError):
        cls = DistlaunchTimeoutError
    elif isinstance(e, PeerLostError):
        cls = DistlaunchPeerLostError
    elif isinstance(e, CollectiveMismatchError):
        cls = DistlaunchMismatchError
    err = cls(f"distlaunch: {e}")
    err.__cause__ = e
    return err
