"""Process groups, per-operation contexts, ``Work`` handles, and failure handling.

Each collective call gets the group's next sequence number in the calling thread, so
program order defines the order on every rank. Blocking calls run in the calling thread
(after the group's pending async collectives); ``async_op=True`` collectives run, in
order, on one executor thread per group. Point-to-point operations bypass the executor.

Failure handling (see docs/collectives.md):

- every wait uses the operation's deadline (start + group timeout); on expiry the rank
  asks every group member for its progress (a STATUS request over the transport) and
  raises CollectiveTimeoutError naming the ranks that did not call the operation (or
  PeerLostError for ranks that cannot be reached);
- a mismatch detected from a message header, or a lost peer, is reported to every group
  member with an ABORT message, so ranks blocked in the same operation raise the same
  error class at once;
- after any failure the group is *broken*: later calls on it raise the first error's
  class immediately (destroy and re-initialise to continue).
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import NamedTuple

from .errors import (CollectiveArgumentError, CollectiveError, CollectiveMismatchError,
                     CollectiveTimeoutError, PeerLostError)
from .ops import ReduceOp
from .wire import ABORT, ABORT_MISMATCH, ABORT_PEER_LOST, COLL, DTYPE_NAMES, NO_REDOP, OP_CODES, OP_NAMES, Header

DEFAULT_TIMEOUT = 1800.0
_STATUS_WAIT = 2.0  # seconds to collect peers' status after a timeout
_ABORT_GRACE = 0.25  # seconds a lost peer's ABORT may trail its connection's end


def to_seconds(timeout, name: str = "timeout") -> float | None:
    """float seconds from None, a number or a datetime.timedelta."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise CollectiveArgumentError(f"{name} must be a positive number of seconds or a timedelta, not {timeout!r}")
    return float(timeout)


class _OpTimeout(Exception):
    """Internal: a wait ran past the deadline; ``peers`` are the group ranks waited on."""

    def __init__(self, peers):
        super().__init__(peers)
        self.peers = peers


class Work:
    """Handle of an operation started with ``async_op=True`` / ``isend`` / ``irecv``
    (as ``torch.distributed.Work``).

    ``wait(timeout=None)`` blocks until the operation finished (``timeout``: seconds or
    timedelta, default the group timeout) and returns True; it re-raises the operation's
    CollectiveError, or raises CollectiveTimeoutError if it is still running after
    ``timeout`` (the operation itself keeps its own deadline). ``is_completed()`` never
    blocks.
    """

    def __init__(self, name: str, timeout: float):
        self._name = name
        self._timeout = timeout
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._result = None

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout=None) -> bool:
        t = self._timeout if timeout is None else to_seconds(timeout)
        if not self._event.wait(t):
            raise CollectiveTimeoutError(f"{self._name} did not complete within {t:g} s")
        if self._error is not None:
            raise self._error
        return True

    def result(self):
        """Wait, then return the operation's result (the source rank for irecv)."""
        self.wait()
        return self._result


class _RequestWork(Work):
    """Work of one point-to-point request; completes with the transport request."""

    def __init__(self, name, timeout, req, on_done):
        super().__init__(name, timeout)
        self._req = req
        self._on_done = on_done  # (req, timed_out) -> result, raises on failure
        self._lock = threading.Lock()

    def is_completed(self) -> bool:
        return self._req.done

    def wait(self, timeout=None) -> bool:
        t = self._timeout if timeout is None else to_seconds(timeout)
        with self._lock:
            if not self._event.is_set():
                if not self._req.wait(t):
                    raise CollectiveTimeoutError(self._on_done(self._req, True))
                try:
                    self._finish(self._on_done(self._req, False))
                except CollectiveError as e:
                    self._finish(error=e)
        if self._error is not None:
            raise self._error
        return True


