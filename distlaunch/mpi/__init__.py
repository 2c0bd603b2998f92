"""An mpi4py-compatible interface over ``distlaunch.collectives``, for programs written for
MPI: change ``from mpi4py import MPI`` to ``from distlaunch import mpi as MPI`` and run
under ``distlaunch run`` (no MPI installation needed).

Follows mpi4py: lowercase methods move picklable Python objects and return results
(``comm.bcast(obj, root=0)``); uppercase methods move buffers in place
(``comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)``), given as mpi4py buffer
specifications (``buf``, ``[buf, MPI.DOUBLE]``, ``[buf, count, MPI.DOUBLE]``,
``[buf, (counts, displs), MPI.DOUBLE]``; see :mod:`.datatypes`). The process group starts
on first use, from the launcher's environment.

Offered: point-to-point in every mode (Send/Ssend/Bsend/Rsend are all eager), Isend/
Irecv with Request (Wait/Test/Waitall/Waitany/Testall/...), persistent requests
(Send_init/Recv_init with Prequest.Start/Startall), Sendrecv, Probe/Iprobe/Mprobe with
Status, ANY_SOURCE/ANY_TAG/PROC_NULL; the collectives, their v-variants,
IN_PLACE, Scan/Exscan, Reduce_scatter, MINLOC/MAXLOC and Op.Create; communicators (Dup,
Split, Split_type, Create, Free, COMM_SELF, COMM_NULL, groups, attributes, names);
derived datatypes; the environment functions. Refused with NotImplementedError: RMA
windows (Win), dynamic processes (Spawn, Connect), MPI-IO (File), intercommunicators,
mpi4py.futures.

Errors: MPIException (``MPI.Exception``) for bad arguments and truncated receives; the
collectives' CollectiveTimeoutError (after the group timeout, default 1800 s) and
PeerLostError (a peer died) instead of hanging.
"""

from __future__ import annotations

from typing import Any

from .comm import (
    APPNUM,
    BOTTOM,
    COMM_TYPE_SHARED,
    CONGRUENT,
    GROUP_EMPTY,
    HOST,
    IDENT,
    IN_PLACE,
    IO,
    LASTUSEDCODE,
    SIMILAR,
    TAG_UB,
    UNEQUAL,
    UNIVERSE_SIZE,
    WTIME_IS_GLOBAL,
    Comm,
    Group,
    MatchedMessage,
)
from .datatypes import (
    AINT,
    BOOL,
    BYTE,
    C_BOOL,
    C_DOUBLE_COMPLEX,
    C_FLOAT_COMPLEX,
    CHAR,
    COMPLEX,
    COUNT,
    DATATYPE_NULL,
    DOUBLE,
    DOUBLE_COMPLEX,
    DOUBLE_INT,
    FLOAT,
    FLOAT_INT,
    INT,
    INT8_T,
    INT16_T,
    INT32_T,
    INT64_T,
    INT_INT,
    LONG,
    LONG_DOUBLE,
    LONG_DOUBLE_INT,
    LONG_INT,
    LONG_LONG,
    OFFSET,
    PACKED,
    SHORT,
    SHORT_INT,
    SIGNED_CHAR,
    TWOINT,
    UINT8_T,
    UINT16_T,
    UINT32_T,
    UINT64_T,
    UNDEFINED,
    UNSIGNED,
    UNSIGNED_CHAR,
    UNSIGNED_LONG,
    UNSIGNED_LONG_LONG,
    UNSIGNED_SHORT,
    WCHAR,
    Datatype,
)
from .environment import (
    MAX_ERROR_STRING,
    MAX_LIBRARY_VERSION_STRING,
    MAX_PROCESSOR_NAME,
    SUBVERSION,
    THREAD_FUNNELED,
    THREAD_MULTIPLE,
    THREAD_SERIALIZED,
    THREAD_SINGLE,
    VERSION,
    Attach_buffer,
    Close_port,
    Detach_buffer,
    File,
    Finalize,
    Get_library_version,
    Get_processor_name,
    Get_version,
    Init,
    Init_thread,
    Intercomm,
    Is_finalized,
    Is_initialized,
    Is_thread_main,
    Lookup_name,
    Open_port,
    Publish_name,
    Query_thread,
    Unpublish_name,
    Win,
    Wtick,
    Wtime,
)
from .errors import (
    ERR_ARG,
    ERR_BUFFER,
    ERR_COMM,
    ERR_COUNT,
    ERR_GROUP,
    ERR_IN_STATUS,
    ERR_INTERN,
    ERR_LASTCODE,
    ERR_OP,
    ERR_OTHER,
    ERR_PENDING,
    ERR_RANK,
    ERR_REQUEST,
    ERR_ROOT,
    ERR_TAG,
    ERR_TRUNCATE,
    ERR_TYPE,
    ERR_UNKNOWN,
    SUCCESS,
    MPIException,
)
from .intracomm import COMM_NULL, COMM_SELF, COMM_WORLD, Intracomm
from .ops import (
    BAND,
    BOR,
    BXOR,
    LAND,
    LOR,
    LXOR,
    MAX,
    MAXLOC,
    MIN,
    MINLOC,
    NO_OP,
    OP_NULL,
    PROD,
    REPLACE,
    SUM,
    Op,
)
from .p2p import ANY_SOURCE, ANY_TAG, PROC_NULL, REQUEST_NULL, Grequest, Prequest, Request, Status

