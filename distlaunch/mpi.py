"""An mpi4py-style interface over ``distlaunch.collectives``, for programs written for
MPI: change ``from mpi4py import MPI`` to ``from distlaunch import mpi as MPI`` and run
under ``distlaunch run`` (no MPI installation needed).

Follows mpi4py's conventions: lowercase methods move picklable Python objects and return
results (``comm.bcast(obj, root=0)``); uppercase methods move buffers in place
(``comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)``), where a buffer is a contiguous numpy
array (or torch CPU tensor), or mpi4py's ``[array, MPI.DOUBLE]`` form (the datatype is
taken from the array). The process group starts on first use, from the launcher's
environment.

Limits (say so rather than surprise): one communicator, ``COMM_WORLD`` (no Split/Dup);
``ANY_TAG`` matches only messages sent with the default tag 0, because the transport
matches tags exactly; blocking calls honour the group timeout (default 1800 s) and raise
CollectiveError subclasses instead of hanging.
"""

from __future__ import annotations

import functools
import operator
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import collectives as _dist

ANY_SOURCE = -1
ANY_TAG = -1
IN_PLACE = object()

# Datatype names for mpi4py's [buffer, datatype] form; the array's own dtype is used.
BYTE, CHAR = np.uint8, np.int8
INT, LONG, INT64_T = np.int32, np.int64, np.int64
FLOAT, DOUBLE = np.float32, np.float64
BOOL = np.bool_


class Op:
    """A reduction: ``reduce_op`` for buffers, ``fn`` (combining two values, applied in
    rank order) for Python objects."""

    def __init__(self, name: str, reduce_op: _dist.ReduceOp, fn: Callable[[Any, Any], Any]) -> None:
        self.name, self.reduce_op, self.fn = name, reduce_op, fn

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"


SUM = Op("SUM", _dist.ReduceOp.SUM, operator.add)
PROD = Op("PROD", _dist.ReduceOp.PRODUCT, operator.mul)
MIN = Op("MIN", _dist.ReduceOp.MIN, min)
MAX = Op("MAX", _dist.ReduceOp.MAX, max)
BAND = Op("BAND", _dist.ReduceOp.BAND, operator.and_)
BOR = Op("BOR", _dist.ReduceOp.BOR, operator.or_)
BXOR = Op("BXOR", _dist.ReduceOp.BXOR, operator.xor)
LAND = Op("LAND", _dist.ReduceOp.MIN, lambda a, b: bool(a) and bool(b))  # on bool buffers
LOR = Op("LOR", _dist.ReduceOp.MAX, lambda a, b: bool(a) or bool(b))


class Status:
    """Filled by ``recv``/``Recv`` when passed as ``status=``."""

    def __init__(self) -> None:
        self.source: int = ANY_SOURCE
        self.tag: int = ANY_TAG

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag


def _buf(buf: Any) -> Any:
    """mpi4py's buffer spec -> the array: ``arr`` or ``[arr, datatype]``/``(arr, ...)``."""
    return buf[0] if isinstance(buf, (list, tuple)) else buf


def _flat(arr: Any) -> np.ndarray:
    return np.asarray(arr).reshape(-1)


def _tag(tag: int) -> int:
    return 0 if tag == ANY_TAG else tag