class _Executor:
    """Runs a group's async collectives in submission order on one daemon thread."""

    def __init__(self, name):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._cv = threading.Condition()
        self._thread = None

    def submit(self, fn, work: Work):
        with self._cv:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, work))

    def stop(self):
        """Let the thread exit once the queued jobs ran, and wait for it (up to 5 s) so
        that no thread of ours still holds user buffers (e.g. torch tensors) when the
        interpreter shuts down."""
        if self._thread is not None:
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=5)
            self._thread = None

    def _loop(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, work = job
            try:
                work._finish(fn())
            except BaseException as e:  # delivered to whoever waits on the Work
                work._finish(error=e)
            del job, fn, work  # do not keep the last operation's buffers alive
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def drain(self):
        """Block until every submitted job finished (each has its own deadline)."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)


class ProcessGroup:
    """A set of global ranks that run collectives together (torch's ProcessGroup).

    ``ranks``: sorted global ranks; ``rank``: this process's rank in the group;
    ``size``; ``timeout``: seconds for every operation on the group.
    """

    def __init__(self, runtime, gid: int, ranks: list, timeout: float, name: str):
        self.runtime = runtime
        self.gid = gid
        self.ranks = list(ranks)
        self.size = len(ranks)
        self.rank = ranks.index(runtime.rank)
        self.timeout = timeout
        self.name = name
        self._index = {g: i for i, g in enumerate(ranks)}
        self._seq = 0
        self._current_op = 0
        self._seq_lock = threading.Lock()
        self._executor = _Executor(f"distlaunch-coll-{name}")
        self.broken: BaseException | None = None
        self.completed = 0  # sequence number of the last finished collective
        self._shm = None      # shm.ShmGroup when every member is on this node
        self._hier = None     # hierarchy.Hierarchy when members span nodes, some shared
        self._shm_decided = False
        self.parent = None    # the group a node-local / leader sub-group serves
        self._fast_ctx = None  # OpContext reused by run_small_shm

    def __repr__(self):
        return f"ProcessGroup({self.name}, ranks={self.ranks})"

    def shutdown(self):
        """Stop the group's async executor thread and unmap/unlink its shared memory
        (on destroy)."""
        self._executor.stop()
        self._fast_ctx = None  # its cached call may hold views of the segment
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._hier is not None:
            self._hier.shutdown()

    def shm_channel(self):
        """The group's shared-memory channel, or None (members on several nodes, shared
        memory disabled, or a single rank). Decided and created by the first collective
        (every member decides alike, from the node ids all ranks published)."""
        if not self._shm_decided:
            self._shm_decided = True
            name = self.runtime.shm_name(self)
            if name is not None:
                from .shm import ShmGroup
                self._shm = ShmGroup(self, name)
            elif self.parent is None and self.size > 2:
                keys = self.runtime.node_keys(self)
                shared = [k for k in set(keys) if k.startswith("L:") and keys.count(k) > 1]
                if shared and len(set(keys)) > 1:
                    from .hierarchy import Hierarchy
                    self._hier = Hierarchy(self, keys)
        return self._shm

    # -- rank translation

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        try:
            return self._index[global_rank]
        except (KeyError, TypeError):
            raise CollectiveArgumentError(f"{what}={global_rank!r} is not a rank of {self.name} "
                                          f"(ranks {self.ranks})") from None

    def check_group_rank(self, group_rank, what: str) -> int:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size:
            raise CollectiveArgumentError(f"{what}={group_rank!r} is outside 0..{self.size - 1} of {self.name}")
        return group_rank

    # -- running operations

    def status(self):
        """(last sequence number called, its op code): answered to diagnosing peers."""
        return self._seq, self._current_op

    def check_usable(self):
        if self.broken is not None:
            raise _reraise(self.broken, f"{self.name} is unusable after an earlier failure "
                                        f"(destroy and re-initialise the process group)")

    def run(self, name: str, body, async_op: bool, timeout: float | None = None, shm_body=None, hier_body=None,
            **meta):
        """Run collective ``body(ctx)`` as the group's next operation; blocking unless
        ``async_op`` (then returns a Work). ``meta``: dtype/count/root/redop for the
        header check. On a group with shared memory ``shm_body(ctx)`` runs instead, or,
        when None, a shared-memory mismatch check (a barrier) and then ``body``. On a
        group spanning nodes with shared memory inside them, ``hier_body(ctx,
        hierarchy)`` runs if given (else ``body``, flat over TCP)."""
        self.check_usable()
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
            self._current_op = OP_CODES[name]

        def execute():
            ctx = OpContext(self, name, seq, timeout=timeout, **meta)
            try:
                ctx.shm = self._shm if self._shm_decided else self.shm_channel()
                if ctx.shm is None and self._hier is not None and hier_body is not None:
                    result = hier_body(ctx, self._hier)
                    self.completed = seq
                    return result  # the sub-operations checked their own leftovers
                if ctx.shm is None:
                    result = body(ctx)
                elif shm_body is not None:
                    result = shm_body(ctx)
                    self.completed = seq
                    return result  # no TCP messages: nothing can be left over
                else:
                    from .shm import preamble
                    preamble(ctx)
                    result = body(ctx)
                self.completed = seq
                # every message of a correct collective is received inside it: one left
                # over means its sender ran a different op/root/size
                ctx.check_leftovers()
                return result
            except BaseException as e:
                raise self._failed(ctx, e) from (None if isinstance(e, _OpTimeout) else e)
            finally:
                ctx.cancel_pending()

        if async_op:
            work = Work(f"{name} #{seq} on {self.name}", None)  # the op has its own deadline
            self._executor.submit(execute, work)
            return work
        if self._executor._pending:  # only this thread submits: a stale 0 is impossible
            self._executor.drain()
        return execute()

    def run_small_shm(self, call, fn, *args):
        """Blocking fast path of ``run`` for a small operation on a shared-memory group
        (the caller checked ``self._shm``): ``fn(ctx, *args)`` with a reused context, no
        closures, no TCP leftovers to check. ``call``: a SmallCall (or any object with
        its fields) describing the call for mismatch checks; reusing the same object for
        repeated calls skips copying it. Same sequence numbers, deadline and failure
        handling as ``run``; returns None."""
        if self.broken is not None:
            self.check_usable()
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
            self._current_op = call.op
        if self._executor._pending:
            self._executor.drain()
        ctx = self._fast_ctx
        if ctx is None:
            ctx = self._fast_ctx = OpContext(self, call.name, seq)
            ctx.shm = self._shm
        if ctx.call is not call:
            ctx.call = call
            ctx.name, ctx.op, ctx.dtype, ctx.count = call.name, call.op, call.dtype, call.count
            ctx.root, ctx.redop = call.root, call.redop
        ctx.seq = seq
        ctx.deadline = time.monotonic() + ctx.timeout
        try:
            fn(ctx, *args)
        except BaseException as e:
            raise self._failed(ctx, e) from (None if isinstance(e, _OpTimeout) else e)
        self.completed = seq

    def _failed(self, ctx, e) -> BaseException:
        """Turn a failure inside an operation into the exception to raise, mark the group
        broken, and tell the other members when they could otherwise hang."""
        what = f"{ctx.name} #{ctx.seq} on {self.name} (rank {self.runtime.rank})"
        if isinstance(e, PeerLostError) and self.broken is None:
            # a peer that found a mismatch sends ABORT and may exit right away; its
            # ABORT can arrive just after we saw its connection close: report the cause
            end = time.monotonic() + _ABORT_GRACE
            while self.broken is None and time.monotonic() < end:
                time.sleep(0.005)
        if self.broken is not None:
            # a peer's ABORT (or an earlier failure) broke the group: that is the root
            # cause, whatever this rank then ran into (e.g. the aborting peer has exited)
            b = self.broken
            err = b if getattr(b, "seq", None) == ctx.seq else _reraise(
                b, f"{what}: {self.name} is unusable after an earlier failure")
        elif isinstance(e, _OpTimeout):
            err = self._diagnose_timeout(ctx, what, e.peers)
        elif isinstance(e, CollectiveError) and getattr(e, "_from_abort", False):
            err = e
        elif isinstance(e, (CollectiveMismatchError, PeerLostError)):
            err = type(e)(f"{what}: {e}")
            reason = ABORT_MISMATCH if isinstance(e, CollectiveMismatchError) else ABORT_PEER_LOST
            self._abort_members(ctx.seq, reason, str(err))
        elif isinstance(e, CollectiveError):
            err = e
        else:
            err = e  # a bug or KeyboardInterrupt: still leave the group broken
        if self.broken is None:
            self.broken = err
            if isinstance(err, BaseException):
                err.seq = ctx.seq
        return err

    def _abort_members(self, seq, reason, text):
        from . import shm
        code = (shm.ABORT_MISMATCH if reason == ABORT_MISMATCH else
                shm.ABORT_PEER_LOST if reason == ABORT_PEER_LOST else shm.ABORT_OTHER)
        for g in [self] + (self._hier.children() if self._hier is not None else []):
            if g._shm is not None:
                g._shm.abort(code)
        deadline = time.monotonic() + _STATUS_WAIT
        hdr = Header(ABORT, 0, reason, NO_REDOP, self.runtime.rank, self.gid, seq, 0, -1, 0, 0)
        payload = text.encode()[:65536]
        transport = self.runtime.transport
        for g in self.ranks:
            if g != self.runtime.rank:
                transport.send_control(g, hdr._replace(nbytes=len(payload)), payload, deadline)

    def _diagnose_timeout(self, ctx, what, waiting_on) -> BaseException:
        others = [g for g in self.ranks if g != self.runtime.rank]
        status = self.runtime.transport.query_status(others, self.gid, time.monotonic() + _STATUS_WAIT)
        missing, notes, lost = [], [], []
        for g in others:
            st = status.get(g)
            if st is None:
                lost.append(g)
            elif st[0] < ctx.seq:
                missing.append(g)
                last = f"#{st[0]} {OP_NAMES[st[1]]}" if st[0] > 0 else "nothing"
                notes.append(f"rank {g} last called {last}")
        waiting = [self.ranks[p] for p in waiting_on]
        msg = f"{what} timed out after {ctx.timeout:g} s"
        if missing:
            msg += f": ranks {missing} did not arrive ({'; '.join(notes)})"
        if lost:
            msg += f"; ranks {lost} are unreachable (dead?)"
        if not missing and not lost:
            msg += ": every rank arrived, but messages did not (a rank is stuck or overloaded)"
        msg += f"; this rank was waiting for ranks {waiting}"
        cls = PeerLostError if lost and not missing else CollectiveTimeoutError
        err = cls(msg)
        err.missing_ranks = missing
        err.unreachable_ranks = lost
        return err

    def on_late(self, hdr):
        """Progress thread: rank ``hdr.src`` sent data for collective ``hdr.seq``, which this
        rank already finished without expecting it: the ranks disagreed (e.g. on the root).
        Break the group and tell the others (on a helper thread: never block progress)."""
        if hdr.seq > self.completed or self.broken is not None:
            return
        err = CollectiveMismatchError(
            f"{self.name} (rank {self.runtime.rank}): rank {hdr.src} sent data for "
            f"{OP_NAMES[hdr.op] if hdr.op < len(OP_NAMES) else hdr.op} #{hdr.seq} "
            f"(root={self.ranks[hdr.root] if 0 <= hdr.root < self.size else hdr.root}) that this rank "
            f"did not expect: ranks disagree on the operation, its root or its size")
        err.seq = hdr.seq
        self.broken = err
        threading.Thread(target=self._abort_members, args=(hdr.seq, ABORT_MISMATCH, str(err)),
                         daemon=True).start()

    def on_abort(self, hdr, text):
        """Progress thread: a peer aborted operation ``hdr.seq``; fail ours."""
        cls = {ABORT_MISMATCH: CollectiveMismatchError, ABORT_PEER_LOST: PeerLostError}.get(hdr.op, CollectiveError)
        err = cls(f"rank {hdr.src} aborted {self.name}: {text}")
        err._from_abort = True
        err.seq = hdr.seq
        if self.broken is None:
            self.broken = err
        self.runtime.transport.fail_owner(self.gid, err)
        for c in (self._hier.children() if self._hier is not None else []):
            if c.broken is None:
                c.broken = err
            self.runtime.transport.fail_owner(c.gid, err)


class SmallCall(NamedTuple):
    """A call as run_small_shm records it (the fields of OpContext it sets)."""
    name: str
    op: int
    dtype: int
    count: int
    root: int = -1
    redop: int = NO_REDOP


def _reraise(cause: BaseException, message: str) -> BaseException:
    cls = type(cause) if isinstance(cause, CollectiveError) else CollectiveError
    err = cls(f"{message}; first error: {cause}")
    err.__cause__ = cause
    return err


class OpContext:
    """One running collective: posts its messages with the right header and expectation,
    and waits for them against the operation's deadline."""

    def __init__(self, group: ProcessGroup, name, seq, dtype=None, count=0, root=-1, redop=None,
                 timeout=None):
        self.group = group
        self.name = name
        self.seq = seq
        self.op = OP_CODES[name]
        self.dtype = dtype or 0
        self.count = count
        self.root = root
        self.redop = NO_REDOP if redop is None else int(redop)
        self.timeout = group.timeout if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout
        self._posted = []
        self.shm = None  # the group's ShmGroup while the operation runs on shared memory
        self.call = None  # the SmallCall a reused context (run_small_shm) describes
        self._transport = group.runtime.transport
        self._me = group.runtime.rank

    def _header(self, step, nbytes):
        return Header(COLL, self.dtype, self.op, self.redop, self._me, self.group.gid, self.seq,
                      step, self.root, self.count, nbytes)

    def _describe(self, op, dtype, count, root, redop):
        parts = [f"dtype={DTYPE_NAMES.get(dtype, '?')}", f"count={count}"]
        if root >= 0:
            parts.append(f"root={self.group.ranks[root] if root < self.group.size else root}")
        if redop != NO_REDOP:
            parts.append(f"op={ReduceOp(redop).name if redop in ReduceOp._value2member_map_ else redop}")
        return f"{OP_NAMES[op] if op < len(OP_NAMES) else op}({', '.join(parts)})"

    def _check(self, step):
        def check(h):
            if (h.op, h.dtype, h.count, h.root, h.redop, h.step) == (
                    self.op, self.dtype, self.count, self.root, self.redop, step):
                return None
            theirs = self._describe(h.op, h.dtype, h.count, h.root, h.redop)
            mine = self._describe(self.op, self.dtype, self.count, self.root, self.redop)
            if theirs == mine:
                theirs += f" at protocol step {h.step}"
                mine += f" at protocol step {step}"
            return CollectiveMismatchError(f"rank {h.src} called {theirs} but rank {self._me} called {mine}")
        return check

    def send(self, peer: int, payload: memoryview, step: int = 0):
        """Post ``payload`` (bytes view, kept unchanged until waited) to group rank ``peer``."""
        try:
            req = self._transport.isend(self.group.ranks[peer], self._header(step, len(payload)), payload,
                                        self.deadline, owner=self.group.gid)
        except CollectiveTimeoutError:
            raise _OpTimeout([peer]) from None
        req.grank = peer
        self._posted.append(req)
        self._check_broken()
        return req

    def recv(self, peer: int, buf: memoryview, step: int = 0):
        """Post a receive from group rank ``peer`` into ``buf`` (bytes view)."""
        req = self._transport.irecv(self.group.ranks[peer], (COLL, self.group.gid, self.seq), buf,
                                    self._check(step), owner=self.group.gid)
        req.grank = peer
        self._posted.append(req)
        self._check_broken()
        return req

    def _check_broken(self):
        # an ABORT may have arrived before this request was posted
        if self.group.broken is not None:
            raise self.group.broken

    def wait(self, *reqs):
        """Wait for ``reqs``; raises their error, or _OpTimeout past the deadline."""
        for r in reqs:
            if not r.wait(max(0.0, self.deadline - time.monotonic())):
                raise _OpTimeout(sorted({q.grank for q in reqs if not q.done}))
            if r.error is not None:
                raise r.error

    def check_leftovers(self):
        late = self._transport.take_leftovers((COLL, self.group.gid, self.seq))
        if late:
            h = late[0]
            theirs = self._describe(h.op, h.dtype, h.count, h.root, h.redop)
            mine = self._describe(self.op, self.dtype, self.count, self.root, self.redop)
            raise CollectiveMismatchError(f"rank {h.src} sent data for {theirs} that this rank did not expect "
                                          f"in {mine}")

    def cancel_pending(self):
        for r in self._posted:
            if not r.done and not r.is_send:
                self._transport.cancel(r)
        self._posted.clear()