Exception = MPIException  # noqa: A001  (mpi4py's name: MPI.Exception)
Message = MatchedMessage
ORDER_C, ORDER_FORTRAN = 0, 1
DISTRIBUTE_NONE, DISTRIBUTE_BLOCK, DISTRIBUTE_CYCLIC = 0, 1, 2
INFO_NULL: Any = None
KEYVAL_INVALID = -1
ROOT = -3
WIN_NULL: Any = None
FILE_NULL: Any = None
MESSAGE_NULL = MatchedMessage(None)
MESSAGE_NO_PROC = MatchedMessage(None)


class Info:
    """MPI_Info: accepted and ignored (hints only)."""

    @classmethod
    def Create(cls) -> Info:
        return cls()

    def Set(self, key: str, value: str) -> None:
        pass

    def Free(self) -> None:
        pass


def __getattr__(name: str) -> Any:
    if name == "futures":
        raise NotImplementedError("mpi4py.futures is not supported by distlaunch.mpi")
    raise AttributeError(f"module 'distlaunch.mpi' has no attribute {name!r}")


__all__ = [
    "AINT",
    "ANY_SOURCE",
    "ANY_TAG",
    "APPNUM",
    "Attach_buffer",
    "BAND",
    "BOOL",
    "BOR",
    "BOTTOM",
    "BXOR",
    "BYTE",
    "CHAR",
    "COMM_NULL",
    "COMM_SELF",
    "COMM_TYPE_SHARED",
    "COMM_WORLD",
    "COMPLEX",
    "CONGRUENT",
    "COUNT",
    "C_BOOL",
    "C_DOUBLE_COMPLEX",
    "C_FLOAT_COMPLEX",
    "Close_port",
    "Comm",
    "DATATYPE_NULL",
    "DISTRIBUTE_BLOCK",
    "DISTRIBUTE_CYCLIC",
    "DISTRIBUTE_NONE",
    "DOUBLE",
    "DOUBLE_COMPLEX",
    "DOUBLE_INT",
    "Datatype",
    "Detach_buffer",
    "ERR_ARG",
    "ERR_BUFFER",
    "ERR_COMM",
    "ERR_COUNT",
    "ERR_GROUP",
    "ERR_INTERN",
    "ERR_IN_STATUS",
    "ERR_LASTCODE",
    "ERR_OP",
    "ERR_OTHER",
    "ERR_PENDING",
    "ERR_RANK",
    "ERR_REQUEST",
    "ERR_ROOT",
    "ERR_TAG",
    "ERR_TRUNCATE",
    "ERR_TYPE",
    "ERR_UNKNOWN",
    "Exception",
    "FLOAT",
    "FLOAT_INT",
    "File",
    "Finalize",
    "GROUP_EMPTY",
    "Get_library_version",
    "Get_processor_name",
    "Get_version",
    "Grequest",
    "Group",
    "HOST",
    "IDENT",
    "INT",
    "INT16_T",
    "INT32_T",
    "INT64_T",
    "INT8_T",
    "INT_INT",
    "IN_PLACE",
    "IO",
    "Info",
    "Init",
    "Init_thread",
    "Intercomm",
    "Intracomm",
    "Is_finalized",
    "Is_initialized",
    "Is_thread_main",
    "KEYVAL_INVALID",
    "LAND",
    "LASTUSEDCODE",
    "LONG",
    "LONG_DOUBLE",
    "LONG_DOUBLE_INT",
    "LONG_INT",
    "LONG_LONG",
    "LOR",
    "LXOR",
    "Lookup_name",
    "MAX",
    "MAXLOC",
    "MAX_ERROR_STRING",
    "MAX_LIBRARY_VERSION_STRING",
    "MAX_PROCESSOR_NAME",
    "MESSAGE_NO_PROC",
    "MESSAGE_NULL",
    "MIN",
    "MINLOC",
    "MPIException",
    "MatchedMessage",
    "Message",
    "NO_OP",
    "OFFSET",
    "OP_NULL",
    "ORDER_C",
    "ORDER_FORTRAN",
    "Op",
    "Open_port",
    "PACKED",
    "PROC_NULL",
    "PROD",
    "Prequest",
    "Publish_name",
    "Query_thread",
    "REPLACE",
    "REQUEST_NULL",
    "ROOT",
    "Request",
    "SHORT",
    "SHORT_INT",
    "SIGNED_CHAR",
    "SIMILAR",
    "SUBVERSION",
    "SUCCESS",
    "SUM",
    "Status",
    "TAG_UB",
    "THREAD_FUNNELED",
    "THREAD_MULTIPLE",
    "THREAD_SERIALIZED",
    "THREAD_SINGLE",
    "TWOINT",
    "UINT16_T",
    "UINT32_T",
    "UINT64_T",
    "UINT8_T",
    "UNDEFINED",
    "UNEQUAL",
    "UNIVERSE_SIZE",
    "UNSIGNED",
    "UNSIGNED_CHAR",
    "UNSIGNED_LONG",
    "UNSIGNED_LONG_LONG",
    "UNSIGNED_SHORT",
    "Unpublish_name",
    "VERSION",
    "WCHAR",
    "WTIME_IS_GLOBAL",
    "Win",
    "Wtick",
    "Wtime",
]
