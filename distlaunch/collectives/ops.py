"""Reduction operators (``torch.distributed.ReduceOp`` names and values) and their numpy
kernels.

Every reduction is one in-place numpy ufunc call (``np.add(a, b, out=b)``) so large
buffers are combined without temporaries and with the GIL released. Callers pass the
operands in a fixed order (the lower-ranked contribution first) so that every rank
computes bit-identical results.
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import numpy as np

from .errors import CollectiveArgumentError


class ReduceOp(enum.IntEnum):
    """Reduction operators, as ``torch.distributed.ReduceOp`` (same names and values).

    SUM, PRODUCT, MIN, MAX: numpy semantics in the buffer's dtype (integers wrap; on bool
    SUM is logical or, PRODUCT logical and). AVG: SUM, then division by the group size;
    floating-point and complex dtypes only (gloo has no AVG at all; an integer average
    would silently truncate, so it raises). BAND, BOR, BXOR: integer and bool dtypes only.
    """

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7


_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def as_reduce_op(op: Any) -> ReduceOp:
    """Normalise ``op`` (a ReduceOp, its int value or name, or a torch ReduceOp) to
    :class:`ReduceOp`; raises CollectiveArgumentError for anything else."""
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None)  # torch's RedOpType members carry .name
    try:
        if isinstance(name, str):
            return ReduceOp[name]
        if isinstance(op, str):
            return ReduceOp[op.upper()]
        if isinstance(op, int) and not isinstance(op, bool):
            return ReduceOp(op)
    except (KeyError, ValueError):
        pass
    raise CollectiveArgumentError(
        f"op={op!r} is not a ReduceOp (one of {', '.join(o.name for o in ReduceOp)})"
    )


def check_op(op: ReduceOp, dtype: np.dtype, name: str = "tensor") -> None:
    """Raise CollectiveArgumentError when ``op`` is not defined for ``dtype``."""
    if op in _BITWISE and dtype.kind not in "biu":
        raise CollectiveArgumentError(
            f"ReduceOp.{op.name} is a bitwise op and needs an integer or bool dtype; {name} has dtype {dtype}"
        )
    if op is ReduceOp.AVG and dtype.kind not in "fc":
        raise CollectiveArgumentError(
            f"ReduceOp.AVG needs a floating-point dtype ({name} has dtype {dtype}); "
            f"an integer average would truncate: use SUM and divide"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.kind == "c":
        raise CollectiveArgumentError(f"ReduceOp.{op.name} is not defined for complex dtype {dtype}")


def ufunc(op: ReduceOp) -> np.ufunc:
    """The numpy ufunc that combines two operands for ``op`` (AVG: addition)."""
    return _UFUNCS[op]


def combine(first: np.ndarray, second: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """``out[:] = first (op) second`` elementwise, in place. ``out`` may alias either
    operand; all three are flat arrays of one dtype and length."""
    _UFUNCS[op](first, second, out=out)


def finalize(buf: np.ndarray, op: ReduceOp, group_size: int) -> None:
    """Finish a reduction in place: AVG divides the sum by ``group_size``."""
    if op is ReduceOp.AVG:
        np.divide(buf, group_size, out=buf)


class _DeprecatedReduceOp:
    """``reduce_op``: the deprecated alias of ReduceOp (as in torch.distributed)."""

    def __getattr__(self, name: str) -> ReduceOp:
        warnings.warn("reduce_op is deprecated, use ReduceOp instead", DeprecationWarning, stacklevel=2)
        return getattr(ReduceOp, name)


reduce_op = _DeprecatedReduceOp()
