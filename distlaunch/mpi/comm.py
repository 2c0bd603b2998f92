"""Communicators (mpi4py's Comm/Intracomm), groups, and the process-wide MPI state.

A communicator is a :class:`Handle` (shared by every Python object wrapping it, as an
MPI handle is: ``Intracomm(comm)`` and subclasses wrap the same one): its members'
global ranks in communicator-rank order, a collectives ProcessGroup (the world's for
COMM_WORLD) for the native collectives, and a context id separating its point-to-point
messages from every other communicator's. Communicator creation (Dup, Split,
Split_type, Create) is collective over the parent, as in MPI; context ids come from
one counter in the job's store (``<ns>mpi/ctx``), so two communicators that share a
member never share an id, and they are also the new ProcessGroup's id.

Collectives: Bcast, Gather, Scatter, Allgather, Alltoall, Barrier and the predefined
reductions on contiguous predefined types run as the collectives' native operations
(shared memory on one node) on views of the caller's buffers (a contiguous datatype's
count is honoured without a copy; other types are packed; a call repeated with the same
buffer specification objects reuses a plan kept on the communicator, see
:mod:`.plans`); the v-variants run as the
runtime's all_to_all with the blocks they move (empty blocks elsewhere); lowercase
alltoall and internal exchanges go over point-to-point in the communicator's
collective context; reductions the
collectives lack (MINLOC/MAXLOC, user ops, derived types, Scan/Exscan) fold the
gathered contributions in rank order.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import collectives as dist
from ..collectives.group import ProcessGroup
from .datatypes import _SPEC, UNDEFINED, Spec, fast_bytes, parse
from .errors import ERR_COMM, ERR_RANK, MPIException
from .p2p import (
    ANY_SOURCE,
    ANY_TAG,
    PROC_NULL,
    SENT,
    DirectRecv,
    DoneOp,
    Engine,
    Message,
    Prequest,
    RecvOp,
    Request,
    SendOp,
    Status,
    _new,
    _text,
    request_of,
    truncated,
)

IN_PLACE: Any = type("InPlace", (), {"__repr__": lambda self: "<MPI.IN_PLACE>"})()
BOTTOM: Any = None
TAG_UB_VALUE = 536870911  # MPICH's MPI_TAG_UB
_CTX_BASE = 0x40000000  # context ids of new communicators (the collectives' own gids stay below)
_COLL = 0x80000000  # added to a context id: the communicator's collective context
COMM_TYPE_SHARED = 1
IDENT, CONGRUENT, SIMILAR, UNEQUAL = 0, 1, 2, 3
# attribute keys (Get_attr)
TAG_UB, HOST, IO, WTIME_IS_GLOBAL, UNIVERSE_SIZE, APPNUM, LASTUSEDCODE = range(1, 8)


class _State:
    """The process's MPI state: the engine (after the first use) and Finalize."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engine: Engine | None = None
        self.finalized = False
        self.world: Handle | None = None
        self.self_: Handle | None = None
        self.rtmod: Any = None  # distlaunch.collectives.runtime, once imported

    def runtime(self) -> Any:
        from ..collectives import runtime as rtmod  # noqa: PLC0415  (not at import: stays light)

        with self.lock:
            if self.finalized:
                raise MPIException(ERR_COMM, "MPI was finalized; no MPI call may follow MPI.Finalize()")
            if not dist.is_initialized():
                dist.init_process_group()
            rt = rtmod.current_runtime()
            if self.engine is None or self.engine.rt is not rt:
                self.engine = Engine(rt)
            self.rtmod = rtmod
            return rt

    def live(self) -> Engine | None:
        """The engine when it serves the current runtime and MPI is not finalized (the
        cheap check of the point-to-point fast paths), else None (call :meth:`runtime`)."""
        eng = self.engine
        if eng is not None and not self.finalized and eng.rt is self.rtmod._runtime:
            return eng
        return None


STATE = _State()


