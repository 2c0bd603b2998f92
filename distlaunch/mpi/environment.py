"""MPI's environment functions: initialisation and finalisation, threads, versions,
timers, the processor name, Abort, and the features refused with NotImplementedError."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from .. import __version__
from .. import collectives as dist
from ..collectives.api import resolve_group
from .comm import STATE

THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3
VERSION, SUBVERSION = 3, 1  # the MPI standard level of the subset offered
MAX_PROCESSOR_NAME = 256
MAX_ERROR_STRING = 512
MAX_LIBRARY_VERSION_STRING = 8192


def Init() -> None:
    """Start the process group now (it otherwise starts on first use); blocks up to the
    init timeout."""
    STATE.runtime()


def Init_thread(required: int = THREAD_MULTIPLE) -> int:
    """As Init; every thread level is provided (returns THREAD_MULTIPLE)."""
    Init()
    return THREAD_MULTIPLE


def Finalize() -> None:
    """Collective: a barrier on COMM_WORLD, then the process group is destroyed; no MPI
    call may follow (MPIException), also when it raised (a mismatch found by the barrier
    or on destroy: the process group is gone then too)."""
    _finalize(False)


def _finalize(quiet: bool) -> None:
    """Finalize; ``quiet``: no barrier on a world group that failed already (the program
    was given that error)."""
    with STATE.lock:
        if STATE.finalized:
            return
        try:
            if dist.is_initialized():
                try:
                    if dist.get_world_size() > 1 and not (
                        quiet and getattr(resolve_group(None), "broken", None)
                    ):
                        dist.barrier()
                finally:
                    dist.destroy_process_group()
        finally:
            STATE.finalized = True
            STATE.engine = None


def _finalize_at_exit() -> None:
    """Finalize when the interpreter exits, as mpi4py does (``mpi4py.rc.finalize``): a
    program that ends without MPI.Finalize still has its communicators' last calls
    compared (an eager call nobody compared). A failure there is printed as one line
    and the process exits with status 1 (MPICH's finalize aborts on an error); an error
    the program was given already (its world group failed) is not raised again. Skipped
    when MPI was never used, and when an unhandled exception ends the program: the
    process is failing already and its launcher ends the job, whereas Finalize's
    barrier would wait for ranks that may be waiting for this one."""
    if STATE.engine is None or STATE.finalized or getattr(sys, "last_value", None) is not None:
        return
    try:
        _finalize(True)
    except BaseException as e:  # noqa: BLE001  (any failure ends the process with status 1)
        sys.stdout.flush()
        sys.stderr.write(f"distlaunch.mpi: MPI.Finalize at exit failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)


atexit.register(_finalize_at_exit)


def Is_initialized() -> bool:
    """True, as under mpi4py (which initialises MPI on import), until Finalize."""
    return True


def Is_finalized() -> bool:
    return STATE.finalized


def Query_thread() -> int:
    return THREAD_MULTIPLE


def Is_thread_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def Get_version() -> tuple[int, int]:
    return VERSION, SUBVERSION


def Get_library_version() -> str:
    return f"distlaunch.mpi {__version__} (MPI {VERSION}.{SUBVERSION} subset over distlaunch.collectives)"


def Get_processor_name() -> str:
    return socket.gethostname()


def Wtime() -> float:
    """Seconds of a monotonic wall clock (MPI_Wtime; not synchronised across nodes)."""
    return time.perf_counter()


def Wtick() -> float:
    """Resolution of Wtime in seconds."""
    return time.get_clock_info("perf_counter").resolution


def Attach_buffer(buf: Any) -> None:
    """Accepted and unused: Bsend never needs a buffer here (sends are eager)."""


def Detach_buffer() -> None:
    return None


class _Refused(type):
    """Classes of features outside distlaunch.mpi: any use raises NotImplementedError."""

    feature = ""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"{cls.feature} ({cls.__name__}.{name}) is not supported by distlaunch.mpi")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{cls.feature} ({cls.__name__}) is not supported by distlaunch.mpi")


class Win(metaclass=_Refused):
    feature = "one-sided communication (RMA windows)"


class File(metaclass=_Refused):
    feature = "MPI-IO"


class Intercomm(metaclass=_Refused):
    feature = "intercommunicators"


def Open_port(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(
        "MPI dynamic processes (Open_port, Connect/Accept) are not supported by distlaunch.mpi"
    )


Lookup_name = Publish_name = Unpublish_name = Close_port = Open_port