class Intracomm:
    """The world communicator. Blocking methods raise CollectiveTimeoutError after the
    group timeout, CollectiveMismatchError when ranks disagree, PeerLostError when a
    peer died."""

    def _ready(self) -> None:
        if not _dist.is_initialized():
            _dist.init_process_group()

    def Get_rank(self) -> int:
        self._ready()
        return _dist.get_rank()

    def Get_size(self) -> int:
        self._ready()
        return _dist.get_world_size()

    rank = property(Get_rank)
    size = property(Get_size)

    def Barrier(self) -> None:
        self._ready()
        _dist.barrier()

    barrier = Barrier

    # --- Python objects (pickle) ----------------------------------------------------------

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._ready()
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        _dist.send(np.array([data.size], dtype=np.int64), dest, tag=tag)
        _dist.send(data, dest, tag=tag)

    def recv(
        self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        self._ready()
        n = np.zeros(1, dtype=np.int64)
        src = _dist.recv(n, None if source == ANY_SOURCE else source, tag=_tag(tag))
        data = np.empty(int(n[0]), dtype=np.uint8)
        _dist.recv(data, src, tag=_tag(tag))  # per-pair order: the payload follows its length
        if status is not None:
            status.source, status.tag = src, _tag(tag)
        return pickle.loads(data.tobytes())

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self._ready()
        box = [obj]
        _dist.broadcast_object_list(box, src=root)
        return box[0]

    def scatter(self, sendobj: Any, root: int = 0) -> Any:
        """``sendobj``: at ``root``, one object per rank (in rank order); ignored elsewhere."""
        self._ready()
        out: list[Any] = [None]
        _dist.scatter_object_list(out, list(sendobj) if self.rank == root else None, src=root)
        return out[0]

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        self._ready()
        out: list[Any] | None = [None] * self.size if self.rank == root else None
        _dist.gather_object(sendobj, out, dst=root)
        return out

    def allgather(self, sendobj: Any) -> list[Any]:
        self._ready()
        out: list[Any] = [None] * self.size
        _dist.all_gather_object(out, sendobj)
        return out

    def reduce(self, sendobj: Any, op: Op = SUM, root: int = 0) -> Any:
        values = self.gather(sendobj, root)
        return functools.reduce(op.fn, values) if values is not None else None

    def allreduce(self, sendobj: Any, op: Op = SUM) -> Any:
        return functools.reduce(op.fn, self.allgather(sendobj))

    # --- buffers (in place) ---------------------------------------------------------------

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        self._ready()
        _dist.send(_buf(buf), dest, tag=tag)

    def Recv(
        self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> None:
        self._ready()
        src = _dist.recv(_buf(buf), None if source == ANY_SOURCE else source, tag=_tag(tag))
        if status is not None:
            status.source, status.tag = src, _tag(tag)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        self._ready()
        _dist.broadcast(_buf(buf), src=root)

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``sendbuf`` (root only) holds size x len(recvbuf) elements, in rank order."""
        self._ready()
        parts = np.split(_flat(_buf(sendbuf)), self.size) if self.rank == root else None
        _dist.scatter(_flat(_buf(recvbuf)), parts, src=root)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``recvbuf`` (root only) receives size x len(sendbuf) elements, in rank order."""
        self._ready()
        parts = np.split(_flat(_buf(recvbuf)), self.size) if self.rank == root else None
        _dist.gather(_flat(_buf(sendbuf)), parts, dst=root)

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        self._ready()
        _dist.all_gather_into_tensor(_flat(_buf(recvbuf)), _flat(_buf(sendbuf)))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0) -> None:
        """``sendbuf`` is left unchanged (IN_PLACE at the root: ``recvbuf`` is the input)."""
        self._ready()
        if self.rank == root:
            work = _buf(recvbuf)
            if sendbuf is not IN_PLACE:
                np.copyto(np.asarray(work), np.asarray(_buf(sendbuf)))
        else:
            work = np.array(_buf(sendbuf), copy=True)
        _dist.reduce(work, dst=root, op=op.reduce_op)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        self._ready()
        out = _buf(recvbuf)
        if sendbuf is not IN_PLACE:
            np.copyto(np.asarray(out), np.asarray(_buf(sendbuf)))
        _dist.all_reduce(out, op=op.reduce_op)


COMM_WORLD = Intracomm()


def Wtime() -> float:
    """Wall-clock seconds (MPI_Wtime)."""
    return time.perf_counter()


def Finalize() -> None:
    if _dist.is_initialized():
        _dist.destroy_process_group()