def _pickle(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _unpickle(data: memoryview) -> Any:
    return pickle.loads(data)


class Handle:
    """A communicator's identity; see the module docstring."""

    def __init__(self, pg: ProcessGroup | None, ranks: list[int], ctx: int, name: str, rank: int) -> None:
        self.pg = pg  # None: the world (group=None in collectives calls)
        self.ranks = ranks
        self.index = {g: i for i, g in enumerate(ranks)}
        self.rank = self.index[rank]
        self.size = len(ranks)
        self.ctx, self.cctx = ctx, ctx + _COLL
        self.name = name
        self.attrs: dict[int, Any] = {}
        self.freed = False
        self.plans: dict[tuple, Any] = {}  # repeated buffer collectives (see .plans)
        # the last Isend/Send's and Irecv's peer, tag (and size) and what they resolved
        # to: a window passes the same ones again (see Comm._send_key, Comm._recv_key)
        self.last_send: tuple = _NO_LAST
        self.last_recv: tuple = _NO_LAST

    def global_rank(self, rank: int, what: str = "rank") -> int:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.size:
            raise MPIException(
                ERR_RANK,
                f"{what}={rank!r} is not a rank of {self.name or 'the communicator'} (0..{self.size - 1})",
            )
        return self.ranks[rank]


_NO_LAST = (None, None, None, None, None)


def _new_handle(rt: Any, ranks: list[int], ctx: int, name: str = "") -> Handle:
    """A communicator of ``ranks`` (global, communicator order) with context id ``ctx``
    (also its ProcessGroup's id)."""
    pg = rt.new_group_with_id(ranks, ctx, name=f"communicator {ctx - _CTX_BASE} {ranks}")
    return Handle(pg, ranks, ctx, name, rt.rank)


def _alloc_ctx(rt: Any, n: int) -> int:
    """Reserve ``n`` new context ids from the job's store; returns the first."""
    return _CTX_BASE + rt.store.add(f"{rt.prefix}mpi/ctx", n) - n


class Group:
    """MPI_Group: an ordered set of global ranks."""

    def __init__(self, ranks: Sequence[int] = (), me: int = -1) -> None:
        self.ranks, self._me = list(ranks), me

    def Get_size(self) -> int:
        return len(self.ranks)

    def Get_rank(self) -> int:
        return self.ranks.index(self._me) if self._me in self.ranks else UNDEFINED

    size = property(Get_size)
    rank = property(Get_rank)

    def Incl(self, ranks: Sequence[int]) -> Group:
        return Group([self.ranks[r] for r in ranks], self._me)

    def Excl(self, ranks: Sequence[int]) -> Group:
        drop = set(ranks)
        return Group([g for i, g in enumerate(self.ranks) if i not in drop], self._me)

    def Range_incl(self, ranges: Sequence[tuple[int, int, int]]) -> Group:
        return self.Incl([r for a, b, s in ranges for r in range(a, b + (1 if s > 0 else -1), s)])

    def Translate_ranks(self, ranks: Sequence[int] | None = None, group: Group | None = None) -> list[int]:
        ranks = range(len(self.ranks)) if ranks is None else ranks
        other = group.ranks if group is not None else self.ranks
        return [other.index(self.ranks[r]) if self.ranks[r] in other else UNDEFINED for r in ranks]

    @classmethod
    def Union(cls, a: Group, b: Group) -> Group:
        return cls(a.ranks + [g for g in b.ranks if g not in a.ranks], a._me)

    @classmethod
    def Intersection(cls, a: Group, b: Group) -> Group:
        return cls([g for g in a.ranks if g in b.ranks], a._me)

    @classmethod
    def Difference(cls, a: Group, b: Group) -> Group:
        return cls([g for g in a.ranks if g not in b.ranks], a._me)

    def Compare(self, other: Group) -> int:
        if self.ranks == other.ranks:
            return IDENT
        return SIMILAR if sorted(self.ranks) == sorted(other.ranks) else UNEQUAL

    def Free(self) -> None:
        pass


GROUP_EMPTY = Group()


class Comm:
    """mpi4py's Comm: point-to-point and communicator management. ``Comm(comm)`` wraps
    the same communicator as ``comm``; ``Comm()`` is COMM_NULL. Every blocking call
    waits at most the group timeout (CollectiveTimeoutError) and raises PeerLostError
    when a peer it waits for died; argument errors raise MPIException."""

    _handle: Handle | None
    _lazy: str | None = None  # "world" / "self": resolved at first use

    def __init__(self, comm: Comm | None = None) -> None:
        self._handle = comm._h() if comm is not None and comm._handle_or_lazy() else None
        self._lazy = None

    def _handle_or_lazy(self) -> bool:
        return self._handle is not None or self._lazy is not None

    def _h(self) -> Handle:
        h = self._handle
        if h is None:
            if self._lazy is None:
                raise MPIException(ERR_COMM, "invalid communicator (COMM_NULL or freed)")
            h = self._handle = _predefined(self._lazy)
        return h

    def _eng(self) -> Engine:
        eng = STATE.live()
        if eng is None:
            STATE.runtime()
            eng = STATE.engine
            assert eng is not None
        return eng

    def _ident(self) -> Any:
        h = self._handle
        if self._lazy is not None or (h is not None and h in (STATE.world, STATE.self_)):
            return self._lazy or ("world" if h is STATE.world else "self")
        return h

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Comm):
            return NotImplemented
        return self._ident() is other._ident() or self._ident() == other._ident()

    def __hash__(self) -> int:
        return hash(id(self._ident()) if not isinstance(self._ident(), str) else self._ident())

    def __bool__(self) -> bool:
        return self._handle_or_lazy()

    # -- size, rank, names, attributes

    def Get_rank(self) -> int:
        return self._h().rank

    def Get_size(self) -> int:
        return self._h().size

    rank = property(Get_rank)
    size = property(Get_size)

    def Get_name(self) -> str:
        return self._h().name

    def Set_name(self, name: str) -> None:
        self._h().name = name

    name = property(Get_name, Set_name)

    def Get_group(self) -> Group:
        STATE.runtime()
        return Group(self._h().ranks, self._eng().rank)

    group = property(Get_group)

    def Is_inter(self) -> bool:
        return False

    def Is_intra(self) -> bool:
        return True

    is_inter = property(Is_inter)
    is_intra = property(Is_intra)

    def Get_attr(self, keyval: int) -> Any:
        """TAG_UB, UNIVERSE_SIZE, APPNUM, WTIME_IS_GLOBAL, HOST, IO, or a value Set_attr stored."""
        h = self._h()
        fixed = {TAG_UB: TAG_UB_VALUE, WTIME_IS_GLOBAL: False, HOST: PROC_NULL, IO: ANY_SOURCE}
        if keyval in fixed:
            return fixed[keyval]
        if keyval == UNIVERSE_SIZE:
            return self._eng().rt.world_size
        if keyval == APPNUM:
            return 0
        return h.attrs.get(keyval)

    def Set_attr(self, keyval: int, value: Any) -> None:
        self._h().attrs[keyval] = value

    def Delete_attr(self, keyval: int) -> None:
        self._h().attrs.pop(keyval, None)

    def Compare(self, other: Comm) -> int:
        a, b = self._h(), other._h()
        if a is b:
            return IDENT
        if a.ranks == b.ranks:
            return CONGRUENT
        return SIMILAR if sorted(a.ranks) == sorted(b.ranks) else UNEQUAL

    def Abort(self, errorcode: int = 0) -> None:
        """End the whole job with exit code ``errorcode`` (MPI_Abort): this process
        exits with it at once; the launcher stops the other ranks (as mpiexec does)."""
        rank = os.environ.get("RANK", "0")
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        sys.stderr.write(
            f"Abort({errorcode}) on rank {rank}: application called MPI_Abort(comm, {errorcode})\n"
        )
        sys.stderr.flush()
        os._exit(errorcode & 0xFF if errorcode & 0xFF else 1 if errorcode else 0)

    # -- point to point: internals

    def _peer(self, h: Handle, rank: int, what: str) -> int | None:
        """Global rank of ``rank`` (None for PROC_NULL; ANY_SOURCE -> -2 is the caller's)."""
        if rank == PROC_NULL:
            return None
        return h.global_rank(rank, what)

    def _isend(self, data: np.ndarray | memoryview, dest: int, tag: int, ctx: int | None = None) -> Request:
        h = self._h()
        eng = self._eng()
        g = self._peer(h, dest, "dest")
        if g is None:
            return Request(op=DoneOp(), engine=eng)
        if tag < 0 and ctx is None:
            raise MPIException(4, f"tag={tag} must be >= 0 (MPI.ANY_TAG is for receives)")
        req = eng.send(g, h.ctx if ctx is None else ctx, tag, data)
        return Request(op=SendOp(req, ("send to rank {} (tag {})", dest, tag), g), engine=eng)

    def _irecv(
        self, spec: Spec | memoryview | None, source: int, tag: int, ctx: int | None = None
    ) -> Request:
        h = self._h()
        eng = self._eng()
        if source == PROC_NULL:
            return Request(op=DoneOp(PROC_NULL, None), engine=eng)
        src = None if source == ANY_SOURCE else h.global_rank(source, "source")
        op = RecvOp(
            eng,
            h.ctx if ctx is None else ctx,
            src,
            tag,
            spec,
            h.index.__getitem__,
            None if spec is not None else _unpickle,
            _recv_what(src, source, tag),
        )
        return request_of(op, eng)

    # -- point to point: buffers

    @staticmethod
    def _send_key(eng: Engine, h: Handle, dest: Any, tag: Any, n: int) -> tuple:
        """``h.last_send`` for a send of ``n`` bytes to ``dest`` with ``tag``: (dest, tag,
        n, eng, the engine's putter -- :meth:`Engine.put`'s, False for oneself or a
        remote peer --); the putter None when ``dest`` or ``tag`` is not valid (the
        general way says why). The ``is`` comparisons of the next call's arguments
        with these prove them valid without checking them again."""
        if type(dest) is not int or not 0 <= dest < h.size or type(tag) is not int or tag < 0:
            return (dest, tag, n, eng, None)
        key = (h.ranks[dest], h.ctx, tag, n)
        c = h.last_send = (dest, tag, n, eng, eng._puts.get(key) or eng._put_key(*key))
        return c

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` (a buffer specification); Wait before changing it."""
        # STATE.live() and fast_bytes' look at its last [buf, count, type] inline, as
        # in Irecv: in an osu_bw window each call is ~5 % of an Isend
        st, h = STATE, self._handle
        eng = st.engine
        if eng is not None and h is not None and eng.rt is st.rtmod._runtime and not st.finalized:
            data = None
            if type(buf) is list and len(buf) == 3:
                b, count, t = buf
                s = _SPEC[0]
                if s[0] is b and s[1] is count and s[2] is t:
                    data = s[3]
            if data is None:
                data = fast_bytes(buf, False)
            if data is not None:
                c = h.last_send
                if c[0] is not dest or c[1] is not tag or c[2] != len(data) or c[3] is not eng:
                    c = self._send_key(eng, h, dest, tag, len(data))
                put = c[4]
                if put is not None:
                    if put(data):  # written whole: already complete
                        r = _new(Request)  # request_of, inline (one call less a message)
                        r._op, r._engine = SENT, eng
                        return r
                    return self._isend(data, dest, tag)
        return self._isend(parse(buf, False).pack(), dest, tag)

    Issend = Ibsend = Irsend = Isend

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Send ``buf``; returns once it may be reused (eager: does not wait for the
        receive, so Ssend/Bsend/Rsend are the same call)."""
        eng, h = STATE.live(), self._handle
        if eng is not None and h is not None:
            data = fast_bytes(buf, False)
            if data is not None:  # the common case, without Request and Spec objects
                c = h.last_send
                if c[0] is not dest or c[1] is not tag or c[2] != len(data) or c[3] is not eng:
                    c = self._send_key(eng, h, dest, tag, len(data))
                put = c[4]
                if put is not None:
                    if not put(data):  # else: written whole into the ring
                        what = ("send to rank {} (tag {})", dest, tag)
                        eng.send_now(h.ranks[dest], h.ctx, tag, data, what)
                    return
        self.Isend(buf, dest, tag).Wait()

    Ssend = Bsend = Rsend = Send

    @staticmethod
    def _recv_key(eng: Engine, h: Handle, source: Any, tag: Any) -> tuple:
        """``h.last_recv`` for a receive from ``source`` with ``tag``: (source, tag, eng,
        what :meth:`Irecv` and :meth:`Engine.take_now` need -- context id, global
        source, ...: :meth:`Engine._take_key` --, or None when they cannot take a
        receive: any source, a remote peer, oneself, arguments the general way refuses)."""
        got = None
        if type(tag) is int and type(source) is int and 0 <= source < h.size:
            g = h.ranks[source]
            got = eng._takes.get((g, h.ctx, tag)) or eng._take_key(g, h.ctx, tag) or None
        c = h.last_recv = (source, tag, eng, got)
        return c

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving into ``buf`` (a buffer specification); Wait before using it.

        From a rank on this node (a contiguous buffer) the receive is only posted --
        nothing is taken from the ring here -- as one :class:`DirectRecv` (its own op)
        and its Request, both made without ``__init__``, and its Wait/Waitall takes a
        window's messages as one run (:meth:`Engine.serve`). A kept message that may
        match first, or a failed engine, takes the general way."""
        # STATE.live(), fast_bytes' look at its last [buf, count, type] and the posting
        # (once Engine.irecv) inline: three calls of an osu_bw window's ~1 µs Irecv
        st, h = STATE, self._handle
        eng = st.engine
        data = None
        if eng is not None and h is not None and eng.rt is st.rtmod._runtime and not st.finalized:
            if type(buf) is list and len(buf) == 3:
                b, count, t = buf
                s = _SPEC[1]
                if s[0] is b and s[1] is count and s[2] is t and b.flags.writeable:
                    data = s[3]
            if data is None:
                data = fast_bytes(buf, True)
            if data is not None:
                c = h.last_recv
                if c[0] is not source or c[1] is not tag or c[2] is not eng:
                    c = self._recv_key(eng, h, source, tag)
                got = c[3]
                if got is not None:  # a peer on this node: posted only
                    p = _new(DirectRecv)
                    p.ctx, p.src, p.expect, _ = got
                    p.tag, p.direct, p.source, p.engine = tag, data, source, eng
                    p.deliver = p.msg = p.error = None
                    # (what the pump holds comes from remote ranks: it cannot match this)
                    eng._acquire()
                    try:
                        ok = not eng.inbox and eng.error is None
                        if ok:
                            eng.posted.append(p)
                    finally:
                        eng._release()
                    if ok:
                        r = _new(Request)
                        r._op, r._engine = p, eng
                        return r
        else:
            data = fast_bytes(buf, True)
        return self._irecv(parse(buf, True) if data is None else data, source, tag)

    def Recv(
        self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> None:
        """Receive into ``buf`` (the message may be shorter: see ``status.Get_count``;
        a longer one raises MPIException ERR_TRUNCATE)."""
        eng, h = STATE.live(), self._handle
        data = fast_bytes(buf, True)
        if data is not None and eng is not None and h is not None:  # the common case, no Request
            c = h.last_recv
            if c[0] is not source or c[1] is not tag or c[2] is not eng:
                c = self._recv_key(eng, h, source, tag)
            f = () if c[3] is None else eng.take_now(c[3], data)
            if f:  # taken straight from the peer's ring
                if status is not None:
                    status._set(source, f[0], f[1])
                return
            if type(tag) is int and (source == ANY_SOURCE or type(source) is int and 0 <= source < h.size):
                src = None if source == ANY_SOURCE else h.ranks[source]
                what = _recv_what(src, source, tag)
                g, got_tag, n = eng.recv_now(h.ctx, src, tag, data, what, f is None)
                if n > len(data):
                    raise truncated(_text(what), n, h.index[g], got_tag, len(data))
                if status is not None:
                    status._set(h.index[g], got_tag, n)
                return
        self.Irecv(buf, source, tag).Wait(status)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        r = self.Irecv(recvbuf, source, recvtag)
        s = self.Isend(sendbuf, dest, sendtag)
        r.Wait(status)
        s.Wait()

    def Sendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        data = parse(buf, False).pack().copy()
        r = self.Irecv(buf, source, recvtag)
        s = self._isend(data, dest, sendtag)
        r.Wait(status)
        s.Wait()

    # -- point to point: persistent requests (MPI_Send_init, MPI_Recv_init)

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        """A persistent send of ``buf`` to ``dest``: each Start sends the buffer's current
        contents as Isend would (Bsend/Ssend/Rsend_init: the same, see Send)."""
        self._h()  # COMM_NULL fails here, not at Start
        return Prequest(start=lambda: self.Isend(buf, dest, tag))

    Bsend_init = Ssend_init = Rsend_init = Send_init

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:
        """A persistent receive into ``buf``: each Start posts it as Irecv would."""
        self._h()
        return Prequest(start=lambda: self.Irecv(buf, source, tag))

    # -- point to point: Python objects

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        return self._isend(_pickle(obj), dest, tag)

    issend = ibsend = isend

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.isend(obj, dest, tag).Wait()

    ssend = bsend = send

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Start receiving an object; ``wait()`` returns it (``buf`` is ignored)."""
        return self._irecv(None, source, tag)

    def recv(
        self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        return self.irecv(buf, source, tag).wait(status)

    def sendrecv(
        self,
        sendobj: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        r = self.irecv(None, source, recvtag)
        s = self.isend(sendobj, dest, sendtag)
        obj = r.wait(status)
        s.Wait()
        return obj

    # -- probing

    def _probe(self, source: int, tag: int) -> tuple[Handle, Engine, int | None]:
        h = self._h()
        src = None if source == ANY_SOURCE else h.global_rank(source, "source")
        return h, self._eng(), src

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        """True when a matching message can be received now (it stays unreceived)."""
        if source == PROC_NULL:
            if status is not None:
                status._set(PROC_NULL, ANY_TAG, 0)
            return True
        h, eng, src = self._probe(source, tag)
        m = eng.probe(h.ctx, src, tag)
        if m is not None and status is not None:
            status._set(h.index[m.src], m.tag, len(m.data))
        return m is not None

    iprobe = Iprobe

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None) -> bool:
        """Block until a matching message can be received; ``status`` describes it."""
        self._mprobe(source, tag, status, take=False)
        return True

    probe = Probe

    def _mprobe(self, source: int, tag: int, status: Status | None, take: bool) -> Message | None:
        if source == PROC_NULL:
            if status is not None:
                status._set(PROC_NULL, ANY_TAG, 0)
            return None
        h, eng, src = self._probe(source, tag)
        found: list[Message] = []

        def hit() -> bool:
            for m in eng.inbox:
                if m.matches(h.ctx, src, tag):
                    found.append(m)
                    return True
            return False

        eng.wait_until(hit, f"probe for rank {source} (tag {tag})", [src])
        m = found[0]
        if take:
            eng.take(m)
        if status is not None:
            status._set(h.index[m.src], m.tag, len(m.data))
        return m

    def Mprobe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> MatchedMessage:
        return MatchedMessage(self._mprobe(source, tag, status, take=True))

    mprobe = Mprobe

    def Improbe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> MatchedMessage | None:
        if not self.Iprobe(source, tag, status):
            return None
        return self.Mprobe(source, tag, status)

    improbe = Improbe

    # -- communicators

    def Free(self) -> None:
        h = self._h()
        if h.pg is None or h is STATE.world or h is STATE.self_:
            raise MPIException(ERR_COMM, "COMM_WORLD and COMM_SELF cannot be freed")
        h.freed = True
        h.plans.clear()
        dist.destroy_process_group(h.pg)
        self._handle = None

    def Disconnect(self) -> None:
        self.Free()

    def Spawn(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("MPI dynamic processes (Comm.Spawn) are not supported by distlaunch.mpi")

    Get_parent = Connect = Accept = Spawn_multiple = Spawn

    def Create_intercomm(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "MPI intercommunicators (Create_intercomm) are not supported by distlaunch.mpi"
        )

    def Get_topology(self) -> int:
        return UNDEFINED

    # -- environment

    def Barrier(self) -> None:
        h = self._h()
        self._eng()
        if h.size > 1:
            dist.barrier(group=h.pg)

    barrier = Barrier


class MatchedMessage:
    """A message taken by Mprobe (mpi4py's MPI.Message): receive it with Recv/recv."""

    def __init__(self, msg: Message | None) -> None:
        self._msg = msg

    def Recv(self, buf: Any, status: Status | None = None) -> None:
        m = self._msg
        if m is not None:
            parse(buf, True).unpack(m.data)
        if status is not None:
            status._set(
                PROC_NULL if m is None else status.source,
                ANY_TAG if m is None else m.tag,
                len(m.data) if m else 0,
            )
        self._msg = None

    def recv(self, status: Status | None = None) -> Any:
        m, self._msg = self._msg, None
        return None if m is None else _unpickle(m.data)


def _recv_what(src: int | None, source: int, tag: int) -> tuple:
    """A receive's name in error messages (see p2p.What)."""
    if src is None:
        return ("receive from any rank (tag {})", tag)
    return ("receive from rank {} (tag {})", source, tag)


def _predefined(which: str) -> Handle:
    rt = STATE.runtime()
    with STATE.lock:
        if which == "world":
            if STATE.world is None or STATE.world.pg is not None and STATE.world.pg.runtime is not rt:
                STATE.world = Handle(None, list(range(rt.world_size)), 0, "MPI_COMM_WORLD", rt.rank)
            return STATE.world
        if STATE.self_ is None:
            STATE.self_ = _new_handle(rt, [rt.rank], _alloc_ctx(rt, 1), "MPI_COMM_SELF")
        return STATE.self_


def _lazy(cls: type[Comm], which: str) -> Comm:
    c = cls.__new__(cls)
    c._handle, c._lazy = None, which
    return c
