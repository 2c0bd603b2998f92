"""MPI reduction operations (MPI_Op): the predefined ones and ``Op.Create``.

An Op reduces buffers (numpy arrays of a predefined datatype; pair types for MINLOC/
MAXLOC) and Python objects (the lowercase methods). The predefined arithmetic ops on
numeric buffers run as the collectives' native reductions; every other case (logical
ops on non-bool data, MINLOC/MAXLOC, user ops, derived datatypes) is folded locally in
rank order, ``x0 op (x1 op (... op xn-1))``, as MPI defines it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ..collectives.ops import ReduceOp
from .datatypes import Datatype
from .errors import ERR_OP, MPIException


def _loc(better: Callable[[Any, Any], bool]) -> Callable[[Any, Any], Any]:
    """MINLOC/MAXLOC on (value, index) pairs: the better value, the lower index on ties."""

    def fn(a: Any, b: Any) -> Any:
        if better(a[0], b[0]):
            return a
        if better(b[0], a[0]):
            return b
        return a if a[1] <= b[1] else b

    return fn


def _loc_arrays(pick_min: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    def fn(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        va, vb = a["value"], b["value"]
        take_a = (va < vb if pick_min else va > vb) | ((va == vb) & (a["index"] <= b["index"]))
        return np.where(take_a, a, b)

    return fn


def _logical(fn: Callable[[Any, Any], Any]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    return lambda a, b: fn(a, b).astype(a.dtype)


class Op:
    """A reduction. ``Op.Create(function, commute=False)``: ``function(inbuf, inoutbuf,
    datatype)`` combines two buffers (memoryviews of the packed data) into ``inoutbuf``,
    and ``function(a, b, None)`` returns the combination of two Python objects (as
    mpi4py calls it)."""

    def __init__(
        self,
        name: str,
        native: ReduceOp | None = None,
        obj: Callable[[Any, Any], Any] | None = None,
        arr: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
        user: Callable[..., Any] | None = None,
        commute: bool = True,
    ) -> None:
        self.name, self.native, self._obj, self._arr, self.user, self.commute = (
            name,
            native,
            obj,
            arr,
            user,
            commute,
        )
        self.freed = False

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"

    @classmethod
    def Create(cls, function: Callable[..., Any], commute: bool = False) -> Op:
        return cls("user op", user=function, commute=commute)

    def Free(self) -> None:
        self.freed = True

    def Is_commutative(self) -> bool:
        return self.commute

    is_commutative = property(Is_commutative)

    def __call__(self, x: Any, y: Any) -> Any:
        """``x op y`` on Python objects."""
        if self.user is not None:
            return self.user(x, y, None)
        assert self._obj is not None
        return self._obj(x, y)

    def native_for(self, t: Datatype) -> ReduceOp | None:
        """The collectives' ReduceOp when buffers of ``t`` reduce natively, else None."""
        if self.native is None or t.dtype is None or t.dtype.names:
            return None
        if self.name in ("LAND", "LOR") and t.dtype != np.bool_:
            return None
        return self.native

    def combine(self, a: np.ndarray, b: np.ndarray, t: Datatype) -> np.ndarray:
        """``a op b`` on packed bytes of elements of ``t`` (a new array, or ``b`` updated)."""
        if self.user is not None:
            out = bytearray(b.tobytes())
            self.user(memoryview(a.tobytes()), memoryview(out), t)
            return np.frombuffer(out, dtype=np.uint8)
        dt = t.dtype if t.dtype is not None else t.base
        if dt is None or self._arr is None:
            raise MPIException(ERR_OP, f"{self!r} is not defined for datatype {t.Get_name()}")
        fields = dt.fields
        if fields:  # packed data of a pair type: its fields without the padding
            dt = np.dtype([(n, fields[n][0]) for n in fields])
        return np.ascontiguousarray(self._arr(a.view(dt), b.view(dt))).reshape(-1).view(np.uint8)


SUM = Op("SUM", ReduceOp.SUM, operator.add, np.add)
PROD = Op("PROD", ReduceOp.PRODUCT, operator.mul, np.multiply)
MIN = Op("MIN", ReduceOp.MIN, min, np.minimum)
MAX = Op("MAX", ReduceOp.MAX, max, np.maximum)
BAND = Op("BAND", ReduceOp.BAND, operator.and_, np.bitwise_and)
BOR = Op("BOR", ReduceOp.BOR, operator.or_, np.bitwise_or)
BXOR = Op("BXOR", ReduceOp.BXOR, operator.xor, np.bitwise_xor)
LAND = Op("LAND", ReduceOp.MIN, lambda a, b: bool(a) and bool(b), _logical(np.logical_and))
LOR = Op("LOR", ReduceOp.MAX, lambda a, b: bool(a) or bool(b), _logical(np.logical_or))
LXOR = Op("LXOR", None, lambda a, b: bool(a) != bool(b), _logical(np.logical_xor))
MINLOC = Op("MINLOC", None, _loc(operator.lt), _loc_arrays(True))
MAXLOC = Op("MAXLOC", None, _loc(operator.gt), _loc_arrays(False))
REPLACE = Op("REPLACE", None, lambda a, b: b, lambda a, b: b)
NO_OP = Op("NO_OP", None, lambda a, b: a, lambda a, b: a)
OP_NULL = Op("OP_NULL")
