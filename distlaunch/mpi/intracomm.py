"""Intracomm: the collectives and the communicator constructors (see :mod:`.comm` for
how each collective is carried out). Buffers are mpi4py buffer specifications (see
:mod:`.datatypes`); ``IN_PLACE`` is accepted where MPI accepts it. Blocking: every call
returns when this rank's part is done, waiting at most the group timeout
(CollectiveTimeoutError); small Bcast/Scatter roots and Gather non-roots return without
waiting for the others on shared memory (as MPICH's eager messages); ranks calling
different collectives raise CollectiveMismatchError where the collectives detect it (in
that call, or for a rank that compared nobody's call, in its next one or when the
communicator is freed / MPI finalized); malformed
arguments raise MPIException.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .. import collectives as dist
from ..collectives.api import resolve_group
from . import plans
from .comm import (
    COMM_TYPE_SHARED,
    IN_PLACE,
    STATE,
    Comm,
    Group,
    Handle,
    _alloc_ctx,
    _lazy,
    _new_handle,
    _pickle,
    _unpickle,
)
from .datatypes import BYTE as _BYTE
from .datatypes import UNDEFINED, Datatype, Spec, parse
from .errors import ERR_ARG, ERR_BUFFER, MPIException
from .ops import SUM, Op
from .p2p import Request

_U8 = np.uint8


def _empty(n: int) -> np.ndarray:
    return np.empty(n, dtype=_U8)


def _sub(spec: Spec, count: int, displ: int) -> Spec:
    return Spec(spec.raw, spec.datatype, count, displ)


def _pg(h: Handle) -> Any:
    """The runtime's ProcessGroup of a communicator (its ranks in communicator order)."""
    return resolve_group(h.pg)


def _bytes(s: Spec, count: int | None = None, displ: int | None = None) -> np.ndarray:
    """The data bytes of ``count`` elements at ``displ``: a view of the buffer when the
    type is contiguous (the count honoured without a copy), else packed."""
    return np.ascontiguousarray(s.pack(count, displ))


def _out(r: Spec | None) -> np.ndarray:
    """Where ``r``'s bytes are received: a view of its buffer (contiguous type), else a
    scratch array unpacked afterwards."""
    if r is None:
        return _empty(0)
    v = r.view()
    return v if v is not None else _empty(r.nbytes)


def _size_error(what: str, got: int, want: int) -> MPIException:
    return MPIException(
        ERR_BUFFER, f"{what} block holds {got} bytes but {want} are sent to it; make the counts agree"
    )


def _blocks(r: Spec, n: int, nbytes: int, what: str) -> list[np.ndarray]:
    """The n receive blocks of ``r`` (``r.count`` elements each from ``r.displ``) as
    flat byte arrays: views when the type is contiguous, else scratch (:func:`_unblock`)."""
    if r.nbytes != nbytes:
        raise _size_error(what, r.nbytes, nbytes)
    if r.view() is not None:
        return [r.view(r.count, r.displ + i * r.count) for i in range(n)]  # type: ignore[misc]
    return [_empty(nbytes) for _ in range(n)]


def _unblock(r: Spec, outs: list | None, n: int) -> None:
    """Unpack scratch blocks of :func:`_blocks` (nothing to do for views)."""
    if outs is not None and r.view() is None:
        for i, o in enumerate(outs):
            r.unpack(o, r.displ + i * r.count)


def _ran(h: Handle | None, op: str, a: Any, b: Any, root: int) -> bool:
    """Run the call on the plan an earlier call with these buffer objects left (see
    :mod:`.plans`): True when it ran, False when there is none or it does not apply."""
    if h is None:
        return False
    plan = h.plans.get(
        (
            op,
            id(a[0]) if type(a) is list and a else id(a),
            id(b[0]) if type(b) is list and b else id(b),
            root,
        )
    )
    return plan is not None and plan.run(a, b)


