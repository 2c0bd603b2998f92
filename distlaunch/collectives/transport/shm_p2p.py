"""Point-to-point messages between the ranks of one node over shared memory.

Used for every send/recv (``distlaunch.collectives`` isend/irecv through the transport,
``distlaunch.mpi`` through its engine) whose peer runs on this node, when the ranks may
share memory (the launcher's node id, DISTLAUNCH_SHM not "0"; see :mod:`.runtime`).
Remote peers keep using TCP; a pair of ranks always uses the same path, so messages of
one sender arrive in the order sent (MPI's non-overtaking rule).

Every local rank has one *inbox* segment (``<DISTLAUNCH_SHM_PREFIX>p2p-<hash>``, the
hash a one-way function of the job's secret and the rank: nothing of the secret is in
the name). Every rank maps every local inbox the first time it uses point-to-point;
the last local rank to map one unlinks it (an inbox also goes with its owner's
``close``; the launcher removes its prefix's leftovers after a crash). Layout::

    [0, 4096)   bell (u32 futex word), sleeping flag (u32), owner pid (u64),
                at 64 + i: local rank i mapped this inbox (u8)
    per local sender i: 256 bytes of control -- head (u64, bytes the sender published),
                at 64 the sender's "blocked" flag (u32), at 128 tail (u64, bytes the
                owner consumed) -- then a ring of ``ring`` bytes

A message is a 64-byte record (the 48-byte wire :class:`~distlaunch.collectives.wire.Header`) followed by
its payload, padded to 64 bytes. The sender writes as much as the ring has room for and
keeps the rest queued; whatever the process does next with point-to-point (a send, a
wait, a test) moves queued data on, so large messages stream through the ring in
pieces while the receiver copies them out (two copies, pipelined: measured faster than
process_vm_readv here, which moves ~14 GB/s against ~40 GB/s for a cached memcpy).
The receiver routes each header, as soon as it sees it, to its consumer (the MPI
engine for distlaunch.mpi's messages, else the transport's matching), which names the
destination: the posted receive's own buffer when one matches, else a new buffer kept
as an unexpected message.

Fast paths (the MPI engine's blocking Send/Recv, distlaunch.collectives' send/isend and
blocking recv): :meth:`ShmLinks.put` writes a whole message that fits the ring at once
from a packed header (no queue, no Request), and :meth:`ShmLinks.take` (the MPI engine:
:meth:`ShmLinks.take_prefix`, one comparison of the packed header) copies the next
message of a ring straight into a receive buffer when it is the one wanted (no routing,
no objects), busy-polled by :meth:`ShmLinks.poll_take`; :meth:`ShmLinks.take_run` does
it for a run of the MPI engine's posted receives (one lock, one tail publication). The caller makes sure that
nothing could be matched before it: the MPI engine by having no receive posted and no
message kept; the collectives by having no receive of the group posted and every
message of that sender routed to the transport received (:meth:`ShmLinks.settled`:
counted by the links, ``claim``-ed by the receives), else they take the general way.

Waiting: a waiter watches its bell (senders bump it after publishing data; receivers
after consuming from a ring whose sender is blocked; the TCP progress thread after
completing a request). First it busy-polls the bell for ``busy`` seconds
(DISTLAUNCH_SHM_P2P_BUSY_US, default 100 us: a wake-up from the kernel costs more than
a small message's whole trip), unless the node's ranks may run on fewer CPUs together
than they are (their affinities): a spinner would then hold the CPU of the very peer it
waits for, so it skips this. Then ``config.spin`` checks each after a ``sched_yield``,
then ``futex(FUTEX_WAIT)`` slices of at most 50 ms with the sleeping flag set (Dekker's
pattern, as :mod:`.shm`): an idle waiter uses no CPU. Between slices it checks the
deadline and whether the peers it waits for still exist (PeerLostError): a peer killed
in the middle of a message never leaves the survivor hanging. Relies on x86-64 store
ordering, as :mod:`.shm`.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any

import numpy as np

from ..errors import CollectiveError, PeerLostError
from ..wire import HEADER, HEADER_SIZE, MAGIC, Header
from . import Request
from .shm import (
    _SLICE,
    _SYS_FUTEX,
    ShmConfig,
    ShmFullError,
    _alive,
    _futex_fn,
    _Timespec,
    _unlink,
    _unlink_data,
    map_segment,
    warn_full,
)
from .shm import available as shm_available

RING = 1 << 20  # default bytes per (sender, receiver) ring
_HDR, _CTL, _REC = 4096, 256, 64
_PAD, _ALIGN = 2 * _REC - 1, -_REC  # (nbytes + _PAD) & _ALIGN: a record's bytes
_ONE_STORE = 4096  # payload bytes up to which a putter writes header and payload together
BUSY = 100e-6  # default seconds of busy-polling the bell before yielding the core
# a record's header start (the 32 bytes of a 32-byte ``expect``; 28 and the signed
# ``root``) and its nbytes in one call: take_run's and take_prefix's look (a slice, its
# comparison, a shift and an item each cost about as much as this call)
_HEAD32 = struct.Struct("<32s8xQ").unpack_from
_HEAD28 = struct.Struct("<28si8xQ").unpack_from
_POLLS = range(64)  # bell checks between two looks at the clock while busy-polling
_PID_RETRY = 0.001  # seconds between looks for the local ranks' pids until all are known

# a consumer's answer to a header: (destination of hdr.nbytes bytes -- a uint8 array or
# a writable byte memoryview --, called when the payload is in place)
Sink = tuple[Any, Callable[[], None]]
Route = Callable[[Header], Sink]
# the same from the unpacked header fields (MAGIC first, then Header's fields): no
# Header object is built (the MPI engine's per-message cost)
RawRoute = Callable[[tuple], Sink]


def busy_seconds(pids: Sequence[int]) -> float:
    """Seconds a waiter busy-polls before yielding its core: DISTLAUNCH_SHM_P2P_BUSY_US
    (microseconds), default 100; 0 when the processes ``pids`` (this node's ranks) may
    run on fewer CPUs together than they are (their affinities: taskset, cgroup
    cpusets, ``--bind-to``): a spinning waiter would then hold the CPU of the peer it
    waits for (oversubscription), so it yields at once."""
    cpus: set[int] = set()
    for pid in pids:
        try:
            cpus |= os.sched_getaffinity(pid)
        except OSError:  # gone: it will not be waited for long
            pass
    if len(cpus) < len(pids):
        return 0.0
    raw = os.environ.get("DISTLAUNCH_SHM_P2P_BUSY_US", "")
    return int(raw) * 1e-6 if raw.isdigit() else BUSY


def segment_name(secret: str, rank: int) -> str:
    """File name (under /dev/shm) of global ``rank``'s inbox: DISTLAUNCH_SHM_PREFIX (or
    ``distlaunch-<uid>-``) and a one-way hash of the job's secret and the rank."""
    prefix = os.environ.get("DISTLAUNCH_SHM_PREFIX") or f"distlaunch-{os.getuid()}-"
    digest = hashlib.sha256(f"distlaunch-p2p\0{secret}\0{rank}".encode()).hexdigest()[:24]
    return f"{prefix}p2p-{digest}"


