"""Turning user buffers into numpy arrays that share their memory.

Accepted: numpy arrays of every numeric dtype and bool, torch CPU tensors (through
``tensor.detach().numpy()``, zero-copy; torch is never imported here, a tensor is
recognised by ``type(x).__module__``), and other objects exporting a buffer
(``bytearray``, ``memoryview``, ``array.array``). Buffers must be C-contiguous, in
native byte order, and writable when results are written into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import CollectiveArgumentError
from .wire import DTYPE_CODES


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


def _from_torch(t: Any, name: str) -> np.ndarray:
    if str(getattr(t, "layout", "torch.strided")) != "torch.strided":
        raise CollectiveArgumentError(
            f"{name} has layout {t.layout}; only dense (strided) CPU tensors are supported"
        )
    if t.device.type != "cpu":
        raise CollectiveArgumentError(f"{name} is on device {t.device}; only CPU tensors are supported")
    if not t.is_contiguous():
        raise CollectiveArgumentError(f"{name} is not contiguous (call .contiguous() on it first)")
    try:
        return t.detach().numpy()
    except (TypeError, RuntimeError) as e:  # e.g. bfloat16 (no numpy dtype), conjugate views
        raise CollectiveArgumentError(
            f"{name} (dtype {t.dtype}) cannot be viewed as a numpy array: {e}"
        ) from e


def as_array(obj: Any, name: str, writable: bool = True) -> np.ndarray:
    """Return an ndarray sharing ``obj``'s memory.

    ``name`` is the argument name used in error messages. Raises CollectiveArgumentError
    when ``obj`` has no buffer, is not C-contiguous, is read-only while ``writable``, has
    a non-native byte order or a dtype outside bool/int/uint/float/complex.
    """
    if isinstance(obj, np.ndarray):
        arr = obj
    elif _is_torch_tensor(obj):
        arr = _from_torch(obj, name)
    else:
        try:
            arr = np.asarray(memoryview(obj))
        except TypeError:
            raise CollectiveArgumentError(
                f"{name} must be a numpy array, a torch CPU tensor or a writable buffer, "
                f"not {type(obj).__name__}"
            ) from None
    if _usable(arr, writable):
        return arr
    flags = arr.flags
    if not flags.c_contiguous:
        raise CollectiveArgumentError(
            f"{name} is not C-contiguous (shape {arr.shape}, strides {arr.strides}); "
            f"pass np.ascontiguousarray(...) / tensor.contiguous()"
        )
    if writable and not flags.writeable:
        raise CollectiveArgumentError(f"{name} is read-only; the result is written into it")
    if arr.dtype not in DTYPE_CODES:
        if arr.dtype.kind in "biufc" and not arr.dtype.isnative:
            raise CollectiveArgumentError(f"{name} has non-native byte order ({arr.dtype.str})")
        raise CollectiveArgumentError(f"{name} has unsupported dtype {arr.dtype}")
    return arr


def _usable(arr: np.ndarray, writable: bool) -> bool:
    """``arr`` passes as_array's checks (C-contiguous, writable if it must be, a
    supported dtype)."""
    flags = arr.flags  # (a new object per access: read once)
    return flags.c_contiguous and (flags.writeable or not writable) and arr.dtype in DTYPE_CODES


def as_array_list(objs: Any, name: str, length: int | None = None, writable: bool = True) -> list:
    """``as_array`` on every element of a list; checks its length when given."""
    if objs is None or isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__"):
        raise CollectiveArgumentError(f"{name} must be a list of buffers, not {type(objs).__name__}")
    if length is not None and len(objs) != length:
        raise CollectiveArgumentError(f"{name} has {len(objs)} elements; the group has {length} ranks")
    # (numpy arrays that pass: without formatting each one's name, the small calls' cost)
    return [
        o if type(o) is np.ndarray and _usable(o, writable) else as_array(o, f"{name}[{i}]", writable)
        for i, o in enumerate(objs)
    ]


def flat(arr: np.ndarray) -> np.ndarray:
    """1-D view of a C-contiguous array (no copy; the array itself when already 1-D)."""
    return arr if arr.ndim == 1 else arr.reshape(-1)


def byte_view(arr: np.ndarray) -> memoryview:
    """Writable (or read-only, as ``arr``) memoryview of ``arr``'s bytes, format 'B'."""
    # numpy's stubs declare ndarray.__buffer__ (the Buffer protocol) only for Python >= 3.12
    if arr.flags.c_contiguous and not arr.dtype.hasobject:
        try:  # the buffer protocol directly: ~6x cheaper (the fast paths' cost)
            return memoryview(arr).cast("B")  # type: ignore[arg-type]
        except (ValueError, TypeError):  # datetime64 / timedelta64, empty n-d shapes
            pass
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def joined(blocks: np.ndarray | list) -> tuple[np.ndarray, bool]:
    """``blocks`` (n arrays, or one array of n blocks) as one array, and whether that
    array is a fresh copy the caller may overwrite."""
    if isinstance(blocks, np.ndarray):
        return blocks, False
    return (np.concatenate(blocks) if blocks else np.empty(0, np.uint8)), True


def check_same(arrs: Sequence[np.ndarray], ref: np.ndarray, what: str, size: int | None = None) -> None:
    """CollectiveArgumentError naming ``what[i]`` unless every array has ``ref``'s dtype
    and ``size`` elements (default: ``ref``'s)."""
    want = ref.size if size is None else size
    if len(arrs) == 1 and arrs[0].size == want and arrs[0].dtype == ref.dtype:
        return  # (one array, each call of a *_tensor operation: the cheap test alone)
    for i, a in enumerate(arrs):
        if a.dtype != ref.dtype or a.size != want:
            raise CollectiveArgumentError(
                f"{what}[{i}] has {a.size} x {a.dtype}; expected {want} x {ref.dtype}"
            )


def split_bounds(
    shape: Sequence[int], size: int, sizes: Sequence[int] | None, n: int, what: str, lazy: bool = False
) -> list | None:
    """Element ranges [(start, end)] of the n splits along the first dimension of a
    buffer of ``shape`` and ``size`` elements, ``sizes[i]`` rows each (None: equal
    splits; ``lazy``: then None instead of the ranges); CollectiveArgumentError naming
    ``what`` when they do not fit."""
    rows = shape[0] if len(shape) else 1
    if sizes is None:
        if rows % n:
            raise CollectiveArgumentError(f"{what} has {rows} rows, not divisible by the group size {n}")
        if lazy:
            return None
        sizes = [rows // n] * n
    per_row = size // rows if rows else 0
    sizes = list(sizes)
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise CollectiveArgumentError(f"{what}_split_sizes={sizes} must be {n} sizes summing to {rows}")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start * per_row, (start + s) * per_row))
        start += s
    return bounds
