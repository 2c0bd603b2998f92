"""Process groups: sequence numbers, the choice of backend, one method per collective,
and failure handling.

A :class:`ProcessGroup` method per collective (``all_reduce(arr, op, async_op)``, ...)
takes flat, C-contiguous numpy arrays already checked by the caller (the public API in
:mod:`.api`, or a torch ProcessGroup wrapper) and group ranks, and returns None or, with
``async_op=True``, a :class:`~.work.Work`. The collective itself runs on the group's
:class:`~.algorithms.backend.Backend`, chosen once by the first collective (shared memory when
every member is on this node, hierarchical when members span nodes and some share one,
else TCP).

Each collective call gets the group's next sequence number in the calling thread, so
program order defines the order on every rank. Blocking calls run in the calling thread
(after the group's pending async collectives); ``async_op=True`` collectives run, in
order, on one executor thread per group. Point-to-point operations bypass the executor;
between ranks of one node, a send that fits the peer's ring is written at once and a
blocking receive takes it straight from the ring when nothing could come before it
(:meth:`ProcessGroup.isend`, :meth:`ProcessGroup.recv`; the MPI engine's fast paths).

Failure handling (see docs/collectives.md):

- every wait uses the operation's deadline (start + group timeout); on expiry the rank
  asks every group member for its progress (a STATUS request over the transport) and
  raises CollectiveTimeoutError naming the ranks that did not call the operation (or
  PeerLostError for ranks that cannot be reached);
- a mismatch detected from a message header, a lost peer, or a timeout is reported to
  every group member with an ABORT message, so ranks blocked in the same operation raise
  the same error class at once instead of each waiting out its own deadline, and ranks
  that have not reached it yet raise at their next call (a timeout's ABORT carries the
  missing and unreachable ranks);
- after any failure the group is *broken*: later calls on it raise the first error's
  class immediately (destroy and re-initialise to continue).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import progress
from .algorithms.backend import TCP, Backend, ShmBackend
from .algorithms.hierarchy import HierarchicalBackend
from .buffers import byte_view
from .context import DEFAULT_TIMEOUT, Members, OpContext, OpTimeout, SmallCall, to_seconds
from .errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from .ops import ReduceOp, check_op
from .optable import OPS, algorithm
from .transport import Request
from .transport.shm import ShmChannel, ShmFullError, SmallPlan, call_record, warn_full
from .transport.shm_p2p import links_for
from .wire import (
    ABORT,
    ABORT_MISMATCH,
    ABORT_OTHER,
    ABORT_PEER_LOST,
    ABORT_TIMEOUT,
    DTYPE_CODES,
    DTYPE_NAMES,
    HEADER,
    MAGIC,
    NO_REDOP,
    OP_CODES,
    OP_NAMES,
    P2P,
    Header,
)
from .work import Executor, RequestWork, Work

__all__ = ["ProcessGroup", "Work", "DEFAULT_TIMEOUT", "to_seconds"]

_monotonic_ns = time.monotonic_ns
_STATUS_WAIT = 2.0  # seconds to collect peers' status after a timeout
_ABORT_GRACE = 0.25  # seconds a lost peer's ABORT may trail its connection's end
_BARRIER = SmallCall("barrier", OP_CODES["barrier"], 0, 0)
_ABORT_CLASSES = {
    ABORT_MISMATCH: CollectiveMismatchError,
    ABORT_PEER_LOST: PeerLostError,
    ABORT_TIMEOUT: CollectiveTimeoutError,
}

# body(backend, ctx) -> result: one collective on the group's backend
Body = Callable[[Backend, OpContext], Any]


def _shm_algorithm(name: str) -> Callable[..., None]:
    """Operation ``name``'s shared-memory algorithm (registered when algorithms.backend
    imported algorithms.shm)."""
    fn = algorithm(OPS[name], "shm")
    assert fn is not None, name
    return fn


# the blocking small-operation fast path's algorithms (broadcast's: a call without a plan yet)
_SHM_BARRIER = _shm_algorithm("barrier")
_SHM_BROADCAST = _shm_algorithm("broadcast")

_SEND = OP_CODES["send"]


class _Done(Work):
    """A Work complete when made (a send written at once, a receive taken at once):
    no event to make or wait on; the result is ``result``."""

    def __init__(self, result: Any = None) -> None:
        self._name, self._timeout, self._error, self._result = "p2p", None, None, result

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


_SENT = _Done()  # shared by every send written at once


class _RecvWork(RequestWork):
    """The Work of a receive posted on the transport; withdrawn from the group's open
    receives (see ProcessGroup._take) when cancelled."""

    def __init__(
        self,
        group: ProcessGroup,
        what: str,
        req: Request,
        on_done: Callable[[Request, bool], Any],
        spin: bool = True,
    ):
        super().__init__(what, group.timeout, req, group.runtime.transport, on_done, spin)
        self._group = group

    def cancel(self) -> None:
        super().cancel()
        if self._req in self._group._open:
            self._group._open.remove(self._req)


class _LazyRecv(Work):
    """The Work of an irecv from a peer on this node whose message may yet be taken
    straight from the ring (see ProcessGroup.irecv): not posted on the transport until
    its wait, or an earlier-completing test, or another receive of the group needs it
    posted (``work``: then the posted receive's Work, or the completed one)."""

    def __init__(self, group: ProcessGroup, args: tuple) -> None:
        self._name, self._timeout, self._error, self._result = "recv", group.timeout, None, None
        self._group, self.args = group, args  # args: irecv's (arr, peer, tag, group_src)
        self.work: Work | None = None

    def _settle(self, wait: bool) -> Work | None:
        return self.work or self._group._settle(self, wait)

    def is_completed(self) -> bool:
        work = self._settle(False)
        return work is not None and work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        return None if self.work is None else self.work.exception()

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        work = self._settle(True)
        if work is None:  # withdrawn by cancel before it was posted
            raise CollectiveError(f"{self._name} was cancelled: it will not complete")
        return work.wait(timeout)

    def result(self) -> Any:
        self.wait()
        assert self.work is not None
        return self.work.result()

    def cancel(self) -> None:
        if not self._group._withdraw(self) and self.work is not None:
            self.work.cancel()


def _meta(arr: np.ndarray, count: int | None = None, root: int = -1, redop: ReduceOp | None = None) -> dict:
    """Header fields of an operation on ``arr`` (checked against every peer's)."""
    return dict(
        dtype=DTYPE_CODES[arr.dtype], count=arr.size if count is None else count, root=root, redop=redop
    )


class ProcessGroup(Members):
    """A set of global ranks that run collectives together (torch's ProcessGroup).

    ``ranks``: sorted global ranks; ``rank``: this process's rank in the group;
    ``size``; ``timeout``: seconds for every operation on the group. ``runtime``:
    the :class:`~.runtime.Runtime` (its transport, rank, node keys and shared-memory
    settings).

    The collective methods take flat C-contiguous numpy arrays (views of the caller's
    buffers: results are written in place) and group ranks; they block unless
    ``async_op`` and raise as documented in :mod:`.api` (arguments are the caller's to
    check: only the reduce op against the dtype is checked here).
    """

    def __init__(self, runtime: Any, gid: int, ranks: list, timeout: float, name: str):
        super().__init__(runtime, gid, ranks, timeout, name)
        self._current_op = 0
        self._seq_lock = threading.Lock()
        self._executor = Executor(f"distlaunch-coll-{name}")
        self.completed = 0  # sequence number of the last finished collective
        self._backend: Backend | None = None  # chosen by the first collective
        self._fast: ShmBackend | None = None  # the backend when it has a small-op fast path
        self.fast_channel: ShmChannel | None = None  # its channel (None: none, or shut down)
        self._fast_ctx: OpContext | None = None  # reused by _run_small
        self._fast_call: SmallCall | SmallPlan | None = None  # the call _fast_ctx describes
        self._open: list[Request] = []  # receives posted on the transport, maybe unmatched
        # irecvs not posted yet (at most one: a receive started after it posts it first)
        self._deferred: list[_LazyRecv] = []

    @property
    def backend(self) -> str | None:
        """ "tcp", "shm" or "hierarchical" once the first collective chose it, else None."""
        return None if self._backend is None else self._backend.kind

    def shutdown(self) -> None:
        """Stop the group's async executor thread and unmap/unlink its shared memory
        (on destroy). Raises CollectiveMismatchError (or what a wait raises, within the
        group timeout) when the group's last operation was eager and the ranks' calls of
        it differ (:meth:`check_last`); the group is shut down all the same."""
        self._executor.stop()
        err = self.check_last()
        self._fast_ctx = self._fast_call = None  # the cached call may hold views of the segment
        self._fast = self.fast_channel = None
        if self._backend is not None:
            self._backend.close()
            if self._backend.channel is not None:
                self._backend = TCP
        if err is not None:
            raise err

    def check_last(self) -> BaseException | None:
        """On destroy: the error to raise when the group's last operation was eager on
        shared memory, this rank did not compare every rank's call of it (the next
        operation would have), and they differ -- waits (at most the group timeout) for
        every rank to have made that call. None when they agree or nothing is left to
        compare (also when called again)."""
        backend = self._backend
        ch = backend.channel if backend is not None else None
        last = ch.last_unchecked() if ch is not None else None
        if last is None:
            return None
        assert ch is not None
        ctx = OpContext(self, last[0], last[1])
        try:
            ch.check_unchecked(ctx)
        except BaseException as e:
            return self._failed(ctx, e)
        return None

    def _choose_backend(self) -> Backend:
        """Decided by the first collective, alike on every member (from the node ids all
        ranks published, and the verdict on the segment's reservation): shared memory,
        hierarchical or TCP."""
        rt = self.runtime
        name = rt.shm_name(self)
        backend: Backend = TCP
        if name is not None:
            try:
                backend = self._fast = ShmBackend(ShmChannel(self, name, rt.shm_config))
                self.fast_channel = backend.channel
            except ShmFullError as e:  # every member gets it: all use TCP
                if self.rank == 0:
                    warn_full(e)
        elif self.size > 2:
            keys = rt.node_keys(self)
            shared = [k for k in set(keys) if k.startswith("L:") and keys.count(k) > 1]
            if shared and len(set(keys)) > 1:
                backend = HierarchicalBackend(self, keys, rt.shm_name, rt.shm_config)
        self._backend = backend
        return backend

    # -- running operations

    def status(self) -> tuple[int, int]:
        """(last sequence number called, its op code): answered to diagnosing peers."""
        return self.seq, self._current_op

    def check_usable(self) -> None:
        """Raise the first failure's class when the group is broken."""
        if self.broken is not None:
            raise _reraise(
                self.broken,
                f"{self.name} is unusable after an earlier failure "
                f"(destroy and re-initialise the process group)",
            )

    def run(self, name: str, body: Body, async_op: bool, timeout: float | None = None, **meta: Any) -> Any:
        """Run collective ``body(backend, ctx)`` as the group's next operation; blocking
        unless ``async_op`` (then returns a Work). ``meta``: dtype/count/root/redop for
        the header check; ``timeout``: seconds for this call (default the group's)."""
        self.check_usable()
        with self._seq_lock:
            self.seq += 1
            seq = self.seq
            self._current_op = OP_CODES[name]

        def execute():
            ctx = OpContext(self, name, seq, timeout=timeout, **meta)
            progress.begin(name, seq)  # what `distlaunch top` / --hang-timeout see in flight
            try:
                backend = self._backend or self._choose_backend()
                ctx.shm = backend.channel
                result = body(backend, ctx)
                self.completed = seq
                progress.end()
                if not backend.native(OPS[name]):
                    # every message of a correct collective is received inside it: one left
                    # over means its sender ran a different op/root/size
                    ctx.check_leftovers()
                return result
            except BaseException as e:
                raise self._failed(ctx, e) from (None if isinstance(e, OpTimeout) else e)
            finally:
                ctx.cancel_pending()

        if async_op:
            work = Work(f"{name} #{seq} on {self.name}", None)  # the op has its own deadline
            self._executor.submit(execute, work)
            return work
        if self._executor.pending:  # only this thread submits: a stale 0 is impossible
            self._executor.drain()
        return execute()

    def collective(
        self, name: str, *args: Any, async_op: bool = False, timeout: float | None = None, **meta: Any
    ) -> Any:
        """Run operation ``name`` of the op table with its algorithm arguments ``args``
        (flat arrays, group ranks) on the group's backend, as :meth:`run` does (``meta``:
        the header fields; an op taking a ReduceOp has its ``redop`` checked against the
        first array's dtype first: CollectiveArgumentError). A blocking call with the
        group's timeout whose op has a shared-memory algorithm on a shared-memory group
        takes :meth:`_run_small` (same sequence, deadline and errors)."""
        op = OPS[name]
        if op.redop:
            check_op(meta["redop"], args[0].dtype)
        fast = self._fast
        if fast is not None and not async_op and timeout is None:
            fn = algorithm(op, "shm")
            if fn is not None:  # native on shared memory: the reused-context path
                redop = meta.get("redop")
                call = SmallCall(
                    name,
                    op.code,
                    meta.get("dtype") or 0,
                    meta.get("count", 0),
                    meta.get("root", -1),
                    NO_REDOP if redop is None else int(redop),
                )
                self._run_small(call, fn, *args)
                return None
        return self.run(name, lambda b, ctx: b.run(op, ctx, *args), async_op, timeout=timeout, **meta)

    def small_context(self, name: str, count: int, root: int = -1) -> OpContext | None:
        """A context of its own for a caller that runs blocking ``name`` calls on bytes
        (``count`` of them, ``root`` a group rank or -1) itself on the group's
        shared-memory channel (``ctx.shm``), between :meth:`enter` and :meth:`leave`,
        raising :meth:`fail`'s error: the MPI facade's plans. Its call record is the one
        :meth:`collective` compares for the same call. None when the group has no
        shared-memory fast path (not chosen yet, or TCP)."""
        fast = self._fast
        if fast is None:
            return None
        code, dtype = OP_CODES[name], DTYPE_CODES[np.dtype(np.uint8)]
        ctx = OpContext(self, name, 0, dtype, count, root)
        ctx.record = call_record(code, dtype, count, root, NO_REDOP)
        ctx.shm = fast.channel
        return ctx

    def enter(self, ctx: OpContext) -> None:
        """Start ``ctx``'s operation as the group's next blocking one (the fast path of
        :meth:`run`: its sequence number, deadline and progress record). Raises the
        group's first failure when it is broken."""
        if self.broken is not None:
            self.check_usable()
        # (no _seq_lock: blocking operations run one at a time -- the calling thread's,
        # or the torch helper thread's, which the executor serialises with it -- and
        # asynchronous ones are drained first; status() may see the op a moment before
        # its number)
        self._current_op = ctx.op
        self.seq = seq = self.seq + 1
        if self._executor.pending:
            self._executor.drain()
        ctx.seq = seq
        t = _monotonic_ns()  # one clock read for the deadline and the progress record
        ctx.deadline = t * 1e-9 + ctx.timeout
        progress.started(ctx.name, seq, t)

    def leave(self, ctx: OpContext) -> None:
        """``ctx``'s operation (started by :meth:`enter`) completed."""
        self.completed = ctx.seq
        progress.end()

    def fail(self, ctx: OpContext, e: BaseException) -> BaseException:
        """The exception to raise for ``e`` inside ``ctx``'s operation (as :meth:`run`
        raises it; the group is then broken and the other members told)."""
        return self._failed(ctx, e)

    def _run_small(self, call: SmallCall | SmallPlan, fn: Callable[..., None], *args: Any) -> None:
        """Blocking fast path of ``run`` for an operation native on a shared-memory group
        (the caller checked ``self._fast``): ``fn(ctx, *args)`` with a reused context, no
        closures, no TCP leftovers to check. ``call``: a SmallCall (or a SmallPlan, which
        has its fields) describing the call for mismatch checks; reusing the
        same object for repeated calls skips copying it. Same sequence numbers, deadline
        and failure handling as ``run``; returns None."""
        ctx = self._fast_ctx
        if ctx is None:
            assert self._fast is not None  # the caller checked it
            ctx = self._fast_ctx = OpContext(self, call.name, 0)
            ctx.shm = self._fast.channel
            self._fast_call = None
        if self._fast_call is not call:
            self._fast_call = call
            ctx.name, ctx.op, ctx.dtype, ctx.count = call.name, call.op, call.dtype, call.count
            ctx.root, ctx.redop = call.root, call.redop
            ctx.record = call.record
        self.enter(ctx)
        try:
            fn(ctx, *args)
        except BaseException as e:
            raise self._failed(ctx, e) from (None if isinstance(e, OpTimeout) else e)
        self.leave(ctx)

    # -- collectives (one method each; arrays flat and checked, roots group ranks)

    def barrier(self, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Until every member called barrier; ``timeout``: seconds for this call only."""
        fast = self._fast
        if fast is not None and not async_op and timeout is None:
            self._run_small(_BARRIER, _SHM_BARRIER)
            return None
        return self.collective("barrier", async_op=async_op, dtype=0, count=0, timeout=timeout)

    def broadcast(self, arr: np.ndarray, root: int, async_op: bool = False) -> Work | None:
        """``arr`` of ``root`` into ``arr`` on every member (read-only on the root is fine)."""
        fast = self._fast
        if fast is not None and not async_op and arr.nbytes <= fast.small:
            plan = fast.small_plan("broadcast", arr.dtype, arr.size, root)
            if plan is not None:
                self._run_small(plan, fast.small_broadcast, arr, plan)
            else:  # met once so far: the general one, on a call record made each time
                call = SmallCall("broadcast", OP_CODES["broadcast"], DTYPE_CODES[arr.dtype], arr.size, root)
                self._run_small(call, _SHM_BROADCAST, arr, root)
            return None
        return self.collective("broadcast", arr, root, async_op=async_op, **_meta(arr, root=root))

    def all_reduce(self, arr: np.ndarray, op: ReduceOp, async_op: bool = False) -> Work | None:
        """``arr`` reduced over the members with ``op``, bit-identical on every member.
        CollectiveArgumentError when ``op`` is not defined for the dtype."""
        fast = self._fast
        if fast is not None and not async_op and arr.nbytes <= fast.small:
            plan = fast.small_all_reduce_plan(arr, op)  # checks op against the dtype once
            self._run_small(plan, fast.small_all_reduce, arr, plan)
            return None
        return self.collective("all_reduce", arr, op, async_op=async_op, **_meta(arr, redop=op))

    def reduce(self, arr: np.ndarray, op: ReduceOp, root: int, async_op: bool = False) -> Work | None:
        """The reduction into ``arr`` on ``root``; other members' ``arr`` is unchanged."""
        return self.collective("reduce", arr, op, root, async_op=async_op, **_meta(arr, root=root, redop=op))

    def _run_planned(
        self, run: str, args: tuple, async_op: bool, nbytes: int, *call: Any, block: int = 0
    ) -> bool:
        """Run the call ``call`` (:meth:`~.ShmChannel.small_plan`'s name, dtype, count
        and, as needed, root, op, piece; ``block``: all_to_all's elements per block) as
        ``ShmBackend.<run>(ctx, *args, plan)`` on its cached plan when it takes one:
        blocking, a shared-memory group, ``nbytes`` within one phase (``small``;
        scatter's blocks: its spread; all_to_all's: its width), a call met before.
        Whether it did; CollectiveArgumentError for an op the dtype does not support."""
        fast = self._fast
        if fast is None or async_op:
            return False
        if block:
            spread = fast.all_to_all_width
        elif call[0] == "scatter":
            spread = fast.scatter_spread
        else:
            spread = 0
        if nbytes > (spread or fast.small):
            return False
        plan = fast.small_plan(*call, spread=spread, block=block)
        if plan is None:
            return False
        self._run_small(plan, getattr(fast, run), *args, plan)
        return True

    def all_gather(self, outs: list, inp: np.ndarray, async_op: bool = False) -> Work | None:
        """``outs[i]`` (n arrays of ``inp``'s size and dtype) receives member i's ``inp``."""
        if self._run_planned(
            "small_all_gather", (outs, inp), async_op, inp.nbytes, "all_gather", inp.dtype, inp.size
        ):
            return None
        return self.collective("all_gather", outs, inp, async_op=async_op, **_meta(inp))

    def all_gather_into_tensor(self, out: np.ndarray, inp: np.ndarray, async_op: bool = False) -> Work | None:
        """``out`` (n times ``inp``'s size) receives the members' inputs concatenated."""
        if self._run_planned(
            "small_all_gather",
            (out, inp),
            async_op,
            inp.nbytes,
            "all_gather_into_tensor",
            inp.dtype,
            inp.size,
        ):
            return None
        m = inp.size
        outs = [out[i * m : (i + 1) * m] for i in range(self.size)]
        return self.collective("all_gather_into_tensor", outs, inp, async_op=async_op, **_meta(inp))

    def reduce_scatter(
        self, out: np.ndarray, ins: list | np.ndarray, op: ReduceOp, async_op: bool = False
    ) -> Work | None:
        """``out`` on member i receives the reduction of block i of every member's input:
        ``ins[i]`` of a list of n arrays, or the i-th of n equal blocks of one array
        (``reduce_scatter_tensor``); inputs are not modified."""
        name = "reduce_scatter_tensor" if isinstance(ins, np.ndarray) else "reduce_scatter"
        nbytes = out.nbytes * self.size
        if self._run_planned(
            "small_reduce_scatter", (out, ins), async_op, nbytes, name, out.dtype, out.size, -1, op, True
        ):
            return None
        return self.collective(name, out, ins, op, async_op=async_op, **_meta(out, redop=op))

    def scatter(self, out: np.ndarray, ins: list | None, root: int, async_op: bool = False) -> Work | None:
        """``out`` on member i receives ``ins[i]`` of ``root`` (``ins`` None elsewhere)."""
        if self._run_planned(
            "small_scatter", (out, ins), async_op, out.nbytes, "scatter", out.dtype, out.size, root
        ):
            return None
        return self.collective("scatter", out, ins, root, async_op=async_op, **_meta(out, root=root))

    def gather(self, inp: np.ndarray, outs: list | None, root: int, async_op: bool = False) -> Work | None:
        """``outs[i]`` on ``root`` receives member i's ``inp`` (``outs`` None elsewhere)."""
        if self._run_planned(
            "small_gather", (inp, outs), async_op, inp.nbytes, "gather", inp.dtype, inp.size, root
        ):
            return None
        return self.collective("gather", inp, outs, root, async_op=async_op, **_meta(inp, root=root))

    def all_to_all(self, outs: list, ins: list, async_op: bool = False, count: int = 0) -> Work | None:
        """``ins[i]`` goes to member i, ``outs[i]`` comes from member i (one dtype; sizes
        agree between sender and receiver). ``count``: elements of every block when
        every member sends blocks of one size (MPI's Alltoall): compared with every
        member's (CollectiveMismatchError); 0: block sizes only their sender and
        receiver know (torch's all_to_all, MPI's Alltoallv)."""
        ref = ins[0]
        m = ref.size
        if (
            self._fast is not None
            and not async_op
            and _blocks_of(m, ins)
            and _blocks_of(m, outs)
            and self._run_planned(
                "small_all_to_all", (outs, ins), async_op, ref.nbytes, "all_to_all", ref.dtype, count, block=m
            )
        ):
            return None
        return self.collective("all_to_all", outs, ins, async_op=async_op, **_meta(ref, count=count))

    def all_to_all_single(
        self,
        out: np.ndarray,
        inp: np.ndarray,
        out_bounds: list | None,
        in_bounds: list | None,
        async_op: bool = False,
    ) -> Work | None:
        """As all_to_all on the element ranges ``[(start, end)]`` of ``out`` and ``inp``
        (None: n equal blocks; the size is then a multiple of n)."""
        n = self.size
        m = inp.size // n
        if (
            m
            and inp.size == out.size == n * m
            and _splits_of(m, in_bounds)
            and _splits_of(m, out_bounds)
            and self._run_planned(
                "small_all_to_all",
                (out, inp),
                async_op,
                m * inp.itemsize,
                "all_to_all_single",
                inp.dtype,
                0,
                block=m,
            )
        ):
            return None
        outs = [out[a:b] for a, b in out_bounds or _equal_bounds(out.size, n)]
        ins = [inp[a:b] for a, b in in_bounds or _equal_bounds(inp.size, n)]
        return self.collective("all_to_all_single", outs, ins, async_op=async_op, **_meta(inp, count=0))

    # -- point to point (shared memory with ranks of this node, else TCP; not sequenced)

    def _p2p_header(self, arr: np.ndarray, src: int, tag: int) -> bytes:
        """The packed wire header of a message of ``arr`` from global rank ``src``."""
        return HEADER.pack(
            MAGIC,
            P2P,
            DTYPE_CODES[arr.dtype],
            _SEND,
            NO_REDOP,
            src,
            self.gid,
            tag,
            0,
            -1,
            arr.size,
            arr.nbytes,
        )

    def isend(self, arr: np.ndarray, peer: int, tag: int) -> Work:
        """Start sending ``arr`` (C-contiguous; unchanged until the Work completes) to member
        ``peer``; the Work completes once the data was handed to the operating system
        (TCP) or is in the peer's shared-memory ring (same node: a large message moves
        on while this process waits on or tests its Works).

        Fast path (same node): a message that fits the peer's ring with nothing queued
        before it is written at once (:meth:`~.shm_p2p.ShmLinks.put`) and a completed
        Work returned; the ring keeps the order of a pair's messages either way."""
        rt = self.runtime
        links = links_for(rt)  # peers on this node: over shared memory
        dst = self.ranks[peer]
        if links is not None:
            i = links.index.get(dst)
            if i is not None and links.put(i, self._p2p_header(arr, rt.rank, tag), byte_view(arr)):
                return _SENT
        hdr = Header(
            P2P,
            DTYPE_CODES[arr.dtype],
            _SEND,
            NO_REDOP,
            rt.rank,
            self.gid,
            tag,
            0,
            -1,
            arr.size,
            arr.nbytes,
        )
        what = f"send to rank {dst} (tag {tag}, {arr.size} x {arr.dtype})"
        try:
            req = rt.transport.isend(dst, hdr, byte_view(arr), time.monotonic() + self.timeout, owner=None)
        except CollectiveError as e:
            raise type(e)(f"{what}: {e}") from e

        def done(r: Request, timed_out: bool) -> str | None:
            if timed_out:
                return f"{what} did not complete within the timeout (is rank {dst} receiving?)"
            if r.error is not None:
                raise type(r.error)(f"{what}: {r.error}")
            return None

        return RequestWork(what, self.timeout, req, rt.transport, done)

    def _take(self, links: Any, i: int, header: bytes, buf: memoryview, lazy: _LazyRecv | None) -> Any:
        """:meth:`~.shm_p2p.ShmLinks.take` of the message with the packed ``header`` from
        local rank i while nothing could come before it (``()`` otherwise): no receive of this group is posted
        on the transport or deferred (but ``lazy``, the receive taking it, first), we
        have nothing queued for that rank (the general path's waits move it on), and
        every message of that rank routed to the transport was received (so none waits
        as unexpected: :meth:`~.shm_p2p.ShmLinks.settled`). Then torch's order per
        (source, tag) and the posting order cannot differ."""
        with links.lock:
            if self._open:
                self._open = [r for r in self._open if r.header is None and not r.done]
            deferred = self._deferred
            if (
                self._open
                or (deferred[:1] != [lazy] if lazy is not None else deferred)  # lazy: not yet settled
                or links.closed
                or links.queues[i]
                or not links.settled(i)
            ):
                return ()
            got = links.take(i, 0, 0, None, buf, header)
            if got is True and lazy is not None:
                del deferred[0]
                _, peer, _, group_src = lazy.args
                lazy.work = _Done(peer if group_src else self.ranks[peer])
            return got

    def _fast_recv(self, arr: np.ndarray, peer: int | None, tag: int, wait: bool, lazy: Any = None) -> Any:
        """Receive ``arr`` from member ``peer`` straight from its shared-memory ring
        (``wait``: busy-polling a while, see :meth:`~.shm_p2p.ShmLinks.poll_take`) as
        :meth:`_take` (``lazy``: the deferred irecv doing it): True when done, None when
        its message is not there yet, ``()`` when it cannot be done that way (then post
        the receive)."""
        links = None if peer is None else links_for(self.runtime)
        if links is None or arr.nbytes > links.ring - 64:  # 64: a message's header record
            return ()
        assert peer is not None
        src = self.ranks[peer]
        i = links.index.get(src)
        if i is None:
            return ()
        header, buf = self._p2p_header(arr, src, tag), byte_view(arr)
        if wait:
            return links.poll_take(lambda: self._take(links, i, header, buf, lazy))
        return self._take(links, i, header, buf, lazy)

    def _settle(self, lazy: _LazyRecv, wait: bool) -> Work | None:
        """Complete the deferred irecv ``lazy`` from the ring when it is first (``wait``:
        busy-polling a while), else post every deferred irecv (``lazy`` included); its
        Work then (None: not waiting and its message is not there yet)."""
        arr, peer, tag, _ = lazy.args
        got = self._fast_recv(arr, peer, tag, wait, lazy)  # sets lazy.work when taken
        if got is None and not wait:
            return None
        if got is not True:
            self._post_deferred()
        return lazy.work

    def _post_deferred(self) -> None:
        """Post the deferred irecvs on the transport, in call order (before any other
        receive of the group: posting order is matching order)."""
        links = links_for(self.runtime)
        if links is None or not self._deferred:
            return
        with links.lock:
            for lazy in self._deferred:
                lazy.work = self._post(*lazy.args)
            self._deferred.clear()

    def _withdraw(self, lazy: _LazyRecv) -> bool:
        """Drop a deferred irecv (cancelled); False when it was posted or completed."""
        links = links_for(self.runtime)
        if links is None:
            return False
        with links.lock:
            if lazy in self._deferred:
                self._deferred.remove(lazy)
                return True
        return False

    def recv(self, arr: np.ndarray, peer: int | None, tag: int, group_src: bool = False) -> int:
        """Receive into ``arr`` (C-contiguous) from member ``peer`` (None: any member),
        blocking up to the group timeout; returns the sender's rank (its group rank when
        ``group_src``). Raises as :meth:`irecv`'s Work (the receive is then withdrawn).

        Fast path (same node, a specific peer, nothing that could come before): the
        message is copied straight from the peer's ring (:meth:`_take`)."""
        got = self._fast_recv(arr, peer, tag, True)
        if got is True:
            assert peer is not None
            progress.heartbeat()  # for --hang-timeout (the slow path's Work counts its own)
            return peer if group_src else self.ranks[peer]
        self._post_deferred()
        work = self._post(arr, peer, tag, group_src, spin=got is not None)  # None: it has spun
        try:
            return work.result()
        except CollectiveError:
            work.cancel()
            raise

    def irecv(self, arr: np.ndarray, peer: int | None, tag: int, group_src: bool = False) -> Work:
        """Start receiving into ``arr`` (C-contiguous) from member ``peer`` (None: any member);
        the Work's result is the sender's rank (its group rank when ``group_src``). A
        sender of another dtype or element count fails it with CollectiveMismatchError.

        From a peer on this node with nothing that could come before (see :meth:`_take`):
        a message already in the ring is taken at once (a completed Work); else the
        receive is deferred (posted by its Work's wait or test, or before any later
        receive of the group, in call order) so that its wait may take the message
        straight from the ring too."""
        got = self._fast_recv(arr, peer, tag, False)
        if got is True:
            assert peer is not None
            return _Done(peer if group_src else self.ranks[peer])
        if got is None:
            lazy = _LazyRecv(self, (arr, peer, tag, group_src))
            links = links_for(self.runtime)
            assert links is not None  # None comes from the ring
            with links.lock:
                self._deferred.append(lazy)
            return lazy
        self._post_deferred()
        return self._post(arr, peer, tag, group_src)

    def _post(self, arr: np.ndarray, peer: int | None, tag: int, group_src: bool, spin: bool = True) -> Work:
        """Post irecv's receive on the transport; its Work (``spin``: see RequestWork)."""
        rt = self.runtime
        links = links_for(rt)
        dtype = DTYPE_CODES[arr.dtype]
        who = "any rank" if peer is None else f"rank {self.ranks[peer]}"
        what = f"recv from {who} (tag {tag}, {arr.size} x {arr.dtype})"

        def check(h: Header) -> CollectiveMismatchError | None:
            if h.dtype != dtype or h.count != arr.size:
                return CollectiveMismatchError(
                    f"rank {h.src} sent {h.count} x {DTYPE_NAMES.get(h.dtype, '?')} (tag {tag}) but rank "
                    f"{rt.rank} receives {arr.size} x {arr.dtype}"
                )
            if not self.is_member(h.src):
                return CollectiveMismatchError(f"rank {h.src} is not in {self.name}")
            if links is not None:
                links.claim(h.src)  # accepted: see ShmLinks.settled
            return None

        req = rt.transport.irecv(
            None if peer is None else self.ranks[peer], (P2P, self.gid, tag), byte_view(arr), check
        )
        if links is not None and not req.done:  # for _take (no links: no fast path)
            with links.lock:
                self._open = [r for r in self._open if r.header is None and not r.done]
                self._open.append(req)

        def done(r: Request, timed_out: bool) -> str | int:
            if timed_out:
                return f"{what} did not complete within the timeout"
            if r.error is not None:
                raise type(r.error)(f"{what}: {r.error}")
            assert r.header is not None  # a receive completed without error has matched one
            src_rank = r.header.src
            return self.group_rank(src_rank) if group_src else src_rank

        return _RecvWork(self, what, req, done, spin)

    # -- failure handling

    def _failed(self, ctx: OpContext, e: BaseException) -> BaseException:
        """Turn a failure inside an operation into the exception to raise, mark the group
        broken, and tell the other members when they could otherwise hang."""
        # a mismatch of an earlier (eager) operation's calls: name that operation
        name, seq = getattr(e, "call", None) or (ctx.name, ctx.seq)
        if ctx.shm is not None:
            ctx.shm.unchecked = 0  # reported now: destroy does not compare it again
        what = f"{name} #{seq} on {self.name} (rank {self.runtime.rank})"
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
            err = (
                b
                if b is e or getattr(b, "seq", None) == seq
                else _reraise(b, f"{what}: {self.name} is unusable after an earlier failure")
            )
        elif isinstance(e, OpTimeout):
            err = self._diagnose_timeout(ctx, what, e.peers)
            ranks = ";".join(",".join(map(str, rs)) for rs in (err.missing_ranks, err.unreachable_ranks))
            lost = isinstance(err, PeerLostError)  # (woken shared-memory members raise it too)
            self._abort_members(seq, ABORT_TIMEOUT, f"{ranks}\n{err}", ABORT_PEER_LOST if lost else None)
        elif isinstance(e, CollectiveError) and getattr(e, "_from_abort", False):
            err = e
        elif isinstance(e, (CollectiveMismatchError, PeerLostError)):
            err = type(e)(f"{what}: {e}")
            reason = ABORT_MISMATCH if isinstance(e, CollectiveMismatchError) else ABORT_PEER_LOST
            self._abort_members(seq, reason, str(err))
        elif isinstance(e, CollectiveError):
            err = e
        else:
            err = e  # a bug or KeyboardInterrupt: still leave the group broken
        if self.broken is None:
            self.broken = err
            # any exception, a KeyboardInterrupt too, records the operation it broke
            setattr(err, "seq", seq)  # noqa: B010  (BaseException declares no seq)
        return err

    def _abort_members(self, seq: int, reason: int, text: str, word: int | None = None) -> None:
        """Fail operation ``seq`` on every other member: wake the shared-memory waiters
        (with ``word``, default ``reason`` for a mismatch or lost peer, else ABORT_OTHER:
        the class a woken member raises when the TCP ABORT is late), send the TCP ABORT
        (``reason``, ``text``) to each member (bounded wait)."""
        backend = self._backend
        if backend is not None:
            if word is None:
                word = reason if reason in (ABORT_MISMATCH, ABORT_PEER_LOST) else ABORT_OTHER
            backend.abort(word)
        deadline = time.monotonic() + _STATUS_WAIT
        hdr = Header(ABORT, 0, reason, NO_REDOP, self.runtime.rank, self.gid, seq, 0, -1, 0, 0)
        payload = text.encode()[:65536]
        transport = self.runtime.transport
        for g in self.ranks:
            if g != self.runtime.rank:
                transport.send_control(g, hdr._replace(nbytes=len(payload)), payload, deadline)

    def _diagnose_timeout(self, ctx: OpContext, what: str, waiting_on: list) -> CollectiveError:
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
        err = _timeout_class(missing, lost)(msg)
        err.missing_ranks = missing
        err.unreachable_ranks = lost
        return err

    def on_late(self, hdr: Header) -> None:
        """Progress thread: rank ``hdr.src`` sent data for collective ``hdr.seq``, which this
        rank already finished without expecting it: the ranks disagreed (e.g. on the root).
        Break the group and tell the others (on a helper thread: never block progress)."""
        if hdr.seq > self.completed or self.broken is not None:
            return
        err = CollectiveMismatchError(
            f"{self.name} (rank {self.runtime.rank}): rank {hdr.src} sent data for "
            f"{OP_NAMES[hdr.op] if hdr.op < len(OP_NAMES) else hdr.op} #{hdr.seq} "
            f"(root={self.ranks[hdr.root] if 0 <= hdr.root < self.size else hdr.root}) that this rank "
            f"did not expect: ranks disagree on the operation, its root or its size"
        )
        err.seq = hdr.seq
        self.broken = err
        threading.Thread(
            target=self._abort_members, args=(hdr.seq, ABORT_MISMATCH, str(err)), daemon=True
        ).start()

    def on_abort(self, hdr: Header, text: str) -> None:
        """Progress thread: a peer aborted operation ``hdr.seq``; fail ours."""
        cls = _ABORT_CLASSES.get(hdr.op, CollectiveError)
        missing: list = []
        lost: list = []
        if hdr.op == ABORT_TIMEOUT:  # "<missing ranks>;<unreachable ranks>\n<message>"
            head, _, text = text.partition("\n")
            fields = head.split(";")
            if len(fields) == 2:
                missing, lost = ([int(r) for r in f.split(",") if r.isdigit()] for f in fields)
            cls = _timeout_class(missing, lost)  # the class the aborting rank raised
        err = cls(f"rank {hdr.src} aborted {self.name}: {text}")
        if hdr.op == ABORT_TIMEOUT:
            err.missing_ranks = missing
            err.unreachable_ranks = lost
        err._from_abort = True
        err.seq = hdr.seq
        if self.broken is None:
            self.broken = err
        self.runtime.transport.fail_owner(self.gid, err)
        for c in self._backend.children() if self._backend is not None else []:
            if c.broken is None:
                c.broken = err
            self.runtime.transport.fail_owner(c.gid, err)


def _blocks_of(m: int, arrs: list) -> bool:
    """Every array of ``arrs`` has ``m`` elements, and ``m`` is not 0 (all_to_all's plans)."""
    for a in arrs:
        if a.size != m:
            return False
    return m > 0


def _splits_of(m: int, bounds: list | None) -> bool:
    """``bounds`` (element ranges, None: equal splits) are consecutive blocks of ``m``."""
    if bounds is None:
        return True
    at = 0
    for a, b in bounds:
        if a != at or b != at + m:
            return False
        at = b
    return True


def _equal_bounds(size: int, n: int) -> list:
    """The element ranges of n equal blocks of ``size`` elements."""
    m = size // n
    return [(i * m, (i + 1) * m) for i in range(n)]


def _timeout_class(missing: list, lost: list) -> type[CollectiveError]:
    """The error of a timed-out operation: PeerLostError when only unreachable ranks kept
    it from completing, else CollectiveTimeoutError (the same on every member: the rank
    that timed out, and those its ABORT reaches first)."""
    return PeerLostError if lost and not missing else CollectiveTimeoutError


def _reraise(cause: BaseException, message: str) -> BaseException:
    cls = type(cause) if isinstance(cause, CollectiveError) else CollectiveError
    err = cls(f"{message}; first error: {cause}")
    err.__cause__ = cause
    return err