class Intracomm(Comm):
    """mpi4py's Intracomm (COMM_WORLD, COMM_SELF and every communicator made from them)."""

    # -- helpers

    def _group(self, h: Handle) -> Any:
        return h.pg  # None: the world

    def _exchange(
        self, h: Handle, sends: list[tuple[int, np.ndarray]], recvs: list[tuple[int, Spec | None]]
    ) -> list:
        """Point-to-point in the collective context: send ``(rank, bytes)`` and receive
        ``(rank, spec)`` (spec None: a pickled object, returned in order)."""
        rs = [self._irecv(spec, src, 0, ctx=h.cctx) for src, spec in recvs]
        ss = [self._isend(data, dst, 0, ctx=h.cctx) for dst, data in sends]
        out = [r.wait() for r in rs]
        for s in ss:
            s.Wait()
        return out

    def _gather_bytes(self, h: Handle, data: np.ndarray, root: int | None) -> list[np.ndarray] | None:
        """Every rank's ``data`` (equal sizes) at ``root`` (None: everywhere), in rank order."""
        n = len(data)
        out = _empty(n * h.size) if root is None or h.rank == root else None
        if h.size == 1:
            return [data.copy()]
        if root is None:
            dist.all_gather_into_tensor(out, np.ascontiguousarray(data), group=h.pg)
        else:
            parts = [out[i * n : (i + 1) * n] for i in range(h.size)] if out is not None else None
            dist.gather(np.ascontiguousarray(data), parts, dst=h.ranks[root], group=h.pg)
        return None if out is None else [out[i * n : (i + 1) * n] for i in range(h.size)]

    @staticmethod
    def _fold(parts: list[np.ndarray], op: Op, t: Datatype) -> np.ndarray:
        acc = parts[-1]
        for x in reversed(parts[:-1]):
            acc = op.combine(x, acc, t)
        return acc

    # -- object collectives

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        h = self._h()
        self._eng()
        if h.size == 1:
            return _unpickle(_pickle(obj).data)
        box = [obj]
        dist.broadcast_object_list(box, src=h.global_rank(root, "root"), group=h.pg)
        return box[0]

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        h = self._h()
        self._eng()
        out: list[Any] | None = [None] * h.size if h.rank == root else None
        if h.size == 1:
            return [_unpickle(_pickle(sendobj).data)]
        dist.gather_object(sendobj, out, dst=h.global_rank(root, "root"), group=h.pg)
        return out

    def allgather(self, sendobj: Any) -> list[Any]:
        h = self._h()
        self._eng()
        if h.size == 1:
            return [_unpickle(_pickle(sendobj).data)]
        out: list[Any] = [None] * h.size
        dist.all_gather_object(out, sendobj, group=h.pg)
        return out

    def scatter(self, sendobj: Any = None, root: int = 0) -> Any:
        """``sendobj``: at ``root``, one object per rank (in rank order)."""
        h = self._h()
        self._eng()
        if h.rank == root and (sendobj is None or len(sendobj) != h.size):
            raise MPIException(ERR_ARG, f"scatter needs {h.size} objects at the root, got {sendobj!r:.80}")
        if h.size == 1:
            return _unpickle(_pickle(sendobj[0]).data)
        out: list[Any] = [None]
        dist.scatter_object_list(
            out, list(sendobj) if h.rank == root else None, src=h.ranks[root], group=h.pg
        )
        return out[0]

    def alltoall(self, sendobj: Any) -> list[Any]:
        """``sendobj[i]`` goes to rank i; returns what each rank sent to this one."""
        h = self._h()
        if sendobj is None or len(sendobj) != h.size:
            raise MPIException(ERR_ARG, f"alltoall needs {h.size} objects, got {sendobj!r:.80}")
        got = self._exchange(
            h,
            [(i, _pickle(sendobj[i])) for i in range(h.size) if i != h.rank],
            [(i, None) for i in range(h.size) if i != h.rank],
        )
        got.insert(h.rank, _unpickle(_pickle(sendobj[h.rank]).data))
        return got

    def reduce(self, sendobj: Any, op: Op = SUM, root: int = 0) -> Any:
        values = self.gather(sendobj, root)
        return functools.reduce(lambda a, b: op(a, b), values) if values is not None else None

    def allreduce(self, sendobj: Any, op: Op = SUM) -> Any:
        return functools.reduce(lambda a, b: op(a, b), self.allgather(sendobj))

    def scan(self, sendobj: Any, op: Op = SUM) -> Any:
        values = self.allgather(sendobj)
        return functools.reduce(lambda a, b: op(a, b), values[: self.rank + 1])

    def exscan(self, sendobj: Any, op: Op = SUM) -> Any:
        """The reduction over ranks below this one (None on rank 0, as mpi4py)."""
        values = self.allgather(sendobj)
        r = self.rank
        return functools.reduce(lambda a, b: op(a, b), values[:r]) if r else None

    # -- buffer collectives

    def _plan(
        self, h: Handle, op: str, a: Any, b: Any, root: int, pa: Any, pb: Any, count: int, nb: int
    ) -> None:
        """Leave a plan for repeating this call (see :func:`.plans.keep`): ``a``, ``b``
        the send and receive specifications, ``pa``, ``pb`` their :func:`.plans.buf_of`,
        ``count`` the call record's count, ``nb`` bytes per block."""
        if h.size > 1:
            plans.keep(h, _pg(h), op, plans.key(op, a, b, root), count, root, pa, pb, nb)

    def Bcast(self, buf: Any, root: int = 0) -> None:
        if _ran(self._handle, "broadcast", buf, None, root):
            return
        h = self._h()
        self._eng()
        h.global_rank(root, "root")
        s = parse(buf, h.rank != root)
        if h.size == 1:
            return
        v = s.view()
        if v is not None:
            _pg(h).broadcast(v, root)
            pa = plans.buf_of(buf, s, write=h.rank != root)
            self._plan(h, "broadcast", buf, None, root, pa, None, len(v), len(v))
            return
        tmp = s.pack() if h.rank == root else _empty(s.nbytes)
        _pg(h).broadcast(tmp, root)
        if h.rank != root:
            s.unpack(tmp)

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        if _ran(self._handle, "gather", sendbuf, recvbuf, root):
            return
        h = self._h()
        self._eng()
        h.global_rank(root, "root")
        r = parse(recvbuf, True, blocks=h.size) if h.rank == root else None
        if sendbuf is IN_PLACE:
            if r is None:
                raise MPIException(ERR_BUFFER, "IN_PLACE is the root's sendbuf only")
            data = r.pack(r.count, r.displ + h.rank * r.count)
            s = None
        else:
            s = parse(sendbuf, False)
            data = _bytes(s)
        if h.size == 1:
            if r is not None and sendbuf is not IN_PLACE:
                r.unpack(data)
            return
        outs = None if r is None else _blocks(r, h.size, len(data), "recvbuf")
        _pg(h).gather(data, outs, root)
        if r is not None:
            _unblock(r, outs, h.size)
        pa, pb = plans.buf_of(sendbuf, s), plans.buf_of(recvbuf, r, h.size, True)
        self._plan(h, "gather", sendbuf, recvbuf, root, pa, pb, len(data), len(data))

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        if _ran(self._handle, "scatter", sendbuf, recvbuf, root):
            return
        h = self._h()
        self._eng()
        h.global_rank(root, "root")
        s = parse(sendbuf, False, blocks=h.size) if h.rank == root else None
        in_place = recvbuf is IN_PLACE
        if in_place and s is None:
            raise MPIException(ERR_BUFFER, "IN_PLACE is the root's recvbuf only")
        r = None if in_place else parse(recvbuf, True)
        ins = None if s is None else [_bytes(s, s.count, s.displ + i * s.count) for i in range(h.size)]
        if ins is not None and r is not None and r.nbytes != len(ins[0]):
            raise _size_error("recvbuf", r.nbytes, len(ins[0]))
        out = ins[h.rank] if in_place and ins is not None else _out(r)
        if h.size == 1:
            out[:] = ins[0] if ins is not None else out
        else:
            _pg(h).scatter(out, ins, root)
        if r is not None and r.view() is None:
            r.unpack(out)
        pa, pb = plans.buf_of(sendbuf, s, h.size), plans.buf_of(recvbuf, r, 1, True)
        self._plan(h, "scatter", sendbuf, recvbuf, root, pa, pb, len(out), len(out))

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        if _ran(self._handle, "all_gather", sendbuf, recvbuf, -1):
            return
        h = self._h()
        self._eng()
        r = parse(recvbuf, True, blocks=h.size)
        s = None
        if sendbuf is IN_PLACE:
            data = r.pack(r.count, r.displ + h.rank * r.count)
            if r.view() is None:
                data = data.copy()
        else:
            s = parse(sendbuf, False)
            data = _bytes(s)
        outs = _blocks(r, h.size, len(data), "recvbuf")
        if h.size == 1:
            outs[0][:] = data
        else:
            _pg(h).all_gather(outs, data)
        _unblock(r, outs, h.size)
        pa, pb = plans.buf_of(sendbuf, s), plans.buf_of(recvbuf, r, h.size, True)
        self._plan(h, "all_gather", sendbuf, recvbuf, -1, pa, pb, len(data), len(data))

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        if _ran(self._handle, "all_to_all", sendbuf, recvbuf, -1):
            return
        h = self._h()
        self._eng()
        r = parse(recvbuf, True, blocks=h.size)
        s = r if sendbuf is IN_PLACE else parse(sendbuf, False, blocks=h.size)
        n = h.size
        ins = [_bytes(s, s.count, s.displ + i * s.count) for i in range(n)]
        if sendbuf is IN_PLACE:  # the outputs overwrite the inputs: send a copy
            ins = [b.copy() for b in ins]
        # every rank sends blocks of one size: the call record carries it (compared
        # across ranks on every path, as a planned call's; a rank sending another size
        # runs a different call: CollectiveMismatchError)
        self._alltoall(h, ins, r, [r.count] * n, [r.displ + i * r.count for i in range(n)], s.nbytes)
        if sendbuf is not IN_PLACE and s.nbytes == r.nbytes:
            pa, pb = plans.buf_of(sendbuf, s, n), plans.buf_of(recvbuf, r, n, True)
            self._plan(h, "all_to_all", sendbuf, recvbuf, -1, pa, pb, s.nbytes, s.nbytes)

    def _alltoall(
        self, h: Handle, ins: list, r: Spec, counts: list[int], displs: list[int], block: int = 0
    ) -> None:
        """Block i of ``ins`` (bytes) to rank i; what rank i sends into ``counts[i]``
        elements of ``r`` at ``displs[i]``: the runtime's all_to_all (views of ``r``
        when its type is contiguous, else through a packed copy). ``block``: the bytes
        of every block of every rank (Alltoall; compared across ranks), or 0 (the
        v-variants: sizes only the sender and receiver know)."""
        self._eng()
        n = h.size
        outs = [_out(_sub(r, counts[i], displs[i])) for i in range(n)]
        if n == 1:
            outs[0][: len(ins[0])] = ins[0]
        else:
            _pg(h).all_to_all(outs, ins, count=block)
        if r.view() is None:
            for i in range(n):
                _sub(r, counts[i], displs[i]).unpack(outs[i])

    # -- v-variants: the runtime's all_to_all with the blocks this operation moves
    # (empty blocks elsewhere), so they take its shared-memory or TCP algorithm

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._h()
        h.global_rank(root, "root")
        n = h.size
        none = _empty(0)
        r = parse(recvbuf, True, vector=True) if h.rank == root else Spec(none, _BYTE, 0)
        counts, displs = _vcounts(r, n) if h.rank == root else ([0] * n, [0] * n)
        if sendbuf is IN_PLACE:
            if h.rank != root:
                raise MPIException(ERR_BUFFER, "IN_PLACE is the root's sendbuf only")
            data = _sub(r, counts[root], displs[root]).pack().copy()
        else:
            data = _bytes(parse(sendbuf, False))
        self._alltoall(h, [data if i == root else none for i in range(n)], r, counts, displs)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        h = self._h()
        h.global_rank(root, "root")
        n = h.size
        none = _empty(0)
        ins = [none] * n
        if h.rank == root:
            s = parse(sendbuf, False, vector=True)
            counts, displs = _vcounts(s, n)
            ins = [_bytes(s, counts[i], displs[i]) for i in range(n)]
        if recvbuf is IN_PLACE:
            if h.rank != root:
                raise MPIException(ERR_BUFFER, "IN_PLACE is the root's recvbuf only")
            ins[root] = none
            r = Spec(none, _BYTE, 0)
        else:
            r = parse(recvbuf, True)
        rc = [r.count if i == root else 0 for i in range(n)]
        self._alltoall(h, ins, r, rc, [r.displ] * n)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._h()
        r = parse(recvbuf, True, vector=True)
        counts, displs = _vcounts(r, h.size)
        if sendbuf is IN_PLACE:
            data = _sub(r, counts[h.rank], displs[h.rank]).pack().copy()
        else:
            data = _bytes(parse(sendbuf, False))
        self._alltoall(h, [data] * h.size, r, counts, displs)

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        h = self._h()
        r = parse(recvbuf, True, vector=True)
        rc, rd = _vcounts(r, h.size)
        s = r if sendbuf is IN_PLACE else parse(sendbuf, False, vector=True)
        sc, sd = _vcounts(s, h.size)
        ins = [_bytes(s, sc[i], sd[i]) for i in range(h.size)]
        if sendbuf is IN_PLACE:
            ins = [b.copy() for b in ins]
        self._alltoall(h, ins, r, rc, rd)

    # -- reductions

    def _reduce(self, sendbuf: Any, recvbuf: Any, op: Op, root: int | None) -> None:
        h = self._h()
        self._eng()
        g = None if root is None else h.global_rank(root, "root")
        mine = root is None or h.rank == root
        r = parse(recvbuf, True) if mine else None
        if sendbuf is IN_PLACE:
            if r is None:
                raise MPIException(ERR_BUFFER, "IN_PLACE is the root's sendbuf only")
            s = r
        else:
            s = parse(sendbuf, False)
        t = s.datatype
        native = op.native_for(t)
        if native is not None and t.contiguous and t.dtype is not None:
            rv = r.view() if r is not None else None
            if r is not None and rv is not None and r.datatype is t:
                work = rv[: s.nbytes].view(t.dtype)
                if s is not r:
                    work[:] = s.pack().view(t.dtype)
            else:
                work = s.pack().view(t.dtype).copy()
            if h.size > 1:
                if root is None:
                    dist.all_reduce(work, op=native, group=h.pg)
                else:
                    dist.reduce(work, dst=g, op=native, group=h.pg)
            if r is not None and not (rv is not None and np.shares_memory(work, r.raw)):
                r.unpack(work.view(np.uint8))
            return
        parts = self._gather_bytes(h, np.ascontiguousarray(s.pack()).copy(), root)
        if r is not None and parts is not None:
            r.unpack(self._fold(parts, op, t))

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM, root: int = 0) -> None:
        self._reduce(sendbuf, recvbuf, op, root)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        self._reduce(sendbuf, recvbuf, op, None)

    def _scan(self, sendbuf: Any, recvbuf: Any, op: Op, exclusive: bool) -> None:
        h = self._h()
        self._eng()
        r = parse(recvbuf, True)
        s = r if sendbuf is IN_PLACE else parse(sendbuf, False)
        parts = self._gather_bytes(h, np.ascontiguousarray(s.pack()).copy(), None)
        assert parts is not None
        upto = h.rank if exclusive else h.rank + 1
        if upto:
            r.unpack(self._fold(parts[:upto], op, s.datatype))

    def Scan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        self._scan(sendbuf, recvbuf, op, False)

    def Exscan(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        """recvbuf on rank 0 is left unchanged (MPI leaves it undefined)."""
        self._scan(sendbuf, recvbuf, op, True)

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Op = SUM) -> None:
        h = self._h()
        r = parse(recvbuf, True)
        self._reduce_scatter(sendbuf, r, [r.count] * h.size, op)

    def Reduce_scatter(self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Op = SUM) -> None:
        h = self._h()
        r = parse(recvbuf, True)
        counts = [r.count] * h.size if recvcounts is None else [int(c) for c in recvcounts]
        self._reduce_scatter(sendbuf, r, counts, op)

    def _reduce_scatter(self, sendbuf: Any, r: Spec, counts: list[int], op: Op) -> None:
        h = self._h()
        total, t = sum(counts), r.datatype
        if sendbuf is IN_PLACE:
            full = r.pack(total, r.displ).copy()
        else:
            full = np.ascontiguousarray(parse(sendbuf, False).pack()).copy()
        whole = Spec(full, _contiguous(t), total)
        self._reduce(IN_PLACE, [full, total, whole.datatype], op, None)
        start = sum(counts[: h.rank]) * whole.datatype.size
        r.unpack(full[start : start + counts[h.rank] * whole.datatype.size])

    # -- communicator constructors (collective over this communicator)

    def _make(self, members: list[int] | None, ctx: int, name: str = "") -> Intracomm:
        if members is None:
            return _null()
        h = self._h()
        rt = STATE.runtime()
        return type(self)._wrap(_new_handle(rt, [h.ranks[i] for i in members], ctx, name))

    @classmethod
    def _wrap(cls, handle: Handle) -> Intracomm:
        c = cls.__new__(cls)
        c._handle, c._lazy = handle, None
        return c

    def _ctx_ids(self, n: int) -> int:
        rt = STATE.runtime()
        return int(self.bcast(_alloc_ctx(rt, n) if self.rank == 0 else None, root=0))

    def Split(self, color: int = 0, key: int = 0) -> Intracomm:
        """Ranks of one ``color`` form a communicator, ordered by (``key``, rank); color
        UNDEFINED gets COMM_NULL."""
        h = self._h()
        pairs = self.allgather((int(color), int(key)))
        colors = sorted({c for c, _ in pairs if c != UNDEFINED})
        base = self._ctx_ids(max(1, len(colors)))
        if color == UNDEFINED:
            return self._make(None, 0)
        members = sorted((i for i in range(h.size) if pairs[i][0] == color), key=lambda i: (pairs[i][1], i))
        return self._make(members, base + colors.index(int(color)))

    def Split_type(self, split_type: int, key: int = 0, info: Any = None) -> Intracomm:
        """COMM_TYPE_SHARED: the ranks of this node (by the launcher's node id)."""
        if split_type != COMM_TYPE_SHARED:
            return self.Split(UNDEFINED, key)
        rt = STATE.runtime()
        nodes = self.allgather(rt.node_id)
        return self.Split(nodes.index(rt.node_id), key)

    def Dup(self, info: Any = None) -> Intracomm:
        h = self._h()
        dup = self.Split(0, h.rank)
        dup._h().attrs.update(h.attrs)
        return dup

    Clone = Dup
    Idup = Dup

    def Create(self, group: Group) -> Intracomm:
        """The members of ``group`` (a subset of this communicator) form a communicator;
        COMM_NULL elsewhere."""
        h = self._h()
        base = self._ctx_ids(1)
        if STATE.runtime().rank not in group.ranks:
            return self._make(None, 0)
        return self._make([h.index[g] for g in group.ranks], base)

    Create_group = Create


def _vcounts(s: Spec, n: int) -> tuple[list[int], list[int]]:
    if s.counts is None:
        counts = [s.count // n if s.count and s.counts is None else 0] * n
        return counts, [i * counts[0] for i in range(n)]
    if len(s.counts) != n or s.displs is None or len(s.displs) != n:
        raise MPIException(
            ERR_BUFFER, f"counts {s.counts} and displacements {s.displs} must have {n} entries"
        )
    return s.counts, s.displs


def _contiguous(t: Datatype) -> Datatype:
    """A type of ``t``'s packed data (t itself when contiguous)."""
    if t.contiguous:
        return t
    d = Datatype("packed", np.arange(t.size), t.size, base=t.base)
    d.dtype = None
    return d


def _null() -> Intracomm:
    c = Intracomm.__new__(Intracomm)
    c._handle, c._lazy = None, None
    return c


COMM_WORLD = _lazy(Intracomm, "world")
COMM_SELF = _lazy(Intracomm, "self")
COMM_NULL = _null()
__all__ = ["Intracomm", "COMM_WORLD", "COMM_SELF", "COMM_NULL", "Request"]
