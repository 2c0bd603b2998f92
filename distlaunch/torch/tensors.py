"""Tensors as the runtime's flat numpy arrays: views, contiguous and float32 stand-ins,
torch's ReduceOp (see the package docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..collectives.errors import CollectiveArgumentError
from ..collectives.ops import ReduceOp, as_reduce_op
from ..collectives.wire import DTYPE_CODES

Tensor = torch.Tensor
Arr = np.ndarray


_NO_NUMPY = {torch.bfloat16: torch.int16}  # moved as their bits
_HALF = (torch.bfloat16, torch.float16)  # reduced in float32


def _check(t: Any, what: str) -> Tensor:
    if not isinstance(t, torch.Tensor):
        raise CollectiveArgumentError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if not t.is_cpu or t.layout != torch.strided:
        raise CollectiveArgumentError(
            f"{what} is a {t.layout} tensor on {t.device}; the distlaunch backend takes dense CPU tensors"
        )
    return t


class _Bufs:
    """numpy views of an operation's tensors, and what to do once it finished: copy
    results from contiguous or float32 stand-ins back into the caller's tensors."""

    def __init__(self) -> None:
        self.back: list = []  # (caller's tensor, stand-in)

    def view(self, t: Tensor, what: str, out: bool) -> Arr:
        """Flat array sharing ``t``'s memory, or a contiguous copy (copied back when ``out``)."""
        t = _check(t, what)
        src = t if t.is_contiguous() else t.contiguous()
        if out and src is not t:
            self.back.append((t, src))
        bits = _NO_NUMPY.get(src.dtype)
        try:
            if bits is not None:
                src = src.view(bits)
            arr = (src.detach() if src.requires_grad else src).numpy()
        except (TypeError, RuntimeError) as e:
            raise CollectiveArgumentError(
                f"{what} has dtype {t.dtype}, which the backend cannot carry"
            ) from e
        return arr if arr.ndim == 1 else arr.reshape(-1)

    def reducible(self, t: Tensor, what: str, out: bool) -> Arr:
        """As view(), but half-precision tensors become a float32 copy."""
        t = _check(t, what)
        if t.dtype not in _HALF:
            return self.view(t, what, out)
        wide = t.to(torch.float32, memory_format=torch.contiguous_format)
        if out:
            self.back.append((t, wide))
        return wide.numpy().reshape(-1)

    def finish(self) -> None:
        for t, src in self.back:
            t.copy_(src)


# keyed by int(RedOpType): hashing torch's pybind enum costs more than the whole lookup
_REDOPS = {int(getattr(dist.ReduceOp, op.name)): op for op in ReduceOp}
# dtypes whose contiguous tensors all_reduce reaches as a numpy view with no conversion
# (not bfloat16/float16, reduced in float32; not complex, whose conj bit numpy lacks)
_PLAIN = {
    d
    for d in (
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    )
    if torch.empty(0, dtype=d).numpy().dtype in DTYPE_CODES
}


def _op(opts: Any) -> ReduceOp:
    red = opts.reduceOp
    kind = getattr(red, "op", red)  # torch's ReduceOp wraps a RedOpType
    op = _REDOPS.get(int(kind))
    if op is not None:
        return op
    name = getattr(kind, "name", None)
    if name not in ReduceOp.__members__:
        raise CollectiveArgumentError(
            f"ReduceOp {name or red!r} is not supported by the distlaunch backend "
            f"(use one of {', '.join(ReduceOp.__members__)})"
        )
    return as_reduce_op(name)