def _ring_read(dst: Any, mv: memoryview, at: int, ring: int, a: int, n: int) -> None:
    """Copy ``n`` bytes from offset ``a`` of the ring at ``mv[at : at + ring]`` into
    ``dst``, wrapping at the ring's end."""
    first = ring - a
    if n <= first:
        dst[:n] = mv[at + a : at + a + n]
    else:
        dst[:first] = mv[at + a : at + ring]
        dst[first:n] = mv[at : at + n - first]


class _Inbox:
    """One mapped inbox segment (ours or a peer's)."""

    def __init__(self, path: str, size: int, n: int, ring: int) -> None:
        self.path = path
        self.mm = map_segment(path, size)  # raises ShmFullError, alike in every local rank
        self.words = memoryview(self.mm).cast("I")
        self.quads = memoryview(self.mm).cast("Q")
        self.raw = np.frombuffer(self.mm, np.uint8)
        self.mv = memoryview(self.mm)  # copies through memoryview slices: cheaper than numpy's
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.bell_addr = ctypes.addressof(self._anchor)
        # per local sender i: (ring data, its byte offset, head word index, blocked word
        # index, tail word index)
        self.rings: list[tuple[np.ndarray, int, int, int, int]] = []
        for i in range(n):
            ctl = _HDR + i * (_CTL + ring)
            at = ctl + _CTL
            self.rings.append((self.raw[at : at + ring], at, ctl // 8, (ctl + 64) // 4, (ctl + 128) // 8))

    def close(self) -> None:
        try:
            del self.words, self.quads, self.raw, self.mv, self.rings, self._anchor
            self.mm.close()
        except (BufferError, AttributeError):
            pass  # a view of a message still exists: the mapping goes with it


class _Out:
    """A message (or what is left of it) queued for a peer's ring."""

    __slots__ = ("hdr", "data", "off", "started", "req")

    def __init__(self, hdr: Header, data: memoryview, req: Request | None) -> None:
        self.hdr, self.data, self.off, self.started, self.req = hdr, data, 0, False, req


class _In:
    """The message being received from one sender."""

    __slots__ = ("target", "got", "finish")

    def __init__(self, target: np.ndarray, finish: Callable[[], None]) -> None:
        self.target, self.got, self.finish = target, 0, finish


class ShmLinks:
    """The shared-memory links of this process to the other ranks of its node.

    ``rt``: the collectives runtime (rank, secret, node ids, shm settings); ``local``:
    the global ranks on this node, this one included, in order. Sends and routing run
    under ``lock`` (any thread); see the module docstring.
    """

    def __init__(self, rt: Any, local: list[int], config: ShmConfig, ring: int = RING) -> None:
        self.rank = rt.rank
        self.local = local
        self.index = {g: i for i, g in enumerate(local)}  # global rank -> local index
        self.me = self.index[self.rank]
        self.others = [i for i in range(len(local)) if i != self.me]  # local indices of the peers
        self.ring = ring = max(_REC, ring // _REC * _REC)
        self.spin, self.yield_spin = config.spin, config.yield_spin
        self._busy: float | None = None  # see busy
        self._busy_retry = 0.0  # when to look again for the pids of the local ranks
        self.lock = threading.RLock()
        # bound once: half the cost of ``with self.lock`` on the fast paths
        self._acquire, self._release = self.lock.acquire, self.lock.release
        # whether this thread holds the lock already: then its release is no barrier (see putter)
        self._owned = self.lock._is_owned  # type: ignore[attr-defined]
        self._fence = threading.Lock()
        self._fence_acquire, self._fence_release = self._fence.acquire, self._fence.release
        self._futex = _futex_fn()
        self._ts = _Timespec()
        self.routes: dict[int, Route] = {}  # transport group id -> consumer of its messages
        self.raw_routes: dict[int, RawRoute] = {}  # the same, taking the header's fields
        self.default_route: Route | None = None
        n = len(local)
        size = _HDR + n * (_CTL + ring)
        self.boxes = [
            _Inbox(os.path.join("/dev/shm", segment_name(rt.secret, g)), size, n, ring) for g in local
        ]
        own = self.boxes[self.me]
        own.quads[1] = os.getpid()
        self.bell = own.words
        self.queues: list[collections.deque[_Out]] = [collections.deque() for _ in local]
        self.heads = [0] * n  # what we published into each peer's ring
        # each peer's tail in its ring as put saw it last (it only grows: room known to
        # be free without reading the peer's cache line again)
        self.room = [0] * n
        self.tails = [0] * n  # what we consumed from each peer's ring
        self.current: list[_In | None] = [None] * n
        # per local sender: messages routed to ``routes``/``default_route`` (under lock)
        # and how many of them a receive accepted (claim; under _count_lock)
        self.kept = [0] * n
        self.claimed = [0] * n
        self._count_lock = threading.Lock()
        # per local rank i, what the hot paths use: the ring we write in its inbox
        # (mapping, memoryview, u64 words, its u32 words, ring offset, head/tail word
        # indices) and the ring it writes in ours (the same, and its blocked flag's index)
        self.outs: list[tuple[mmap.mmap, memoryview, memoryview, memoryview, int, int, int]] = []
        self.ins: list[tuple[mmap.mmap, memoryview, memoryview, memoryview, int, int, int, int]] = []
        for i in range(n):
            box = self.boxes[i]
            _, at, hi, _, ti = box.rings[self.me]
            self.outs.append((box.mm, box.mv, box.quads, box.words, at, hi, ti))
            _, at, hi, bi, ti = own.rings[i]
            self.ins.append((own.mm, own.mv, own.quads, own.words, at, hi, bi, ti))
        self.closed = False
        self._putters: dict[tuple[int, bytes], Callable[[memoryview], bool]] = {}  # see putter
        for box in self.boxes:
            box.raw[64 + self.me] = 1
        self._unlink_mapped()

    def _unlink_mapped(self) -> None:
        """Unlink the inboxes every local rank has mapped (nobody opens them again)."""
        n = len(self.local)
        for box in self.boxes:
            if box.path and all(box.raw[64 + i] for i in range(n)):
                _unlink(box.path)
                box.path = ""

    @property
    def busy(self) -> float:
        """Seconds of busy-polling before a wait yields (:func:`busy_seconds`); 0 until
        every local rank wrote its pid into its inbox."""
        busy = self._busy
        if busy is None:
            now = time.monotonic()
            if now < self._busy_retry:
                return 0.0
            pids = [box.quads[1] for box in self.boxes] if not self.closed else [0]
            if not all(pids):  # a rank that has not used point-to-point yet
                self._busy_retry = now + _PID_RETRY
                return 0.0
            busy = self._busy = busy_seconds(pids)
        return busy

    # -- waking

    def _fence_now(self) -> None:
        self._fence.acquire()  # a locked instruction: a full barrier on x86
        self._fence.release()

    def ring_bell(self, i: int) -> None:
        """Bump local rank i's bell and wake it if it sleeps (after our data stores)."""
        w = self.boxes[i].words
        w[0] = (w[0] + 1) & 0xFFFFFFFF
        self._fence_now()
        if w[1]:
            self._futex(_SYS_FUTEX, self.boxes[i].bell_addr, 1, 0x7FFFFFFF, None, None, 0)

    def notify(self) -> None:
        """Wake this process's waiter: something it may wait for happened (a TCP
        request completed, another thread delivered a message)."""
        if not self.closed:
            self.ring_bell(self.me)

    # -- sending

    def send(
        self, dest: int, hdr: Header, data: np.ndarray | memoryview, want_request: bool = True
    ) -> Request | None:
        """Send ``hdr`` and ``data`` (flat uint8 array or byte memoryview, unchanged until
        done) to global rank
        ``dest`` (on this node). Returns None when the whole message is already in the
        ring and ``want_request`` is false, else a transport Request completed once it
        is (the rest moves on with this process's later progress)."""
        i = self.index[dest]
        with self.lock:
            if self.closed:
                raise CollectiveError("transport is closed")
            q = self.queues[i]
            item = _Out(hdr, data.data if isinstance(data, np.ndarray) else data, None)
            q.append(item)
            if len(q) == 1:
                self._push(i)
            if not q or q[-1] is not item:  # written out completely
                if not want_request:
                    return None
                req = Request(True, dest, (), None)
                req.local = self
                req.complete()
                return req
            req = item.req = Request(True, dest, (), None)
            req.local = self
            return req

    def put(self, i: int, header: bytes, data: memoryview) -> bool:
        """Write a whole message to local rank ``i`` (``self.local[i]``) now: ``header``
        its packed :data:`~.wire.HEADER` (48 bytes), ``data`` its payload (a flat byte
        memoryview). True when written; False (nothing done) when earlier messages to
        that rank are still queued or its ring lacks room: then :meth:`send` it (keeps
        the order). The same as ``putter(i, header, len(data))(data)``."""
        f = self._putters.get((i, header))
        if f is None:
            if len(self._putters) >= 4096:  # a few thousand at most: programs reuse a handful
                self._putters.clear()
            f = self._putters[i, header] = self.putter(i, header, len(data))
        return f(data)

    def putter(self, i: int, header: bytes, n: int) -> Callable[[memoryview], bool]:
        """:meth:`put` of messages of ``header`` (whose payload size is ``n`` bytes) to
        local rank ``i``, with everything but the payload bound once (the MPI engine's
        Isend/Send and the collectives' send keep it per destination, tag and size: a
        third less interpreted work a message; each caller keeps its own)."""
        # the views are read from the box at each call: a kept putter must not keep the
        # mapping after close (which unmaps it by deleting the box's views)
        box = self.boxes[i]
        _, _, _, _, at, hi, ti = self.outs[i]
        ring, heads, room, q = self.ring, self.heads, self.room, self.queues[i]
        step = (_REC + n + _REC - 1) // _REC * _REC  # heads and tails stay multiples of _REC
        acquire, release, nested = self._acquire, self._release, self._owned
        fence_acquire, fence_release = self._fence_acquire, self._fence_release
        futex, bell = self._futex, box.bell_addr
        links = self
        # a small payload goes in one store with the header and its padding (one slice
        # assignment less a message: ~6 % of an MPI Isend's interpreted work); a large
        # one is not copied twice
        head = header + bytes(_REC - HEADER_SIZE) if 0 < n <= _ONE_STORE else b""

        def put(data: memoryview) -> bool:
            inner = nested()  # this thread holds the lock already: its release is no barrier
            acquire()
            try:
                if links.closed or q:
                    return False
                mv, quads, words = box.mv, box.quads, box.words
                pos = heads[i]
                end = pos + step
                if end - room[i] > ring:  # the tail seen last is too old: look again
                    tail = room[i] = quads[ti]
                    if end - tail > ring:
                        return False
                a = pos % ring
                if head and a + step <= ring:  # not wrapping: header and payload at once
                    mv[at + a : at + a + _REC + n] = head + data
                else:
                    mv[at + a : at + a + HEADER_SIZE] = header
                    if n:
                        a = (a + _REC) % ring
                        first = ring - a
                        if n <= first:
                            mv[at + a : at + a + n] = data
                        else:
                            mv[at + a : at + ring] = data[:first]
                            mv[at : at + n - first] = data[first:]
                heads[i] = end
                quads[hi] = end
                words[0] = (words[0] + 1) & 0xFFFFFFFF  # its bell (see ring_bell)
                if inner:
                    fence_acquire()
                    fence_release()
                    if words[1]:
                        futex(_SYS_FUTEX, bell, 1, 0x7FFFFFFF, None, None, 0)
                    return True
            finally:
                release()
            # the release was the barrier between the bell's store and the sleeping flag's
            # load (Dekker's pattern, as ring_bell): unheld, it releases the lock with a
            # locked instruction (sem_post up to 3.12, a CAS after; a full barrier on
            # x86); one fence less a message. (words stays exported: a close() from
            # another thread meanwhile leaves the mapping to the end, unmapping nothing)
            if words[1]:
                futex(_SYS_FUTEX, bell, 1, 0x7FFFFFFF, None, None, 0)
            return True

        return put

    def _push(self, i: int) -> None:
        """Write as much of the queue to local rank i as its ring has room for (lock held).
        With data left over, set our "blocked" flag in its ring, then look at its tail
        once more (it may have consumed before seeing the flag: Dekker's pattern)."""
        q = self.queues[i]
        box = self.boxes[i]
        _, at, hi, bi, ti = box.rings[self.me]
        mm, mv, quads = box.mm, box.mv, box.quads
        ring = self.ring
        pos = self.heads[i]
        tail = quads[ti]
        while True:
            while q:
                item = q[0]
                if not item.started:
                    if ring - (pos - tail) < _REC:
                        break
                    HEADER.pack_into(mm, at + pos % ring, MAGIC, *item.hdr)
                    item.started = True
                    pos += _REC
                left = len(item.data) - item.off
                if left:
                    n = min(left, ring - (pos - tail))
                    if n <= 0:
                        break
                    a = pos % ring
                    first = min(n, ring - a)
                    src, off = item.data, item.off
                    mv[at + a : at + a + first] = src[off : off + first]
                    if n > first:
                        mv[at : at + n - first] = src[off + first : off + n]
                    item.off = off + n
                    pos += n
                    if n < left:
                        break
                pos = (pos + _REC - 1) // _REC * _REC
                q.popleft()
                if item.req is not None:
                    item.req.complete()
            if pos != self.heads[i]:
                self.heads[i] = pos
                quads[hi] = pos
                self.ring_bell(i)
            if not q:
                if box.words[bi]:
                    box.words[bi] = 0
                return
            box.words[bi] = 1
            self._fence_now()
            if quads[ti] == tail:
                return
            tail = quads[ti]

    # -- receiving

    def take(
        self, i: int, group: int, step: int, root: int | None, buf: memoryview, header: bytes | None = None
    ) -> Any:
        """Consume the next message local rank i sent us when it is complete in the ring,
        of transport group ``group`` with header fields ``step`` and ``root`` (None: any),
        and fits ``buf`` (a writable flat byte memoryview): its payload goes to ``buf``
        and its header's fields are returned (MAGIC first). With ``header`` (48 bytes)
        instead: when its packed header is exactly that (every field, the payload size
        ``len(buf)`` included); True is returned. None: no message yet; ``()``: the next
        one is another (route it: :meth:`progress`). Lock held. The receive fast paths
        of the MPI engine and of the collectives' recv: no routing, no objects (one
        function, all inline: the latency of small messages)."""
        mm, mv, quads, words, at, hi, bi, ti = self.ins[i]
        pos = self.tails[i]
        head = quads[hi]
        if head == pos:
            return None
        if self.current[i] is not None:
            return ()
        ring = self.ring
        a = at + pos % ring
        fields: Any
        if header is not None:
            n = len(buf)
            if n > head - pos - _REC or mm[a : a + HEADER_SIZE] != header:
                return ()
            fields = True
        else:
            fields = HEADER.unpack_from(mm, a)
            n = fields[11]
            if (
                fields[6] != group
                or fields[8] != step
                or root is not None
                and fields[9] != root
                or n > len(buf)
                or n > head - pos - _REC
                or fields[0] != MAGIC
                or fields[5] != self.local[i]
            ):
                return ()
        if n:
            _ring_read(buf, mv, at, ring, (pos + _REC) % ring, n)
        self._free_to(i, (pos + _REC + n + _REC - 1) // _REC * _REC)
        return fields

    def _free_to(self, i: int, pos: int) -> None:
        """Give local rank i's ring back up to ``pos`` (lock held): our tail published,
        then a fence before reading its blocked flag (Dekker's pattern, as the putter),
        and its bell rung when it waits for room. (take_prefix writes this out: its
        fence is the lock's release.)"""
        self.tails[i] = pos
        _, _, quads, words, _, _, bi, ti = self.ins[i]
        quads[ti] = pos
        self._fence_acquire()
        self._fence_release()
        if words[bi]:  # the sender waits for room
            self.ring_bell(i)

    def take_prefix(
        self, i: int, expect: bytes, buf: memoryview, guard: tuple[Sized, Sized] = ((), ())
    ) -> tuple[int, int] | tuple[()] | None:
        """Consume the next message local rank i sent us when it is complete in the ring,
        its packed header starts with ``expect`` (the first 28 bytes -- MAGIC to
        ``step`` -- or more: 32 names ``root`` too) and its payload fits ``buf`` (a
        writable flat byte memoryview): the payload goes to ``buf`` and (``root``,
        payload bytes) are returned. None: no message yet; ``()``: the next one is
        another (route it: :meth:`progress`), or one of the two containers of ``guard``
        is not empty (the caller's own queues: something could match first). Takes the lock. The MPI
        engine's blocking receive: one comparison of the packed header instead of its
        fields (:meth:`take`), everything inline."""
        inner = self._owned()
        self._acquire()
        try:
            if self.closed or guard[0] or guard[1]:
                return ()
            mm, mv, quads, words, at, hi, bi, ti = self.ins[i]
            pos = self.tails[i]
            head = quads[hi]
            if head == pos:
                return None
            if self.current[i] is not None:
                return ()
            ring = self.ring
            a = at + pos % ring  # a multiple of 8 (records are 64-byte aligned)
            if len(expect) == 32:  # names ``root``
                h, n = _HEAD32(mm, a)
                if h != expect:
                    return ()
                root = words[(a >> 2) + 7]
                root = root if root < 0x80000000 else root - 0x100000000
            else:
                h, root, n = _HEAD28(mm, a)
                if h != expect:
                    return ()
            if n > len(buf) or n > head - pos - _REC:
                return ()
            if n:
                b = a + _REC  # records start 64-byte aligned: at most the ring's end
                if b + n <= at + ring:
                    buf[:n] = mv[b : b + n]
                else:
                    _ring_read(buf, mv, at, ring, b - at, n)
            pos += _REC + ((n + _REC - 1) & -_REC)
            self.tails[i] = pos
            quads[ti] = pos
            got = root, n
            if inner:
                self._fence_acquire()
                self._fence_release()
                if words[bi]:  # the sender waits for room
                    self.ring_bell(i)
                return got
        finally:
            self._release()
        # the release was the barrier between the tail's store and the blocked flag's
        # load (see putter): one fence less a message
        if words[bi]:  # the sender waits for room (rare: under the lock again)
            with self.lock:
                if not self.closed:
                    self.ring_bell(i)
        return got

    def take_run(self, i: int, src: int, recvs: list, mark: Any) -> Any:
        """Consume the messages next in local rank i's ring (global rank ``src``) into the
        receives at the front of ``recvs``, in order, while each is for ``src`` and its
        message is complete in the ring, starts with its ``expect`` and fits its
        ``direct`` (see :meth:`take_prefix`; items: objects with ``src``, ``expect``
        -- None: not to be taken so -- and ``direct``). Each one taken gets ``tag``
        (the header's ``root``; kept when its 32-byte ``expect`` named it), ``data``
        (the filled part of ``direct``) and, last, ``msg = mark``, and leaves
        ``recvs`` (the run at once, before the lock is released). Returns True once
        ``recvs`` is empty, None when its first item's message has not come, ``()``
        when it cannot be taken so (another message, one too large, or one still
        streaming through the ring: route it). One lock, one publication of the tail
        for the run (the MPI engine's window of Irecv: :meth:`Engine.serve`, whose
        posted receives become their own message records); the caller holds its own
        lock over ``recvs``."""
        self._acquire()
        try:
            if self.closed or self.current[i] is not None:
                return ()
            mm, mv, quads, words, at, hi, bi, ti = self.ins[i]
            ring = self.ring
            start = self.tails[i]
            head = quads[hi]
            left = head - start - _REC  # bytes in the ring past the next record's header
            stop = at + ring  # the ring's end in the mapping
            a = at + start % ring  # the next record in the mapping
            f: Any = True
            k = 0
            # a window's receives mostly share their expect and buffer view: their
            # lengths are looked up once for a run of the same objects
            last_expect = last_buf = head32 = None
            size = 0
            try:
                if recvs and recvs[0].src != src:
                    return ()
                for item in recvs:  # taken ones leave recvs at the end (one del for the run)
                    expect = item.expect
                    # (a later item for another rank: its expect names that rank, which
                    # no header in this ring has)
                    if expect is None:
                        f = ()
                        break
                    if left < 0:  # no record
                        f = None if item.src == src else ()
                        break
                    if expect is not last_expect:
                        head32 = len(expect) == 32
                        unpack = _HEAD32 if head32 else _HEAD28
                        last_expect = expect
                    if head32:
                        h, n = unpack(mm, a)
                    else:
                        h, root, n = unpack(mm, a)
                    if h != expect:
                        f = ()
                        break
                    buf = item.direct
                    if buf is not last_buf:
                        size = len(buf)
                        last_buf = buf
                    if n > size or n > left:  # a partial one streams: route it
                        f = ()
                        break
                    if n:
                        b = a + _REC  # records start 64-byte aligned: at most ``stop``
                        e = b + n
                        if e <= stop:
                            buf[:n] = mv[b:e]
                        else:
                            _ring_read(buf, mv, at, ring, b - at, n)
                    r = (n + _PAD) & _ALIGN  # the record's bytes
                    left -= r
                    a += r
                    if a >= stop:
                        a -= ring
                    k += 1
                    if not head32:  # else ``root`` was compared: it is item.tag
                        item.tag = root
                    item.data = buf if n == size else buf[:n]
                    item.msg = mark  # last: a thread that sees it finds the rest in place
            finally:  # also when a copy raises (a released buffer): what was taken is gone
                if k:
                    del recvs[:k]
                    self._free_to(i, head - left - _REC)
            return f
        finally:
            self._release()

    def poll_take(self, take: Callable[..., Any], *args: Any) -> Any:
        """``take(*args)`` until it returns something else than None, again after each
        ring of the bell, busy-polling for at most ``busy`` seconds (not at all when
        oversubscribed); returns its last result (None: nothing came in time). The
        blocking receives' fast path (``take``: :meth:`take_prefix`, or a :meth:`take`
        under the lock)."""
        seen = self.bell[0]  # before the first look: whatever is published after it rings
        got = take(*args)
        if got is not None:
            return got
        return self.poll_after(seen, take, *args)

    def poll_after(self, seen: int, take: Callable[..., Any], *args: Any) -> Any:
        """:meth:`poll_take` after its first look came back None, ``seen`` the bell read
        before that look (a caller that made the look itself: one call layer less a
        message that is there)."""
        bell = self.bell
        got = None
        busy = self.busy
        if not busy:
            return None
        end = 0.0
        while got is None:
            for _ in _POLLS:
                if bell[0] != seen:
                    break
            else:
                now = time.perf_counter()
                if not end:
                    end = now + busy
                elif now >= end:
                    return None
                continue
            seen = bell[0]
            got = take(*args)
        return got

    def claim(self, src: int) -> None:
        """A receive accepted a message of global rank ``src`` that the links routed to
        the transport (see :meth:`settled`); any thread."""
        i = self.index.get(src)
        if i is not None:
            with self._count_lock:
                self.claimed[i] += 1

    def settled(self, i: int) -> bool:
        """True when every message of local rank i routed to the transport (the
        collectives' send/recv) was accepted by a receive: none is kept as unexpected,
        so the next one in the ring is the oldest not received (lock held). A message
        no receive accepts (a mismatch, a destroyed group) keeps it False: the fast
        path then stays off for that sender."""
        return self.kept[i] == self.claimed[i]

    def _pull(self, i: int) -> bool:
        """Consume what local rank i published in our inbox (lock held); True if any."""
        mm, mv, quads, words, at, hi, bi, ti = self.ins[i]
        head = quads[hi]
        pos = self.tails[i]
        if head == pos:
            return False
        ring = self.ring
        while pos < head:
            cur = self.current[i]
            if cur is None:
                fields = HEADER.unpack_from(mm, at + pos % ring)
                pos += _REC
                if fields[0] != MAGIC or fields[5] != self.local[i]:
                    raise CollectiveError(f"corrupt shared-memory message from rank {self.local[i]}")
                raw_route = self.raw_routes.get(fields[6])
                if raw_route is not None:
                    target, finish = raw_route(fields)
                else:
                    hdr = Header(*fields[1:])
                    route = self.routes.get(hdr.group, self.default_route)
                    assert route is not None  # set by whoever created the links
                    self.kept[i] += 1  # before routing: the route may claim it (see settled)
                    target, finish = route(hdr)
                n = fields[11]  # nbytes
                if n <= head - pos:  # all there (small messages): no _In
                    if n:
                        _ring_read(target, mv, at, ring, pos % ring, n)
                        pos = (pos + n + _REC - 1) // _REC * _REC
                    finish()
                    continue
                cur = self.current[i] = _In(target, finish)
            tgt = cur.target
            n = min(head - pos, len(tgt) - cur.got)
            a = pos % ring
            first = min(n, ring - a)
            g = cur.got
            tgt[g : g + first] = mv[at + a : at + a + first]
            if n > first:
                tgt[g + first : g + n] = mv[at : at + n - first]
            cur.got = g + n
            pos += n
            if cur.got == len(tgt):
                pos = (pos + _REC - 1) // _REC * _REC
                self.current[i] = None
                cur.finish()
        self.tails[i] = pos
        quads[ti] = pos
        self._fence.acquire()
        self._fence.release()
        if words[bi]:  # the sender waits for room
            self.ring_bell(i)
        return True

    def progress(self) -> None:
        """Move queued sends on and take every arrived message (any thread)."""
        with self.lock:
            if self.closed:
                return
            queues = self.queues
            for i in self.others:
                if queues[i]:
                    self._push(i)
                self._pull(i)

    # -- waiting

    def wait(
        self, cond: Callable[[], bool], deadline: float, peers: Sequence[int | None] = (), spin: bool = True
    ) -> bool:
        """Make progress until ``cond()``; True then, False at ``deadline``
        (``time.monotonic()`` seconds). Raises PeerLostError when a local rank of
        ``peers`` (global ranks; None: not checked) no longer exists, CollectiveError
        once closed. Busy-polls for ``busy`` seconds first (``spin``; False when the
        caller just did, e.g. :meth:`poll_take`, or waits again after a slice), then
        sleeps on the bell (see the module docstring)."""
        bell = self.bell
        seen = bell[0]
        self.progress()
        if cond():
            return True
        if spin and self.busy:  # busy-poll: the peer runs on another core
            end = time.perf_counter() + self.busy
            while True:
                for _ in _POLLS:
                    if bell[0] != seen:
                        break
                else:
                    if time.perf_counter() < end:
                        continue
                    break
                seen = bell[0]
                self.progress()
                if cond():
                    return True
        yield_spin = self.yield_spin
        for _ in range(self.spin):
            if bell[0] == seen:
                if yield_spin:
                    os.sched_yield()
                continue
            seen = bell[0]
            self.progress()
            if cond():
                return True
        addr = self.boxes[self.me].bell_addr
        ts = self._ts
        check = 0.0
        while True:
            seen = bell[0]
            bell[1] = 1
            self._fence_now()
            try:
                self.progress()
                if cond():
                    return True
                if self.closed:
                    raise CollectiveError("transport is closed")
                now = time.monotonic()
                if now >= deadline:
                    return False
                if now >= check:
                    check = now + _SLICE
                    why = self._gone(peers)
                    if why is not None:
                        # a peer that exited right after sending left its messages in
                        # our rings: they are delivered (MPI, torch), not dropped
                        self.progress()
                        if cond():
                            return True
                        raise PeerLostError(why)
                left = min(deadline - now, _SLICE)
                ts.tv_sec = int(left)
                ts.tv_nsec = int((left - int(left)) * 1e9)
                self._futex(_SYS_FUTEX, addr, 0, seen, ctypes.addressof(ts), None, 0)
            finally:
                bell[1] = 0

    def _gone(self, peers: Sequence[int | None]) -> str | None:
        """Why the first of ``peers`` whose process is gone is lost, or None."""
        for p in peers:
            if p is not None and (why := self.lost(p)) is not None:
                return f"rank {p} died: {why}"
        return None

    def lost(self, peer: int) -> str | None:
        """Why local rank ``peer`` is lost (its process is gone), or None."""
        i = self.index.get(peer)
        if i is None:
            return None
        pid = self.boxes[i].quads[1]
        return f"its process (pid {pid}) no longer exists" if pid and not _alive(pid) else None

    def close(self) -> None:
        """Unlink our inbox and unmap every inbox; queued sends fail."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if Request.notify == self.notify:
                Request.notify = None
            err = CollectiveError("transport is closed")
            for q in self.queues:
                for item in q:
                    if item.req is not None:
                        item.req.complete(err)
                q.clear()
            own = self.boxes[self.me]
            if own.path:
                _unlink(own.path)
            self.outs, self.ins = [], []  # their views would keep the mappings
            self.bell = memoryview(bytearray(8)).cast("I")  # (a late waiter reads a dead bell)
            self._putters.clear()
            for box in self.boxes:
                box.close()


def links_for(rt: Any) -> ShmLinks | None:
    """The runtime's ShmLinks, created at the first use (None when no other rank of
    this node may share memory with this one). Attached to ``rt.transport.local``, so
    the transport sends to local peers through it and closes it."""
    t = rt.transport
    if t.local_checked:
        return t.local
    with t.local_lock:
        if not t.local_checked:
            links = None
            node = getattr(rt, "_shm_node", "")
            if node.startswith("L:") and shm_available():
                ids = rt.node_ids()
                local = [r for r in range(rt.world_size) if ids[r] == node]
                if len(local) > 1:
                    ring = int(os.environ.get("DISTLAUNCH_SHM_P2P_RING", RING))
                    try:
                        links = ShmLinks(rt, local, rt.shm_config, ring)
                    except ShmFullError as e:  # some inbox's verdict: every local rank uses TCP
                        if rt.rank == local[0]:
                            warn_full(e)
                        for g in local:  # the inboxes reserved before the one that failed
                            _unlink_data(os.path.join("/dev/shm", segment_name(rt.secret, g)))
                    else:
                        links.default_route = t.local_route
                        Request.notify = links.notify
            t.local = links
            t.local_checked = True
    return t.local
