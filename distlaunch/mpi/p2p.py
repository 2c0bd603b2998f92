"""MPI point-to-point: message matching, Status and Request.

Every MPI message (any communicator, any tag) travels as one transport message of the
key ``(P2P, MPI_GROUP, 0)``; its header carries the communicator's context id
(``step``) and the MPI tag (``root``). One :class:`Engine` per process keeps one
receive of any size posted on that key (the *pump*) and matches what arrives as MPI
does: against the posted receives in posting order, else kept, in arrival order, for
a later receive or probe. So ``ANY_SOURCE``/``ANY_TAG`` match anything, messages of one
sender and communicator are received in the order sent (MPI's non-overtaking rule),
a receive buffer may be larger than the message (Status tells the count) and Probe
sees a message before it is received.

Peers on this node are reached over shared memory (:mod:`distlaunch.collectives.transport.shm_p2p`)
instead: the links route every arriving MPI message to :meth:`Engine._local_route`,
which matches it at once, so its payload is copied from the ring straight into the
posted receive's buffer when one matches (contiguous datatypes), else kept.

Sends are eager: a send completes when its data was handed to the transport (TCP: the
operating system, shared memory: the peer's ring; a large message streams through the
ring while this process waits or tests), so Ssend/Rsend/Bsend behave as Send. A send to
oneself is copied straight into the engine.

Send and Recv of contiguous buffers (every buffer type as one flat byte view, see
:func:`~.datatypes.fast_bytes`) skip the Request, Spec and Message objects:
:meth:`Engine.send_now` writes a message that fits the peer's ring at once, and
:meth:`Engine.recv_now` -- while no other receive is posted and no message kept, so the
matching order cannot differ -- takes it straight from the sender's ring into the buffer
(:meth:`Engine.take_now`, :meth:`ShmLinks.take_prefix`); anything else goes the general
way. Isend does the same without waiting and returns an already complete Request
(:meth:`ShmLinks.putter`: the message is published at once, MPI's progress rule). Irecv
from a peer on this node only posts the receive (``Comm.Irecv``: one object, its own
op); posted receives are served straight from the ring, in posting order, while the
first posted one is what the next message of its sender matches (:meth:`Engine.serve`,
:meth:`ShmLinks.take_run`: a window's run under one lock with one tail publication, in
Waitall/Wait), else routed (Test, probes, other waits).

Blocking waits poll the pump and the shared-memory links (a bounded busy-poll unless the
node's ranks share CPUs, then yields and futex sleeps on the links' bell; slices on the
pump without links) so that they notice a lost peer (its connection ended or its process
on this node is gone: PeerLostError) and the group timeout (default 1800 s:
CollectiveTimeoutError).
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

from .. import progress as marks
from ..collectives.errors import CollectiveError, CollectiveTimeoutError, PeerLostError
from ..collectives.transport import Request as TransportRequest
from ..collectives.transport.shm_p2p import links_for
from ..collectives.wire import HEADER, MAGIC, NO_REDOP, OP_CODES, P2P, Header
from .datatypes import BYTE, UNDEFINED, Datatype, Spec
from .errors import ERR_REQUEST, ERR_TRUNCATE, SUCCESS, MPIException

ANY_SOURCE = -2  # MPICH's values
ANY_TAG = -1
PROC_NULL = -1
MPI_GROUP = 0xFFFFFFFF  # transport group id of every MPI message (no ProcessGroup has it)
_KEY = (P2P, MPI_GROUP, 0)
_SEND = OP_CODES["send"]
# makes an object without calling its class (and __init__): the per-message objects
# (a class call costs ~0.25 µs more than setting the attributes here)
_new = object.__new__
# HEADER (wire.py) after its first 24 bytes: step (context id), root (tag), count, nbytes
_HEAD_REST = struct.Struct("<24sIiQQ")


class Status:
    """MPI_Status: ``source``, ``tag``, ``error`` and the received byte count."""

    __slots__ = ("source", "tag", "error", "nbytes", "cancelled")

    def __init__(self, status: Status | None = None) -> None:
        self.source, self.tag, self.error, self.nbytes, self.cancelled = (
            ANY_SOURCE,
            ANY_TAG,
            SUCCESS,
            0,
            False,
        )
        if status is not None:
            self.source, self.tag, self.error, self.nbytes = (
                status.source,
                status.tag,
                status.error,
                status.nbytes,
            )

    def Get_source(self) -> int:
        return self.source

    def Get_tag(self) -> int:
        return self.tag

    def Get_error(self) -> int:
        return self.error

    def Set_source(self, source: int) -> None:
        self.source = source

    def Set_tag(self, tag: int) -> None:
        self.tag = tag

    def Set_error(self, error: int) -> None:
        self.error = error

    def Get_count(self, datatype: Datatype = BYTE) -> int:
        """Elements of ``datatype`` received (UNDEFINED when the bytes do not divide)."""
        size = datatype.Get_size()
        if not size:
            return 0
        return self.nbytes // size if self.nbytes % size == 0 else UNDEFINED

    def Get_elements(self, datatype: Datatype) -> int:
        return self.Get_count(datatype)

    def Is_cancelled(self) -> bool:
        return self.cancelled

    count = property(lambda self: self.Get_count())

    def _set(self, source: int, tag: int, nbytes: int, cancelled: bool = False) -> None:
        self.source, self.tag, self.nbytes, self.error = source, tag, nbytes, SUCCESS
        self.cancelled = cancelled


class Message:
    """One arrived message: global ``src``, context id ``ctx``, ``tag``, payload bytes
    (a byte memoryview or uint8 array)."""

    __slots__ = ("src", "ctx", "tag", "data")

    def __init__(self, src: int, ctx: int, tag: int, data: Any) -> None:
        self.src, self.ctx, self.tag, self.data = src, ctx, tag, data

    def matches(self, ctx: int, src: int | None, tag: int) -> bool:
        return ctx == self.ctx and (src is None or src == self.src) and (tag == ANY_TAG or tag == self.tag)


# a posted receive's ``msg`` once served straight from the ring (PostedRecv.message)
SERVED = Message(-1, -1, ANY_TAG, b"")


class PostedRecv(Message):
    """A receive waiting for its message: ``src`` (global, None: any), ``tag``,
    ``deliver(msg)`` that consumes the message (called with the engine lock held; None:
    the message is copied into ``direct`` when it fits, the receive reports a longer
    one), and ``direct``: the contiguous receive buffer (uint8 array or byte
    memoryview) a message may be copied into instead (then ``deliver`` is skipped), or
    None. ``msg`` is set once the message is in place (``error`` once it failed).
    ``expect``: for a ``direct`` receive from one rank, the packed header start its
    message begins with (:meth:`Engine.serve` may copy it straight from the ring).
    Served so, the receive is its own message record (``msg`` is :data:`SERVED`,
    :meth:`message` is itself: ``tag`` the message's, ``data`` the filled part of
    ``direct``): no Message is made (and no reference cycle keeps the buffer's view)."""

    __slots__ = ("deliver", "msg", "error", "direct", "expect")
    src: int | None  # type: ignore[assignment]  # None: any (a served one's is set)

    def __init__(
        self,
        ctx: int,
        src: int | None,
        tag: int,
        deliver: Callable[[Message], Any] | None,
        direct: Any = None,
        expect: bytes | None = None,
    ) -> None:
        self.ctx, self.src, self.tag, self.deliver = ctx, src, tag, deliver
        self.msg: Message | None = None
        self.error: BaseException | None = None
        self.direct, self.expect = direct, expect

    def message(self) -> Message:
        """The message received (``msg`` set)."""
        m = self.msg
        assert m is not None
        return self if m is SERVED else m


# an operation's name for error messages: the text, a function making it, or a format
# string and its arguments (built only on errors)
What = str | Callable[[], str] | tuple


def _text(what: What) -> str:
    if isinstance(what, str):
        return what
    if isinstance(what, tuple):
        return str(what[0]).format(*what[1:])
    return what()


def _no_put(data: memoryview) -> bool:
    return False


def _give(p: PostedRecv, msg: Message) -> None:
    """Hand ``msg`` to the posted receive ``p`` (engine lock held); ``p.msg`` is set last,
    so a thread that sees it finds the data in place."""
    if p.deliver is not None:
        try:
            p.deliver(msg)
        except BaseException as e:  # e.g. truncation: reported by the receive's wait
            p.error = e
    elif len(msg.data) <= len(p.direct):
        p.direct[: len(msg.data)] = msg.data
    p.msg = msg


class Engine:
    """This process's MPI message matching (see the module docstring). ``rt``: the
    collectives runtime (transport, rank, timeout)."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.rank: int = rt.rank
        self.transport = rt.transport
        self.timeout: float = rt.timeout
        self.lock = threading.Lock()
        # bound once: half the cost of ``with self.lock`` on the per-message paths
        self._acquire, self._release = self.lock.acquire, self.lock.release
        self.inbox: list[Message] = []  # arrived, unmatched, in arrival order
        self.posted: list[PostedRecv] = []  # unmatched receives, in posting order
        # what must be empty for a receive to take a message straight from a ring
        self._guard = (self.posted, self.inbox)
        self._expects: dict[tuple[int, int, int], bytes] = {}  # see _expect
        self._takes: dict[tuple[int, int, int], tuple] = {}  # see _take_key
        self._puts: dict[tuple[int, int, int, int], Callable[[memoryview], bool]] = {}  # see _put_key
        self.error: BaseException | None = None
        self.pump: TransportRequest | None = None
        self.waiters = 0
        # the fields of every message's header before ``step`` (the context id), packed
        self._head = HEADER.pack(MAGIC, P2P, 0, _SEND, NO_REDOP, self.rank, MPI_GROUP, 0, 0, 0, 0, 0)[:24]
        self.links = links_for(rt)
        if self.links is not None:
            self.links.raw_routes[MPI_GROUP] = self._local_route
        with self.lock:
            self._repost()

    def _repost(self) -> None:
        """Post the next any-size receive; take what completes at once (lock held)."""
        while self.error is None:
            r = self.transport.irecv(None, _KEY, None)
            if not r.done:
                self.pump = r
                return
            self._arrived(r)

    def _arrived(self, r: TransportRequest) -> None:
        if r.error is not None:
            self.error = r.error
            for p in self.posted:
                p.error = r.error
            self.posted.clear()
            return
        h = r.header
        assert h is not None and r.buf is not None  # completed without error: matched
        self.add(Message(h.src, h.step, h.root, r.buf))

    def add(self, msg: Message) -> None:
        """Match an arrived message against the posted receives, else keep it (lock held)."""
        for i, p in enumerate(self.posted):
            if msg.matches(p.ctx, p.src, p.tag):
                del self.posted[i]
                _give(p, msg)
                return
        self.inbox.append(msg)

    def _local_route(self, f: tuple) -> tuple[Any, Callable[[], None]]:
        """Where a message arriving over shared memory goes (see the module docstring);
        ``f``: its header's fields (shm_p2p's raw route). Called by the links with their
        lock held, before its payload is copied."""
        src, ctx, tag, n = f[5], f[8], f[9], f[11]  # Header's src, step, root, nbytes
        with self.lock:
            for i, p in enumerate(self.posted):
                if p.ctx == ctx and (p.src is None or p.src == src) and (p.tag == ANY_TAG or p.tag == tag):
                    del self.posted[i]
                    break
            else:
                p = None
        if p is not None and p.direct is not None and n <= len(p.direct):
            target = p.direct if n == len(p.direct) else p.direct[:n]

            def direct() -> None:
                p.msg = Message(src, ctx, tag, target)
                if self.waiters > 1:  # another thread may wait for this one
                    self._wake()

            return target, direct
        target = np.empty(n, np.uint8)

        def kept() -> None:
            msg = Message(src, ctx, tag, target.data)
            with self.lock:
                if p is None:
                    self.add(msg)
                    return
                _give(p, msg)
            if self.waiters > 1:
                self._wake()

        return target, kept

    def _wake(self) -> None:
        if self.links is not None:
            self.links.notify()

    def poll(self) -> None:
        """Progress on the shared-memory links, then on the pump."""
        if self.links is not None:
            self.links.progress()
        with self.lock:
            self.progress()

    def progress(self) -> None:
        """Take every message the pump has received (lock held)."""
        while self.pump is not None and self.pump.done:
            r, self.pump = self.pump, None
            self._arrived(r)
            self._repost()

    # -- sending

    def send(self, dest: int, ctx: int, tag: int, payload: Any) -> TransportRequest | None:
        """Start sending ``payload`` (flat uint8 array or byte memoryview, unchanged until
        done) to global rank ``dest``; None when already complete (sent to oneself:
        copied)."""
        if dest == self.rank:
            with self.lock:
                self.add(Message(dest, ctx, tag, memoryview(payload.tobytes())))
            return None
        hdr = Header(P2P, 0, _SEND, NO_REDOP, self.rank, MPI_GROUP, 0, ctx, tag, 0, payload.nbytes)
        links = self.links
        if links is not None and dest in links.index:
            return links.send(dest, hdr, payload, want_request=False)
        return self.transport.isend(dest, hdr, memoryview(payload), time.monotonic() + self.timeout)

    def put(self, dest: int, ctx: int, tag: int, data: memoryview) -> bool:
        """Write a whole message of ``data`` (a flat byte memoryview) to global rank
        ``dest`` on this node at once (:meth:`ShmLinks.put`): True when done; False when
        it cannot be (a remote peer or oneself, messages queued before it, no room):
        then :meth:`send` it."""
        f = self._puts.get((dest, ctx, tag, len(data)))
        if f is None:
            f = self._put_key(dest, ctx, tag, len(data))
        return f(data)

    def _put_key(self, dest: int, ctx: int, tag: int, n: int) -> Callable[[memoryview], bool]:
        """:meth:`put` of messages to ``dest`` of ``ctx``, ``tag`` and ``n`` bytes: the
        links' :meth:`~ShmLinks.putter` (its header packed once), or one that always
        says False (no peer on this node). Remembered (a few thousand at most: programs
        reuse a handful)."""
        links = self.links
        i = None if links is None or dest == self.rank else links.index.get(dest)
        got: Callable[[memoryview], bool]
        if i is None:
            got = _no_put
        else:
            assert links is not None
            got = links.putter(i, _HEAD_REST.pack(self._head, ctx, tag, 0, n), n)
        if len(self._puts) >= 4096:
            self._puts.clear()
        self._puts[dest, ctx, tag, n] = got
        return got

    def send_now(self, dest: int, ctx: int, tag: int, data: memoryview, what: What) -> None:
        """MPI_Send of ``data`` (a flat byte memoryview) to global rank ``dest``: returns
        once ``data`` may be reused. A whole message that fits the peer's ring is written
        at once (no Request); else as :meth:`send` and waited for (raises as
        :meth:`wait_until`, or the send's error)."""
        if self.put(dest, ctx, tag, data):
            return
        req = self.send(dest, ctx, tag, data)
        if req is None:
            return
        if not req.done:
            self.wait_until(lambda: req.done, what, (dest,))
        if req.error is not None:
            raise type(req.error)(f"{_text(what)}: {req.error}")

    def recv_now(
        self, ctx: int, src: int | None, tag: int, buf: memoryview, what: What, spun: bool | None = None
    ) -> tuple[int, int, int]:
        """MPI_Recv into ``buf`` (a writable flat byte memoryview) from global rank ``src``
        (None: any): returns (global source, tag, message bytes) once the message is in
        ``buf`` (when longer than ``buf`` nothing was copied: the caller reports the
        truncation). Raises as :meth:`wait_until`, or the receive's error.

        From a peer on this node, while no receive is posted and no message kept (so
        this receive is the only candidate), the message is taken straight from that
        peer's ring (:meth:`take_now`): busy-polled, no routing or objects. ``spun``:
        the caller tried that already (True: it busy-polled for nothing)."""
        if spun is None:
            spun = False
            got = None if src is None else self._takes.get((src, ctx, tag)) or self._take_key(src, ctx, tag)
            if got:
                f = self.take_now(got, buf)
                if f:
                    return got[1], f[0], f[1]
                spun = f is None  # it busy-polled for nothing: the wait does not again
        p = self.direct_recv(ctx, src, tag, buf)
        self.post(p)
        if p.msg is None and p.error is None:
            self.wait_until(lambda: p.msg is not None or p.error is not None, what, (src,), not spun)
        e = p.error
        if e is not None:
            raise type(e)(f"{_text(what)}: {e}") if isinstance(e, CollectiveError) else e
        m = p.message()
        return m.src, m.tag, len(m.data)

    def take_now(self, got: tuple, buf: memoryview) -> tuple[int, int] | tuple[()] | None:
        """Take the next message of a rank on this node straight from its ring into
        ``buf`` (a writable flat byte memoryview) when it is of the context id and tag
        (ANY_TAG: any) of ``got`` (:meth:`_take_key`), fits, and no receive is posted
        nor message kept (so this receive is the only candidate: MPI's matching order
        holds), busy-polling for it a while (:meth:`ShmLinks.poll_take`). Returns (tag,
        message bytes) once taken; None when it has not come; ``()`` when it cannot be
        taken so (another message first): post a receive."""
        links = self.links
        assert links is not None
        # poll_take's first look made here: a message already there costs no call layer
        seen = links.bell[0]
        f = links.take_prefix(got[3], got[2], buf, self._guard)
        if f is None:
            f = links.poll_after(seen, links.take_prefix, got[3], got[2], buf, self._guard)
        if f:
            marks.heartbeat()  # progress for --hang-timeout
        return f

    def serve(self, i: int, src: int) -> Any:
        """Copy the messages next in the ring of global rank ``src`` (local index ``i``)
        straight into the posted receives they are for, while the first posted receive
        is a contiguous one from ``src`` that the next message matches and fits
        (:meth:`ShmLinks.take_run`: no routing, no kept copy; a window of Irecv posted
        before its messages came). MPI's order holds: the first posted receive is the
        first a message may match, and no kept message matches it (it would have been
        given it when posted). Returns True when no receive is left posted, None when
        the first one waits for a message not yet in the ring, ``()`` when it cannot be
        served so (route: progress)."""
        links = self.links
        assert links is not None
        posted = self.posted
        links._acquire()  # the links' lock before the engine's, as their routing takes them
        try:
            self._acquire()
            try:
                n = len(posted)
                f = links.take_run(i, src, posted, SERVED)
                n -= len(posted)
            finally:
                self._release()
        finally:
            links._release()
        if n:
            marks.heartbeat()  # progress for --hang-timeout
            if self.waiters > 1:  # another thread may wait for one of them
                self._wake()
        return f

    def _serve_for(self, i: int, p: PostedRecv) -> Any:
        """:meth:`serve` until ``p`` is done (True); None: its message has not come;
        ``()``: it cannot be served so (see serve)."""
        if p.msg is not None or p.error is not None:
            return True
        f = self.serve(i, p.src)  # type: ignore[arg-type]
        return True if p.msg is not None else f if f is None else ()

    def wait_posted(self, p: PostedRecv, what: What, last: PostedRecv | None = None) -> None:
        """Block until the posted receive ``p`` is done (raises as :meth:`wait_until`).
        A contiguous receive from a peer on this node busy-polls :meth:`serve` first:
        the messages of a window of Irecv go straight from the ring into their buffers
        instead of through routing. ``last``: a receive from the same rank posted after
        ``p`` (a window's last, for Waitall): the busy-poll serves until it is done,
        so one wait takes the window's run as it comes (it stops, as for ``p``, when
        the run cannot be served so or nothing came); then ``p`` is waited for."""
        links, src, spin = self.links, p.src, True
        if links is not None and src is not None and p.expect is not None:
            i = links.index.get(src)
            if i is not None and src != self.rank:
                f = links.poll_take(self._serve_for, i, p if last is None else last)
                if p.msg is not None or p.error is not None:
                    return
                spin = f is not None  # busy-polled for nothing: the wait does not again
        if p.msg is None and p.error is None:
            self.wait_until(lambda: p.msg is not None or p.error is not None, what, (src,), spin)

    def direct_recv(self, ctx: int, src: int | None, tag: int, buf: memoryview) -> PostedRecv:
        """A receive into ``buf`` (a writable flat byte memoryview), to :meth:`post`."""
        if src is None:
            return PostedRecv(ctx, src, tag, None, buf)
        expect = self._expects.get((src, ctx, tag)) or self._expect(src, ctx, tag)
        return PostedRecv(ctx, src, tag, None, buf, expect)

    def _take_key(self, src: int, ctx: int, tag: int) -> tuple:
        """What :meth:`take_now` and ``Comm.Irecv`` need for a message of global rank
        ``src``, ``ctx`` and ``tag``: (``ctx``, ``src``, :meth:`_expect`, ``src``'s local
        index); ``()``: not a peer on this node. Remembered, as _expect."""
        links = self.links
        i = None if links is None or src == self.rank else links.index.get(src)
        got = () if i is None else (ctx, src, self._expect(src, ctx, tag), i)
        if len(self._takes) >= 4096:
            self._takes.clear()
        self._takes[src, ctx, tag] = got
        return got

    def _expect(self, src: int, ctx: int, tag: int) -> bytes:
        """The packed header's start that a message of global rank ``src``, context id
        ``ctx`` and ``tag`` (ANY_TAG: any) begins with (:meth:`ShmLinks.take_prefix`);
        remembered (a few thousand at most: programs reuse a handful)."""
        if -0x80000000 <= tag < 0x80000000:  # other negative tags: packed, match nothing sent
            head = HEADER.pack(MAGIC, P2P, 0, _SEND, NO_REDOP, src, MPI_GROUP, 0, ctx, tag, 0, 0)
            expect = head[: 28 if tag == ANY_TAG else 32]
        else:  # no header has such a tag: a prefix no message has (not even MAGIC)
            expect = bytes(32)
        if len(self._expects) >= 4096:
            self._expects.clear()
        self._expects[src, ctx, tag] = expect
        return expect

    # -- receiving

    def post(self, recv: PostedRecv) -> None:
        """Match ``recv`` against the kept messages, else post it. (``Comm.Irecv`` writes
        this out for a receive from this node's shared memory, on the hot path: a change of
        these rules goes there too.)"""
        with self.lock:
            pump = self.pump
            if pump is not None and pump.done:
                self.progress()
            if self.inbox:
                for i, m in enumerate(self.inbox):
                    if m.matches(recv.ctx, recv.src, recv.tag):
                        del self.inbox[i]
                        _give(recv, m)
                        return
            if self.error is not None:
                recv.error = self.error
            else:
                self.posted.append(recv)

    def cancel(self, recv: PostedRecv) -> bool:
        with self.lock:
            if recv in self.posted:
                self.posted.remove(recv)
                return True
            return False

    def probe(self, ctx: int, src: int | None, tag: int) -> Message | None:
        if self.links is not None:
            self.links.progress()
        with self.lock:
            self.progress()
            for m in self.inbox:
                if m.matches(ctx, src, tag):
                    return m
            return None

    def take(self, msg: Message) -> None:
        """Remove a probed message from the kept ones (matched probe: MPI_Mprobe)."""
        with self.lock:
            if msg in self.inbox:
                self.inbox.remove(msg)

    def wait_until(
        self, done: Callable[[], bool], what: What, peers: Sequence[int | None] = (), spin: bool = True
    ) -> None:
        """Block until ``done()`` (checked with progress made); CollectiveTimeoutError
        after the group timeout, PeerLostError when one of ``peers`` is lost (``what``
        names the operation in their messages). ``spin``: busy-poll the shared-memory
        links first (False when the caller just did)."""
        deadline = time.monotonic() + self.timeout
        self.waiters += 1
        try:
            if self.links is not None:
                marked = self._wait_links(done, what, peers, deadline, spin)
            else:
                marked = self._wait_pump(done, what, peers, deadline)
        finally:
            self.waiters -= 1
        # progress for --hang-timeout; end() also clears the mark this wait set (and only
        # then: another thread's collective may be the one in flight)
        if marked:
            marks.end()
        else:
            marks.heartbeat()

    def _ready(self, done: Callable[[], bool], what: What) -> bool:
        pump = self.pump
        if pump is not None and not pump.done and self.error is None:
            return done()  # nothing arrived over TCP: no lock needed
        with self.lock:
            self.progress()
            if done():
                return True
            if self.error is not None:
                raise type(self.error)(f"{_text(what)}: {self.error}")
        return False

    def _check_lost(self, what: What, peers: Sequence[int | None], done: Callable[[], bool]) -> None:
        """PeerLostError when one of ``peers`` is lost and ``done()`` is still false
        after taking what arrived: a peer that sent and then ended (MPI_Finalize, exit)
        has its messages delivered first."""
        for p in peers:
            why = self.transport.lost(p) if p is not None and p != self.rank else None
            if why is not None and not self._ready(done, what):
                raise PeerLostError(f"{_text(what)}: rank {p} is lost: {why}")

    def _wait_links(
        self, done: Callable[[], bool], what: What, peers: Sequence[int | None], deadline: float, spin: bool
    ) -> bool:
        # the links' waits wake on shared-memory messages and on TCP completions (the
        # pump); only the first slice busy-polls (the busy time is per wait, not per slice)
        links = self.links
        assert links is not None
        marked = False
        while True:
            try:
                ok = links.wait(
                    lambda: self._ready(done, what), min(deadline, time.monotonic() + 0.5), peers, spin
                )
            except PeerLostError as e:
                raise PeerLostError(f"{_text(what)}: {e}") from None
            if ok:
                return marked  # whether it showed in `distlaunch top`
            if not marked:  # a wait past its first slice (0.5 s) shows in `distlaunch top`
                marks.begin("MPI", 0, _text(what))
                marked = True
            spin = False
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(f"{_text(what)} did not complete within {self.timeout:g} s")
            self._check_lost(what, peers, done)  # remote peers: their connection ended

    def _wait_pump(
        self, done: Callable[[], bool], what: What, peers: Sequence[int | None], deadline: float
    ) -> bool:
        pause, marked, started = 0.0, False, time.monotonic()
        while True:
            if self._ready(done, what):
                return marked
            pump = self.pump
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveTimeoutError(f"{_text(what)} did not complete within {self.timeout:g} s")
            self._check_lost(what, peers, done)
            if not marked and now - started >= 0.5:  # a long wait shows in `distlaunch top`
                marks.begin("MPI", 0, _text(what))
                marked = True
            # sleep on the pump (new messages wake us); sends and receives completed by
            # another thread are noticed within the (growing) slice
            pause = min(0.05, pause * 2 or 0.0005) if self.waiters > 1 or pump is None else 0.05
            if pump is not None:
                pump.wait(min(pause, deadline - now))
            else:
                time.sleep(pause)


# --------------------------------------------------------------------------- requests


class _Op:
    """One pending operation behind a Request."""

    __slots__ = ()

    def test(self) -> bool:
        raise NotImplementedError

    def finish(self, status: Status | None) -> Any:
        """Once done: fill ``status``, raise the operation's error, return its result."""
        return None

    def cancel(self) -> bool:
        return False

    def peers(self) -> list[int | None]:
        return []

    def block(self, engine: Engine) -> None:
        """Wait until done (raises as :meth:`Engine.wait_until`)."""
        engine.wait_until(self.test, getattr(self, "what", "request"), self.peers())


class SendOp(_Op):
    """A send: ``req`` the transport's request (None: complete)."""

    __slots__ = ("req", "what", "dest")

    def __init__(self, req: TransportRequest | None, what: What, dest: int) -> None:
        self.req, self.what, self.dest = req, what, dest

    def test(self) -> bool:
        return self.req is None or self.req.done

    def peers(self) -> list[int | None]:
        return [self.dest]

    def finish(self, status: Status | None) -> Any:
        if self.req is not None and self.req.error is not None:
            raise type(self.req.error)(f"{_text(self.what)}: {self.req.error}")
        if status is not None:
            status._set(ANY_SOURCE, ANY_TAG, 0)
        return None


class RecvOp(_Op):
    """A receive into ``spec`` (a buffer specification, or a flat writable byte
    memoryview: copied straight in) or of an object (``spec`` None: ``decode`` turns the
    bytes into the result). ``to_rank``: global -> communicator rank."""

    __slots__ = ("engine", "spec", "to_rank", "decode", "what", "src", "result", "posted")

    def __init__(
        self,
        engine: Engine,
        ctx: int,
        src: int | None,
        tag: int,
        spec: Spec | memoryview | None,
        to_rank: Callable[[int], int],
        decode: Callable[[memoryview], Any] | None = None,
        what: What = "recv",
    ) -> None:
        self.engine, self.spec, self.to_rank, self.decode, self.what = engine, spec, to_rank, decode, what
        self.src = src
        self.result: Any = None
        if isinstance(spec, memoryview):
            self.posted = engine.direct_recv(ctx, src, tag, spec)
        else:
            self.posted = PostedRecv(ctx, src, tag, self._deliver, spec.view() if spec is not None else None)
        engine.post(self.posted)

    def _deliver(self, msg: Message) -> None:
        if isinstance(self.spec, Spec):
            cap = self.spec.nbytes
            if len(msg.data) > cap:
                raise truncated(_text(self.what), len(msg.data), self.to_rank(msg.src), msg.tag, cap)
            self.spec.unpack(msg.data)
        elif self.decode is not None:
            self.result = self.decode(msg.data)

    def test(self) -> bool:
        return self.posted.msg is not None or self.posted.error is not None

    def peers(self) -> list[int | None]:
        return [self.src]

    def cancel(self) -> bool:
        return self.engine.cancel(self.posted)

    def block(self, engine: Engine) -> None:
        engine.wait_posted(self.posted, self.what)

    def finish(self, status: Status | None) -> Any:
        if self.posted.error is not None:
            _raise_failed(self.posted.error, self.what)
        m = self.posted.message()
        if isinstance(self.spec, memoryview) and len(m.data) > len(self.spec):  # not copied
            raise truncated(_text(self.what), len(m.data), self.to_rank(m.src), m.tag, len(self.spec))
        if status is not None:
            status._set(self.to_rank(m.src), m.tag, len(m.data))
        return self.result


class DirectRecv(PostedRecv, _Op):
    """An Irecv of a contiguous buffer from one rank on this node, made by
    ``Comm.Irecv`` (no ``__init__``): the posted receive is its own op (one object
    a message), ``engine`` its engine, ``source`` its communicator rank. Its message is
    copied straight from the ring by a Wait/Waitall (:meth:`Engine.serve`: a window's
    run at once), else routed to it (:meth:`Engine._local_route`: Test, probes, other
    waits)."""

    __slots__ = ("engine", "source")
    engine: Engine
    source: int

    def what(self) -> What:
        return ("receive from rank {} (tag {})", self.source, self.tag)

    def test(self) -> bool:
        return self.msg is not None or self.error is not None

    def peers(self) -> list[int | None]:
        return [self.src]

    def cancel(self) -> bool:
        return self.engine.cancel(self)

    def block(self, engine: Engine) -> None:
        engine.wait_posted(self, self.what())

    def finish(self, status: Status | None) -> Any:
        if self.error is not None:
            _raise_failed(self.error, self.what())
        m = self.message()
        n = len(m.data)
        if n > len(self.direct):  # routed and not copied
            raise truncated(_text(self.what()), n, self.source, m.tag, len(self.direct))
        if status is not None:
            status._set(self.source, m.tag, n)
        return None


def _raise_failed(e: BaseException, what: What) -> NoReturn:
    """Raise a failed receive's error ``e``: the engine's own (a CollectiveError that is
    not an MPI one: a peer lost, a timeout) names the operation ``what``."""
    if isinstance(e, CollectiveError) and not isinstance(e, MPIException):
        raise type(e)(f"{_text(what)}: {e}")
    raise e


def truncated(what: str, nbytes: int, source: int, tag: int, cap: int) -> MPIException:
    """The ERR_TRUNCATE error of a receive of ``cap`` bytes that matched a longer message."""
    return MPIException(
        ERR_TRUNCATE,
        f"{what}: message of {nbytes} bytes from rank {source} (tag {tag}) does not fit "
        f"the receive buffer of {cap} bytes (make it larger)",
    )


class DoneOp(_Op):
    """Already complete (PROC_NULL; ``cancelled``: a cancelled receive), with the Status
    MPI gives it."""

    __slots__ = ("source", "result", "cancelled")

    def __init__(self, source: int = PROC_NULL, result: Any = None, cancelled: bool = False) -> None:
        self.source, self.result, self.cancelled = source, result, cancelled

    def test(self) -> bool:
        return True

    def finish(self, status: Status | None) -> Any:
        if status is not None:
            status._set(self.source, ANY_TAG, 0, self.cancelled)
        return self.result


class SentOp(_Op):
    """A send complete when started (written whole into the peer's ring)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def finish(self, status: Status | None) -> Any:
        if status is not None:
            status._set(ANY_SOURCE, ANY_TAG, 0)
        return None


# ops complete when started whose finish without a Status only returns None
_BARE = frozenset((SentOp,))
SENT = SentOp()  # (stateless: every such send's Request shares it)


class Request:
    """MPI_Request (mpi4py's Request): a pending non-blocking operation. Completing it
    (Wait, a successful Test, ...) makes it equal to ``REQUEST_NULL``, as in MPI.
    Blocking methods raise as :meth:`Engine.wait_until`; a failed operation raises its
    error (MPIException ERR_TRUNCATE, PeerLostError, ...)."""

    __slots__ = ("_op", "_engine")

    def __init__(self, request: Request | None = None, op: _Op | None = None, engine: Engine | None = None):
        self._op: _Op | None = request._op if request is not None else op
        self._engine: Engine | None = request._engine if request is not None else engine

    def _key(self) -> Any:
        """What identifies the MPI handle (None: REQUEST_NULL)."""
        return self._op

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and self._key() is other._key()

    def __hash__(self) -> int:
        return id(self._key())

    def __bool__(self) -> bool:
        return self._op is not None

    def _poll(self) -> bool:
        op, eng = self._op, self._engine
        if op is None:
            return True
        if op.test():
            return True
        if eng is not None:
            eng.poll()
        return op.test()

    def _complete(self, status: Status | None) -> Any:
        op, self._op = self._op, None
        if op is None:
            if status is not None:
                status._set(ANY_SOURCE, ANY_TAG, 0)
            return None
        return op.finish(status)

    def _block(self) -> None:
        op, eng = self._op, self._engine
        if op is not None and not op.test() and eng is not None:
            op.block(eng)

    # mpi4py: uppercase for buffers, lowercase returns the received object
    def Wait(self, status: Status | None = None) -> bool:
        self._block()
        self._complete(status)
        return True

    def wait(self, status: Status | None = None) -> Any:
        self._block()
        return self._complete(status)

    def Test(self, status: Status | None = None) -> bool:
        if not self._poll():
            return False
        self._complete(status)
        return True

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        if not self._poll():
            return False, None
        return True, self._complete(status)

    def Get_status(self, status: Status | None = None) -> bool:
        done = self._poll()
        if done and status is not None and self._op is not None:
            st = Status()
            try:
                self._op.finish(st)
            except BaseException:
                st.error = ERR_TRUNCATE
            status._set(st.source, st.tag, st.nbytes, st.cancelled)
        return done

    def Cancel(self) -> None:
        if self._op is not None and self._op.cancel():
            self._op = DoneOp(ANY_SOURCE, cancelled=True)  # Status.Is_cancelled, as MPI

    def Free(self) -> None:
        self._op = None

    # -- arrays of requests

    @staticmethod
    def _wait_any(requests: Sequence[Request]) -> None:
        live = [r for r in requests if r._op is not None]
        if not live or any(r._poll() for r in live):
            return
        eng = next((r._engine for r in live if r._engine is not None), None)
        if eng is not None:
            peers = [p for r in live for p in (r._op.peers() if r._op else [])]
            eng.wait_until(lambda: any(r._op is None or r._op.test() for r in live), "Waitany", peers)

    @staticmethod
    def Waitall(requests: Sequence[Request], statuses: list | None = None) -> bool:
        if statuses:
            Request.waitall(requests, statuses)
            return True
        # no Status asked for (osu_bw's windows): a send complete when started or a
        # receive served from the ring only becomes REQUEST_NULL
        last = requests[-1]._op if requests else None
        for r in requests:
            op = r._op
            tp = type(op)
            if tp is SentOp:
                r._op = None
                continue
            if tp is DirectRecv:
                if op.msg is SERVED:  # type: ignore[union-attr]  # the run's first wait took it
                    r._op = None
                    continue
                if op.msg is None and op.error is None:  # type: ignore[union-attr]
                    # with the window's last receive when it is from the same rank: one
                    # wait serves the whole run as its messages come (Engine.serve takes
                    # posted receives in order), instead of one wait a piece
                    same = type(last) is DirectRecv and last is not op and last.src == op.src  # type: ignore[union-attr]
                    op.engine.wait_posted(op, op.what(), last if same else None)  # type: ignore[union-attr]
                if op.msg is SERVED:  # type: ignore[union-attr]
                    r._op = None
                    continue
            elif op is not None and not op.test():
                r._block()
            r._complete(None)
        return True

    @staticmethod
    def waitall(requests: Sequence[Request], statuses: list | None = None) -> list:
        results: list = []
        sts = statuses or ()
        n = len(sts)
        for i, r in enumerate(requests):
            st = sts[i] if i < n else None
            op = r._op
            tp = type(op)
            # complete when started, or served from the ring (it fit, no error): nothing to report
            if st is None and (tp in _BARE or tp is DirectRecv and op.msg is SERVED):  # type: ignore[union-attr]
                r._op = None
                results.append(None)
                continue
            if op is not None and not op.test():  # complete ones (a window of sends): no wait
                r._block()  # a window's first receive: serves the run (the rest are SERVED)
            results.append(r._complete(st))
        return results

    @staticmethod
    def Testall(requests: Sequence[Request], statuses: list | None = None) -> bool:
        return Request.testall(requests, statuses)[0]

    @staticmethod
    def testall(requests: Sequence[Request], statuses: list | None = None) -> tuple[bool, list | None]:
        if not all(r._poll() for r in requests):
            return False, None
        return True, Request.waitall(requests, statuses)

    @staticmethod
    def Waitany(requests: Sequence[Request], status: Status | None = None) -> int:
        return Request.waitany(requests, status)[0]

    @staticmethod
    def waitany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, Any]:
        """(index of a completed request, its result); (UNDEFINED, None) when every
        request is REQUEST_NULL."""
        if all(r._op is None for r in requests):
            if status is not None:
                status._set(ANY_SOURCE, ANY_TAG, 0)
            return UNDEFINED, None
        while True:
            i = _first_done(requests)
            if i >= 0:
                return i, requests[i]._complete(status)
            Request._wait_any(requests)

    @staticmethod
    def Testany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, bool]:
        i, flag, _ = Request.testany(requests, status)
        return i, flag

    @staticmethod
    def testany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, bool, Any]:
        if all(r._op is None for r in requests):
            return UNDEFINED, True, None
        i = _first_done(requests)
        if i >= 0:
            return i, True, requests[i]._complete(status)
        return UNDEFINED, False, None

    @staticmethod
    def Waitsome(requests: Sequence[Request], statuses: list | None = None) -> list[int] | None:
        if all(r._op is None for r in requests):
            return None
        Request._wait_any(requests)
        return Request.Testsome(requests, statuses)

    @staticmethod
    def Testsome(requests: Sequence[Request], statuses: list | None = None) -> list[int] | None:
        if all(r._op is None for r in requests):
            return None
        done = [i for i, r in enumerate(requests) if r._op is not None and r._poll()]
        for k, i in enumerate(done):
            requests[i]._complete(statuses[k] if statuses is not None and k < len(statuses) else None)
        return done


def _first_done(requests: Sequence[Request]) -> int:
    """The lowest index of a completed request of ``requests``, or -1 (none yet). A poll
    may move the transport on and so complete requests polled before it (a sender's
    messages arrive in order): those are looked at again, without moving it on, so
    Waitany and Testany return the first completed request in array order, as MPICH's
    scan after its progress does (MPI allows any; programs and their expected outputs
    rely on MPICH's)."""
    for i, r in enumerate(requests):
        if r._op is not None and r._poll():
            for j in range(i):
                op = requests[j]._op
                if op is not None and op.test():
                    return j
            return i
    return -1


class Prequest(Request):
    """mpi4py's Prequest: a persistent request (MPI_Send_init / MPI_Recv_init and their
    Bsend/Ssend/Rsend forms), bound to its arguments once. Inactive when made; Start
    (or Startall) starts the operation as Isend/Irecv would (a send reads its buffer
    at each Start); once completed (Wait, a successful Test, ...) it is inactive again
    -- not REQUEST_NULL -- and may be started anew, until Free. Completing an inactive
    one returns at once with an empty Status, as MPI does. Start raises MPIException
    (ERR_REQUEST) on an active or freed request."""

    __slots__ = ("_start",)

    def __init__(self, request: Request | None = None, start: Callable[[], Request] | None = None) -> None:
        super().__init__(request)
        self._start: Callable[[], Request] | None = request._start if isinstance(request, Prequest) else start

    def _key(self) -> Any:
        return self._start if self._start is not None else self._op

    def __bool__(self) -> bool:
        return self._start is not None

    def Start(self) -> None:
        """Start the operation (MPI_Start); see the class docstring."""
        if self._start is None:
            raise MPIException(ERR_REQUEST, "Start on a freed persistent request (make a new one)")
        if self._op is not None:
            raise MPIException(
                ERR_REQUEST, "Start on an active persistent request: complete it first (Wait/Test)"
            )
        req = self._start()
        self._op, self._engine = req._op, req._engine

    @classmethod
    def Startall(cls, requests: Sequence[Prequest]) -> None:
        """Start every request of ``requests`` (MPI_Startall), in order."""
        for r in requests:
            r.Start()

    def Free(self) -> None:
        """Release the request (MPI_Request_free); an active operation still completes."""
        self._op = None
        self._start = None


Grequest = Request
REQUEST_NULL = Request()


def request_of(op: _Op, engine: Engine) -> Request:
    """A Request of ``op`` (what Request(op=op, engine=engine) makes, for less: one per
    message of a window of Isend/Irecv)."""
    r = _new(Request)
    r._op, r._engine = op, engine
    return r
