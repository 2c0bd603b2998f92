"""MPI datatypes and mpi4py's buffer specifications.

A :class:`Datatype` is a *type map*: the byte offsets of every data byte of one element
(``size`` bytes) and the element's ``extent`` (the stride between consecutive elements,
padding included), as in MPI. Predefined types (``MPI.DOUBLE`` ...) are contiguous and
carry their numpy dtype; derived types (``Create_contiguous``/``vector``/``indexed``/
``struct``/``subarray``) are gathered into (packed) and scattered from (unpacked) a
contiguous byte string with one numpy fancy-indexing copy.

A buffer specification (mpi4py's forms) becomes a :class:`Spec`: ``buf``,
``[buf, datatype]``, ``[buf, count, datatype]``, ``[buf, (count, displ), datatype]``,
and for the v-collectives ``[buf, counts, datatype]``, ``[buf, (counts, displs),
datatype]``, ``[buf, counts, displs, datatype]``; ``None`` or ``[None, datatype]`` is
an empty buffer. ``buf`` is a C-contiguous numpy array, a torch CPU tensor, or an
object exporting a buffer (bytes for sending, bytearray/memoryview for receiving); a
datatype is a Datatype or a typecode string (``"d"``, ``"i"``, ``"B"`` ...). Without a
datatype, the buffer's own dtype gives it; without a count, the whole buffer is used.
"""

from __future__ import annotations

import array
import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ERR_BUFFER, ERR_TYPE, MPIException

UNDEFINED = -32766  # MPI_UNDEFINED (MPICH's value)
_U8 = np.dtype(np.uint8)


