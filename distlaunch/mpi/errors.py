"""MPI error classes and the exception mpi4py raises (``MPI.Exception``), a leaf module.

Error class values are MPICH's, so programs printing ``e.Get_error_class()`` agree.
MPIException also derives from CollectiveError, so code catching distlaunch's
collectives errors catches these too.
"""

from __future__ import annotations

from ..collectives.errors import CollectiveError

SUCCESS = 0
ERR_BUFFER, ERR_COUNT, ERR_TYPE, ERR_TAG, ERR_COMM, ERR_RANK, ERR_ROOT = 1, 2, 3, 4, 5, 6, 7
ERR_GROUP, ERR_OP, ERR_ARG, ERR_UNKNOWN, ERR_TRUNCATE, ERR_OTHER = 8, 9, 12, 13, 14, 15
ERR_INTERN, ERR_IN_STATUS, ERR_PENDING, ERR_REQUEST = 16, 17, 18, 19
ERR_LASTCODE = 0x3FFFFFFF


class MPIException(CollectiveError):
    """An MPI error (mpi4py's ``MPI.Exception``): ``error_code`` is one of the ERR_*
    classes; the message says what was wrong and how to fix it."""

    def __init__(self, error_code: int, message: str = "") -> None:
        super().__init__(message or f"MPI error {error_code}")
        self.error_code = error_code

    def Get_error_code(self) -> int:
        return self.error_code

    def Get_error_class(self) -> int:
        return self.error_code

    def Get_error_string(self) -> str:
        return str(self)
