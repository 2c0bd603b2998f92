"""SSH plumbing for multi-node launches: connections (:mod:`.ssh`), pre-flight checks
(:mod:`.preflight`) and the remote command line (:mod:`.command`).

Importing this package does not import paramiko; only :mod:`.ssh` and :mod:`.preflight`
do, so single-node launches and :mod:`.command` stay light.
"""

from __future__ import annotations

from ..errors import DistlaunchError

__all__ = ["RemoteError"]


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