class Datatype:
    """An MPI datatype (MPI_Datatype). ``dtype``: the numpy dtype of a predefined type
    (a structured dtype for the pair types of MINLOC/MAXLOC), None for derived ones."""

    def __init__(
        self,
        name: str,
        offsets: np.ndarray,
        extent: int,
        dtype: np.dtype | None = None,
        lb: int = 0,
        base: np.dtype | None = None,
    ) -> None:
        self.name = name
        self.offsets = np.asarray(offsets, dtype=np.int64)  # byte offsets of the data bytes
        self.size = int(self.offsets.size)
        self.span = int(self.offsets.max(initial=-1)) + 1  # bytes from the first to past the last
        self.extent = int(extent)
        self.lb = int(lb)
        self.dtype = dtype
        self.base = base if base is not None else dtype  # the one basic type, when there is one
        self.contiguous = (
            self.lb == 0 and self.extent == self.size and bool((self.offsets == np.arange(self.size)).all())
        )
        self.committed = dtype is not None
        self.freed = False

    def __repr__(self) -> str:
        return f"<MPI.{self.name}>"

    # -- queries (MPI_Type_size, MPI_Type_get_extent, MPI_Type_get_name)

    def Get_size(self) -> int:
        return self.size

    def Get_extent(self) -> tuple[int, int]:
        """(lower bound, extent) in bytes."""
        return self.lb, self.extent

    def Get_true_extent(self) -> tuple[int, int]:
        if not self.size:
            return 0, 0
        lo, hi = int(self.offsets.min()), int(self.offsets.max()) + 1
        return lo, hi - lo

    def Get_name(self) -> str:
        return f"MPI_{self.name}" if self.dtype is not None else self.name

    def Set_name(self, name: str) -> None:
        self.name = name

    size_ = property(Get_size)
    extent_ = property(lambda self: self.extent)
    lb_ = property(lambda self: self.lb)
    ub = property(lambda self: self.lb + self.extent)

    def Commit(self) -> Datatype:
        self.committed = True
        return self

    def Free(self) -> None:
        self.freed = True

    def Dup(self) -> Datatype:
        return Datatype(self.name, self.offsets, self.extent, self.dtype, self.lb, self.base)

    # -- constructors (MPI_Type_*; mpi4py's method names)

    def _derived(self, name: str, starts: np.ndarray) -> np.ndarray:
        """Byte offsets of copies of this type starting at byte offsets ``starts``."""
        return (np.asarray(starts, dtype=np.int64)[:, None] + self.offsets[None, :]).reshape(-1)

    def _new(self, name: str, offsets: np.ndarray, extent: int, lb: int = 0) -> Datatype:
        return Datatype(name, offsets, extent, lb=lb, base=self.base)

    def Create_contiguous(self, count: int) -> Datatype:
        starts = np.arange(count) * self.extent
        return self._new("contiguous", self._derived("contiguous", starts), count * self.extent)

    def Create_vector(self, count: int, blocklength: int, stride: int) -> Datatype:
        """``count`` blocks of ``blocklength`` elements, ``stride`` elements apart."""
        starts = (np.arange(count)[:, None] * stride + np.arange(blocklength)[None, :]).reshape(-1)
        span = ((count - 1) * stride + blocklength) * self.extent if count else 0
        return self._new("vector", self._derived("vector", starts * self.extent), span)

    def Create_hvector(self, count: int, blocklength: int, stride: int) -> Datatype:
        """As Create_vector with ``stride`` in bytes."""
        starts = (np.arange(count)[:, None] * stride + np.arange(blocklength)[None, :] * self.extent).reshape(
            -1
        )
        span = (count - 1) * stride + blocklength * self.extent if count else 0
        return self._new("hvector", self._derived("hvector", starts), span)

    def Create_indexed(self, blocklengths: Sequence[int], displacements: Sequence[int]) -> Datatype:
        """Blocks of ``blocklengths[i]`` elements at ``displacements[i]`` elements."""
        idx = [d + k for b, d in zip(blocklengths, displacements) for k in range(b)]
        starts = np.asarray(idx, dtype=np.int64) * self.extent
        return self._from_starts("indexed", starts)

    def Create_indexed_block(self, blocklength: int, displacements: Sequence[int]) -> Datatype:
        return self.Create_indexed([blocklength] * len(displacements), displacements)

    def Create_hindexed(self, blocklengths: Sequence[int], displacements: Sequence[int]) -> Datatype:
        """As Create_indexed with ``displacements`` in bytes."""
        idx = [d + k * self.extent for b, d in zip(blocklengths, displacements) for k in range(b)]
        return self._from_starts("hindexed", np.asarray(idx, dtype=np.int64))

    def _from_starts(self, name: str, starts: np.ndarray) -> Datatype:
        offs = self._derived(name, starts)
        if not offs.size:
            return self._new(name, offs, 0)
        lb = min(0, int(starts.min()) + self.lb)
        ub = int(starts.max()) + self.lb + self.extent
        return self._new(name, offs, ub - lb, lb=lb if lb < 0 else 0)

    def Create_subarray(
        self, sizes: Sequence[int], subsizes: Sequence[int], starts: Sequence[int], order: int = 0
    ) -> Datatype:
        """The ``subsizes`` block at ``starts`` of an array of ``sizes`` (``order``:
        ORDER_C or ORDER_FORTRAN); the extent is the whole array's."""
        shape = tuple(sizes)
        full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape, order="F" if order == 1 else "C")
        block = full[tuple(slice(s, s + n) for s, n in zip(starts, subsizes))]
        flat = block.reshape(-1, order="F" if order == 1 else "C")
        return self._new("subarray", self._derived("subarray", flat * self.extent), full.size * self.extent)

    def Create_resized(self, lb: int, extent: int) -> Datatype:
        return self._new("resized", self.offsets, extent, lb=lb)

    @staticmethod
    def Create_struct(
        blocklengths: Sequence[int], displacements: Sequence[int], datatypes: Sequence[Datatype]
    ) -> Datatype:
        """Blocks of ``blocklengths[i]`` x ``datatypes[i]`` at byte ``displacements[i]``;
        the extent is padded to the largest member's alignment, as C structs are."""
        parts, ub, align = [], 0, 1
        for b, d, t in zip(blocklengths, displacements, datatypes):
            starts = d + np.arange(b, dtype=np.int64) * t.extent
            parts.append(t._derived("struct", starts))
            ub = max(ub, d + b * t.extent)
            align = max(align, t.base.alignment if t.base is not None else 1)
        offs = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        bases = {t.base for t in datatypes}
        t = Datatype("struct", offs, -(-ub // align) * align)
        t.base = bases.pop() if len(bases) == 1 else None
        return t

    # -- packing

    def byte_index(self, count: int, displ: int = 0) -> np.ndarray:
        """Byte offsets of ``count`` elements starting ``displ`` elements in."""
        starts = (np.arange(count, dtype=np.int64) + displ) * self.extent
        return (starts[:, None] + self.offsets[None, :]).reshape(-1)


def _predefined(name: str, dtype: Any) -> Datatype:
    dt = np.dtype(dtype)
    if dt.names:  # pair type: data bytes are the fields' bytes, padding excluded
        offs = np.concatenate(
            [np.arange(dt.fields[f][1], dt.fields[f][1] + dt.fields[f][0].itemsize) for f in dt.names]
        )
        return Datatype(name, offs, dt.itemsize, dt)
    return Datatype(name, np.arange(dt.itemsize), dt.itemsize, dt)


def _pair(value: str) -> np.dtype:
    return np.dtype([("value", value), ("index", "i4")], align=True)


DATATYPE_NULL = Datatype("DATATYPE_NULL", np.zeros(0), 0)
CHAR = _predefined("CHAR", np.int8)
SIGNED_CHAR = _predefined("SIGNED_CHAR", np.int8)
UNSIGNED_CHAR = _predefined("UNSIGNED_CHAR", np.uint8)
BYTE = _predefined("BYTE", np.uint8)
PACKED = _predefined("PACKED", np.uint8)
SHORT = _predefined("SHORT", np.int16)
UNSIGNED_SHORT = _predefined("UNSIGNED_SHORT", np.uint16)
INT = _predefined("INT", np.int32)
UNSIGNED = _predefined("UNSIGNED", np.uint32)
LONG = _predefined("LONG", np.int64)
UNSIGNED_LONG = _predefined("UNSIGNED_LONG", np.uint64)
LONG_LONG = _predefined("LONG_LONG", np.int64)
UNSIGNED_LONG_LONG = _predefined("UNSIGNED_LONG_LONG", np.uint64)
FLOAT = _predefined("FLOAT", np.float32)
DOUBLE = _predefined("DOUBLE", np.float64)
LONG_DOUBLE = _predefined("LONG_DOUBLE", np.longdouble)
C_BOOL = BOOL = _predefined("C_BOOL", np.bool_)
INT8_T = _predefined("INT8_T", np.int8)
INT16_T = _predefined("INT16_T", np.int16)
INT32_T = _predefined("INT32_T", np.int32)
INT64_T = _predefined("INT64_T", np.int64)
UINT8_T = _predefined("UINT8_T", np.uint8)
UINT16_T = _predefined("UINT16_T", np.uint16)
UINT32_T = _predefined("UINT32_T", np.uint32)
UINT64_T = _predefined("UINT64_T", np.uint64)
C_FLOAT_COMPLEX = COMPLEX = _predefined("C_FLOAT_COMPLEX", np.complex64)
C_DOUBLE_COMPLEX = DOUBLE_COMPLEX = _predefined("C_DOUBLE_COMPLEX", np.complex128)
WCHAR = _predefined("WCHAR", np.int32)
AINT = OFFSET = COUNT = _predefined("AINT", np.int64)
FLOAT_INT = _predefined("FLOAT_INT", _pair("f4"))
DOUBLE_INT = _predefined("DOUBLE_INT", _pair("f8"))
LONG_INT = _predefined("LONG_INT", _pair("i8"))
SHORT_INT = _predefined("SHORT_INT", _pair("i2"))
TWOINT = INT_INT = _predefined("2INT", np.dtype([("value", "i4"), ("index", "i4")]))
LONG_DOUBLE_INT = _predefined("LONG_DOUBLE_INT", _pair("g"))

# numpy dtype / typecode -> the predefined type used when a buffer names none
_BY_DTYPE: dict[np.dtype, Datatype] = {}
for _t in (BYTE, SIGNED_CHAR, SHORT, UNSIGNED_SHORT, INT, UNSIGNED, LONG, UNSIGNED_LONG, FLOAT, DOUBLE):
    _BY_DTYPE.setdefault(_t.dtype, _t)  # type: ignore[arg-type]  # predefined: dtype is set
for _t in (LONG_DOUBLE, C_BOOL, C_FLOAT_COMPLEX, C_DOUBLE_COMPLEX, TWOINT):
    _BY_DTYPE.setdefault(_t.dtype, _t)  # type: ignore[arg-type]
for _t in (FLOAT_INT, DOUBLE_INT, LONG_INT, SHORT_INT):
    _BY_DTYPE.setdefault(_t.dtype, _t)  # type: ignore[arg-type]
_BY_CODE = {"c": CHAR, "b": SIGNED_CHAR, "B": BYTE, "?": C_BOOL}


def datatype_of(spec: Any) -> Datatype:
    """A Datatype from a Datatype, a typecode (``"d"``) or a numpy dtype; MPIException
    (ERR_TYPE) otherwise."""
    if isinstance(spec, Datatype):
        return spec
    if isinstance(spec, str) and spec in _BY_CODE:
        return _BY_CODE[spec]
    try:
        dt = np.dtype(spec)
    except TypeError:
        dt = None
    t = _BY_DTYPE.get(dt) if dt is not None else None
    if t is None:
        raise MPIException(ERR_TYPE, f"{spec!r} is not an MPI datatype (use e.g. MPI.DOUBLE or 'd')")
    return t


# the last numpy array used for sending / receiving (index: writable), its bytes as a
# flat uint8 array and a memoryview, and its dtype: programs pass the same buffers
# again and again, and these views cost more than the rest of a small message's send
# (the views keep that one array of each kind alive; arrays over other objects' memory
# are not kept: see _array_bytes)
_LAST: list[tuple[np.ndarray, np.ndarray, memoryview, np.dtype] | None] = [None, None]


# the last view fast_bytes cut to a count of the kept array of _LAST (index: writable):
# the whole view, the count in bytes, the cut view (a window of Isend/Irecv passes the
# same [buf, count, type])
_CUT: list[tuple[memoryview, int, memoryview] | None] = [None, None]


# the last ``[buf, count, datatype]`` fast_bytes resolved whose buffer is the kept numpy
# array of _LAST (index: writable): its three items and the view (an osu_bw window passes
# the same three objects in a new list each call: one look instead of the whole path)
_SPEC: list[tuple[Any, Any, Any, memoryview | None]] = [(None, None, None, None)] * 2


def _array_bytes(
    arr: np.ndarray, writable: bool, keep: bool = True
) -> tuple[np.ndarray, memoryview, np.dtype] | None:
    """A numpy array's bytes (uint8 array and memoryview, no copy) and dtype; None when
    it is not C-contiguous or (``writable``) read-only. ``keep``: remember them for the
    next call with the same array (not for a tensor's fresh view: never seen again)."""
    last = _LAST[writable]
    if last is not None and last[0] is arr and (not writable or arr.flags.writeable):
        return last[1], last[2], last[3]
    flags = arr.flags
    if not flags.c_contiguous or writable and not flags.writeable:
        return None
    raw = arr.reshape(-1).view(np.uint8)
    mv = raw.data
    if keep and arr.base is None:
        # only an array that owns its memory: a kept view of an mmap's or a bytearray's
        # memory would make the program's mm.close() or resize fail (BufferError)
        _LAST[writable] = (arr, raw, mv, arr.dtype)
        # and what was kept of the array it replaces goes with it (else it stays pinned)
        _CUT[writable] = None
        _SPEC[writable] = (None, None, None, None)
    return raw, mv, arr.dtype


def _bytes_of(buf: Any, writable: bool) -> tuple[memoryview, np.dtype] | None:
    """``buf``'s memory as a flat byte memoryview (no copy) and its element dtype, for
    the buffer types of :func:`fast_bytes`; None for anything else, a non-contiguous
    or (``writable``) read-only buffer (:func:`parse` says why)."""
    tp = type(buf)
    if tp is np.ndarray:
        got = _array_bytes(buf, writable)
        return None if got is None else (got[1], got[2])
    if tp is bytearray or tp is mmap.mmap or tp is bytes:  # flat bytes, format "B"
        mv = memoryview(buf)
        return None if writable and mv.readonly else (mv, _U8)
    if tp.__module__ == "torch":  # torch.Tensor (subclasses: parse)
        try:  # CPU, no grad, a numpy dtype; else parse (it says why)
            buf = memoryview(buf.numpy())
        except (TypeError, RuntimeError, ValueError, BufferError):
            return None
        tp = memoryview
    if tp is memoryview:
        mv = buf
        if writable and mv.readonly:
            return None
        fmt = mv.format
        if mv.ndim == 1 and fmt == "B":
            return (mv, _U8) if mv.contiguous else None  # a strided slice: parse refuses it
        if not mv.c_contiguous:
            return None
        try:  # the element dtype as parse sees it (a Datatype of that dtype)
            dtype = _U8 if fmt in ("b", "c") else np.dtype(fmt)
            return mv.cast("B"), dtype
        except (TypeError, ValueError):  # a format numpy or cast does not know
            return None
    if tp is array.array:  # never read-only; parse takes its bytes as BYTE
        return memoryview(buf).cast("B"), _U8
    return None


def fast_bytes(spec: Any, writable: bool) -> memoryview | None:
    """The message bytes of the common buffer specifications -- a buffer (numpy array
    of a predefined type, torch CPU tensor, bytearray, bytes when sending, memoryview,
    mmap, array.array), ``[buf, datatype]``, ``[buf, count, datatype]`` with a
    predefined (contiguous) Datatype -- as a flat byte memoryview of the buffer (no
    copy; a count is honoured by slicing the view); None for any other form or anything
    :func:`parse` would reject (parse it: it says why). Every buffer type takes this
    same path, so none costs more per message than another."""
    tp = type(spec)
    if tp is list and len(spec) == 3:  # first: the window's case, a look at _SPEC
        buf, count, t = spec
        c = _SPEC[writable]
        if c[0] is buf and c[1] is count and c[2] is t and (not writable or buf.flags.writeable):
            return c[3]
    t = None
    count = -1
    if tp is list or tp is tuple:
        k = len(spec)
        if k == 3:
            buf, count, t = spec
            if type(count) is not int or count < 0:
                return None
        elif k == 2:
            buf, t = spec
        else:
            return None
        if type(t) is not Datatype or not t.contiguous or not t.size:
            return None
    else:
        buf = spec
    last = _LAST[writable]
    if last is not None and last[0] is buf and (not writable or buf.flags.writeable):
        mv, dtype = last[2], last[3]  # the same numpy array again: no new views
    else:
        got = _bytes_of(buf, writable)
        if got is None:
            return None
        mv, dtype = got
    if t is None:
        return mv if dtype in _BY_DTYPE else None  # else parse raises ERR_TYPE
    size = t.size
    n = len(mv) // size * size if count < 0 else count * size
    if n > len(mv):
        return None
    last = _LAST[writable]
    if last is None or last[0] is not buf:
        # not the kept array: a view kept here would keep the program's bytearray from
        # being resized and its mmap from being closed (BufferError), as mpi4py does not
        return mv if n == len(mv) else mv[:n]
    if n == len(mv):
        view = mv
    else:
        cut = _CUT[writable]
        if cut is not None and cut[0] is mv and cut[1] == n:
            view = cut[2]  # the same count of the same buffer again: no new view
        else:
            view = mv[:n]
            _CUT[writable] = (mv, n, view)
    if count >= 0:  # the kept array's [buf, count, type]
        _SPEC[writable] = (buf, count, t, view)
    return view


def raw_bytes(obj: Any, writable: bool) -> tuple[np.ndarray, np.dtype]:
    """``obj``'s memory as a flat uint8 array (a view, no copy) and its element dtype.
    MPIException(ERR_BUFFER) for a non-contiguous or (when ``writable``) read-only buffer."""
    if type(obj) is np.ndarray:
        got = _array_bytes(obj, writable)
        if got is not None:
            return got[0], got[2]
    tp = type(obj)
    if tp is bytearray or tp is mmap.mmap:  # always C-contiguous bytes: no further checks
        arr = np.frombuffer(obj, dtype=np.uint8)
        if writable and not arr.flags.writeable:
            raise MPIException(ERR_BUFFER, f"buffer of type {tp.__name__} is read-only; pass a writable one")
        return arr, _U8
    if tp.__module__.startswith("torch"):
        obj = obj.detach().numpy()
    arr = obj if isinstance(obj, np.ndarray) else np.frombuffer(obj, dtype=np.uint8)
    if isinstance(obj, np.ndarray) or not isinstance(obj, (bytes, bytearray)):
        if not arr.flags.c_contiguous:
            raise MPIException(ERR_BUFFER, "buffer must be C-contiguous (pass np.ascontiguousarray(buf))")
    if writable and not arr.flags.writeable:
        raise MPIException(
            ERR_BUFFER, f"buffer of type {type(obj).__name__} is read-only; pass a writable one"
        )
    dtype = arr.dtype
    if isinstance(obj, memoryview) and obj.format not in ("B", "b", "c"):
        dtype = np.dtype(obj.format)
    return arr.reshape(-1).view(np.uint8), dtype


class Spec:
    """One buffer specification resolved: ``raw`` (the buffer's bytes), ``datatype``,
    ``count`` elements starting ``displ`` elements in; for v-collectives ``counts`` and
    ``displs`` (elements) per rank."""

    __slots__ = ("raw", "datatype", "count", "displ", "counts", "displs")

    def __init__(self, raw: np.ndarray, datatype: Datatype, count: int, displ: int = 0) -> None:
        self.raw, self.datatype, self.count, self.displ = raw, datatype, count, displ
        self.counts: list[int] | None = None
        self.displs: list[int] | None = None

    @property
    def nbytes(self) -> int:
        return self.count * self.datatype.size

    def view(self, count: int | None = None, displ: int | None = None) -> np.ndarray | None:
        """The bytes of ``count`` elements at ``displ`` as a view when the type is
        contiguous, else None (pack/unpack instead)."""
        t = self.datatype
        if not t.contiguous:
            return None
        n = self.count if count is None else count
        d = self.displ if displ is None else displ
        return self.raw[d * t.extent : d * t.extent + n * t.size]

    def pack(self, count: int | None = None, displ: int | None = None) -> np.ndarray:
        """The data bytes of ``count`` elements at ``displ`` (a view when contiguous)."""
        v = self.view(count, displ)
        if v is not None:
            return v
        n = self.count if count is None else count
        return self.raw[self.datatype.byte_index(n, self.displ if displ is None else displ)]

    def unpack(self, data: np.ndarray | memoryview, displ: int | None = None) -> int:
        """Write ``data`` (packed bytes, at most the capacity) into the buffer; returns the
        number of bytes written."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        t = self.datatype
        d = self.displ if displ is None else displ
        if t.contiguous:
            self.raw[d * t.extent : d * t.extent + src.size] = src
        elif src.size:
            n = src.size // t.size
            self.raw[t.byte_index(n, d)] = src[: n * t.size]
        return int(src.size)


def _count_of(raw: np.ndarray, t: Datatype, displ: int = 0) -> int:
    if not t.extent:
        return 0
    return (
        max(0, raw.size // t.extent - displ)
        if t.extent == t.size
        else max(0, (raw.size - t.lb) // t.extent - displ)
    )


def parse(spec: Any, writable: bool, vector: bool = False, blocks: int = 1) -> Spec:
    """Resolve a buffer specification (see the module docstring); ``vector``: the counts
    are per rank (v-collectives); ``blocks``: without an explicit count, the buffer
    holds that many equal blocks (one per rank) and ``count`` is one block's.
    MPIException (ERR_BUFFER / ERR_TYPE) when malformed."""
    if type(spec) is list and len(spec) == 3 and not vector:  # [buf, count, Datatype]: the common form
        buf, count, t = spec
        if type(count) is int and type(t) is Datatype and buf is not None:
            raw = raw_bytes(buf, writable)[0]
            if count and (count - 1) * t.extent + t.span > raw.size:
                raise _fit_error(count, t, raw.size)
            return Spec(raw, t, count)
    if spec is None:
        return Spec(np.zeros(0, dtype=np.uint8), BYTE, 0)
    if isinstance(spec, (list, tuple)) and not isinstance(spec, np.ndarray):
        items = list(spec)
        if not items or len(items) > 4:
            raise MPIException(ERR_BUFFER, f"buffer specification {spec!r} must be [buf, (count), datatype]")
        buf = items[0]
        if buf is None:
            raw, native = np.zeros(0, dtype=np.uint8), np.dtype(np.uint8)
        else:
            raw, native = raw_bytes(buf, writable)
        rest = items[1:]
        if rest and (isinstance(rest[-1], (Datatype, str)) or _is_dtype(rest[-1])):
            t = datatype_of(rest.pop())
        else:
            t = datatype_of(native)
        counts: Any = rest[0] if rest else None
        displs: Any = rest[1] if len(rest) > 1 else None
        if isinstance(counts, tuple) and len(counts) == 2 and displs is None:
            counts, displs = counts
        if vector:
            return _vector(raw, t, counts, displs)
        if counts is None:
            return Spec(raw, t, _count_of(raw, t, int(displs or 0)) // blocks, int(displs or 0))
        if not isinstance(counts, (int, np.integer)):
            raise MPIException(ERR_BUFFER, f"count {counts!r} in {spec!r} must be an int")
        s = Spec(raw, t, int(counts), int(displs or 0))
        if s.count and (s.displ + s.count - 1) * t.extent + t.span > raw.size:
            raise _fit_error(s.count, t, raw.size)
        return s
    raw, native = raw_bytes(spec, writable)
    t = datatype_of(native) if native != np.dtype(np.uint8) or isinstance(spec, np.ndarray) else BYTE
    return _vector(raw, t, None, None) if vector else Spec(raw, t, _count_of(raw, t) // blocks)


def _fit_error(count: int, t: Datatype, size: int) -> MPIException:
    return MPIException(ERR_BUFFER, f"count {count} x {t.Get_name()} does not fit a {size}-byte buffer")


def _is_dtype(x: Any) -> bool:
    return isinstance(x, (np.dtype, type)) and x is not int


def _vector(raw: np.ndarray, t: Datatype, counts: Any, displs: Any) -> Spec:
    s = Spec(raw, t, _count_of(raw, t))
    if counts is not None:
        if isinstance(counts, (int, np.integer)):
            s.counts = None
            s.count = int(counts)
            return s
        s.counts = [int(c) for c in counts]
        if displs is None:
            displs = np.concatenate([[0], np.cumsum(s.counts)[:-1]]).astype(int).tolist() if s.counts else []
        s.displs = [int(d) for d in displs]
    return s
