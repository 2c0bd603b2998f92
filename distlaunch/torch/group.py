"""A ``torch.distributed`` process-group backend named ``"distlaunch"`` on the
distlaunch collectives runtime (shared memory inside a node, TCP across nodes).

    import distlaunch.torch                      # registers the backend (needs torch)
    dist.init_process_group("distlaunch")        # instead of "gloo"; nothing else changes

Registration: importing this module calls ``torch.distributed.Backend.register_backend(
"distlaunch", ..., extended_api=True, devices=["cpu"])``. torch's only plugin entry
point, the ``torch.backends`` group (RFC pytorch#122468), is *not* used: torch loads and
calls every such entry point at ``import torch`` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0),
so distlaunch would be imported into the start-up of every torch program in the
environment, distributed or not, and any failure there would break ``import torch``
itself. One explicit import in the programs that want the backend is the cheaper
trade-off.

Bootstrap (which store the runtime rendezvouses on):

- under ``distlaunch run`` (DISTLAUNCH_STORE_PORT set, and torch's rank and world size
  are the launcher's RANK/WORLD_SIZE): the launcher's store, which is authenticated
  (docs/security.md); torch's own store (``env://`` TCPStore, ``tcp://``, ``file://`` or
  ``store=``) is not read at all. The launcher's node id decides which ranks share
  memory.
- otherwise (torchrun, ``tcp://``, ``file://`` or ``store=`` started by hand): the store
  torch passes to the backend, which is the only one every rank has. torch's TCPStore is
  not authenticated, so the transport secret never goes into it: rank 0 publishes a
  random nonce and every rank derives the key from it and a token (``Runtime``, as on
  every init path: ``secret.derive_key``), the token from
  ``distlaunch.secret.shared_token`` (DISTLAUNCH_STORE_TOKEN, a token file, or the
  per-user secret file; ranks on several machines need the same secret there). Ranks
  share memory when they are on the same machine (host name and boot id).

Operations: every method torch's Python API, DDP, ZeRO/FSDP on CPU and the object
collectives call on a ProcessGroup (``allreduce``, ``allreduce_coalesced``, ``broadcast``,
``allgather``, ``all_gather_single`` / ``_allgather_base``, ``allgather_coalesced``,
``all_gather_single_coalesced`` / ``allgather_into_tensor_coalesced``,
``reduce_scatter``, ``reduce_scatter_single`` / ``_reduce_scatter_base``,
``reduce_scatter_single_coalesced`` / ``reduce_scatter_tensor_coalesced``, ``alltoall``,
``all_to_all_single`` / ``alltoall_base``, ``reduce``, ``gather``, ``scatter``,
``barrier``, ``send``, ``recv``, ``recv_anysource``) on dense CPU tensors of every dtype
torch trains with. ReduceOp SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR (AVG: floating
point only; PREMUL_SUM raises ValueError).

- Contiguous tensors are used in place (``tensor.numpy()`` views: zero copies; bfloat16
  is moved as its int16 bits). Non-contiguous tensors go through a contiguous copy.
- bfloat16 and float16 *reductions* run in float32 (numpy has no bfloat16) on a float32
  copy, rounded once to the tensor's dtype at the end: results are within 0.5 ulp of the
  float32 reduction (gloo rounds after every addition, so the two may differ by a few
  ulp when more than two values are summed; MIN and MAX are exact).
- Ordering: the operations of one group run in call order. A call with
  ``opts.asyncOp == False`` (torch's blocking API) or a small one (at most
  ``INLINE_BYTES``) runs in the calling thread when nothing of the group is pending;
  otherwise it is queued to the group's helper thread, so DDP's gradient buckets overlap
  with the backward pass. ``Work.wait()`` and ``Work.get_future()`` (value: the output
  tensors, as gloo's) work for both.

Failures: a dead peer, ranks that called different operations, and an operation not
finished within ``init_process_group(timeout=...)`` raise on every surviving rank within
that timeout (as the runtime's CollectiveError classes): :class:`DistlaunchTimeoutError`,
:class:`DistlaunchPeerLostError`, :class:`DistlaunchMismatchError`, all subclasses of
torch's ``DistBackendError`` and of the matching ``distlaunch.collectives`` error. The
first rank to fail aborts the group on the others (a timeout too: ranks blocked in the
operation raise with it, ranks that had not reached it raise at their next call).
After a failure the group is broken, as in the runtime. Bad
arguments raise ValueError (CollectiveArgumentError) on the calling rank only.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from ..collectives.buffers import check_same, split_bounds
from ..collectives.errors import (
    CollectiveArgumentError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
)
from ..collectives.group import ProcessGroup as Group
from ..collectives.ops import ReduceOp, as_reduce_op, check_op
from ..collectives.runtime import Runtime, launcher_runtime, local_host_towards
from ..collectives.wire import DTYPE_CODES
from ..collectives.work import Executor
from ..secret import shared_token

__all__ = [
    "BACKEND",
    "INLINE_BYTES",
    "DistlaunchProcessGroup",
    "DistlaunchBackendError",
    "DistlaunchTimeoutError",
    "DistlaunchPeerLostError",
    "DistlaunchMismatchError",
]

BACKEND = "distlaunch"
# bytes up to which an async_op=True operation still runs in the calling thread (when
# the group is idle): handing it to a thread costs more than it could overlap
INLINE_BYTES = 1 << 16

Tensor = torch.Tensor
Arr = np.ndarray
# torch's stubs give ProcessGroup's methods pybind overloads (e.g. ``allreduce(tensor,
# op)``) that a Python override taking torch's C++ signature cannot match; the trampoline
# only ever calls the C++ signature, so the bases are typed loosely
_TorchProcessGroup: Any = dist.ProcessGroup
_TorchWork: Any = dist._Work


# ----------------------------------------------------------------------------- errors


class DistlaunchBackendError(dist.DistBackendError, CollectiveError):
    """A collective failed (torch's DistBackendError and distlaunch's CollectiveError)."""


class DistlaunchTimeoutError(DistlaunchBackendError, CollectiveTimeoutError):
    """Not finished within the group timeout; names the ranks that did not arrive."""


class DistlaunchPeerLostError(DistlaunchBackendError, PeerLostError):
    """A peer's process died or its connection ended."""


class DistlaunchMismatchError(DistlaunchBackendError, CollectiveMismatchError):
    """Ranks called different operations (op, dtype, size, root or reduce op)."""


def _as_torch_error(e: BaseException) -> BaseException:
    """The torch-facing exception for a runtime failure (arguments errors and
    non-collective exceptions are returned unchanged)."""
    if isinstance(e, (DistlaunchBackendError, CollectiveArgumentError)) or not isinstance(e, CollectiveError):
        return e
    cls: type[DistlaunchBackendError] = DistlaunchBackendError
    if isinstance(e, CollectiveTimeoutError):
        cls = DistlaunchTimeoutError
    elif isinstance(e, PeerLostError):
        cls = DistlaunchPeerLostError
    elif isinstance(e, CollectiveMismatchError):
        cls = DistlaunchMismatchError
    err = cls(f"distlaunch: {e}")
    err.__cause__ = e
    return err


# ----------------------------------------------------------------------------- Work


class DistlaunchWork(_TorchWork):
    """torch ``Work`` of one operation: ``wait(timeout=None)`` blocks until it finished
    (a timedelta > 0 bounds the wait: DistlaunchTimeoutError; the operation keeps its own
    deadline, the group timeout) and re-raises its error; ``get_future()`` is a
    ``torch.futures.Future`` completed with the output tensors (or the error);
    ``is_completed()`` never blocks; ``_source_rank()`` is the sender's group rank of a
    receive."""

    def __init__(self, name: str, group: str, outputs: list) -> None:
        super().__init__()
        self._name = name  # with group: formatted only for errors (this is per call)
        self._group = group
        self._outputs = outputs
        self._done = False
        # completed by another thread (an operation run in the calling thread is a
        # _DoneWork, complete when created: no event, no lock)
        self._event = threading.Event()
        self._lock: Any = threading.Lock()
        self._error: BaseException | None = None
        self._future: Future | None = None
        self._source = -1

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            self._done = True
            fut = self._future
        self._event.set()
        if fut is not None:
            _complete(fut, self._outputs, error)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Complete the Work (the executor's call; ``result`` is ignored: a Work's
        value is its output tensors), ``error`` as torch sees it."""
        self._finish(None if error is None else _as_torch_error(error))

    def _wait_done(self, timeout: float | None) -> None:
        if not self._done and not self._event.wait(timeout):
            raise DistlaunchTimeoutError(
                f"distlaunch: {self._name} on {self._group} did not complete within {timeout:g} s"
            )

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        if not self._done:
            self._wait_done(_seconds(timeout))
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done:
                    _complete(self._future, self._outputs, self._error)
            return self._future

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source


class _DoneWork(DistlaunchWork):
    """Work of an operation that ran in the calling thread: complete when created (no
    event or lock; built per call, so kept to the least torch's Work needs)."""

    _done = True
    _lock: Any = contextlib.nullcontext()
    _error: BaseException | None = None
    _future: Future | None = None
    _source = -1

    def __init__(self, outputs: list, error: BaseException | None = None) -> None:
        _TorchWork.__init__(self)
        self._outputs = outputs
        if error is not None:
            self._error = error


def _complete(fut: Future, outputs: list, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(outputs)
    else:
        fut.set_exception(error)


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """None (no bound) for None or a zero timedelta (torch's kNoTimeout)."""
    if timeout is None:
        return None
    t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return t if t > 0 else None


class _P2PWork(DistlaunchWork):
    """Work of a send or receive: completes with the runtime's point-to-point request
    (``then`` runs after a successful receive, e.g. copying into a non-contiguous tensor)."""

    def __init__(
        self, name: str, group: str, outputs: list, req: Any, then: Callable[[], None] | None = None
    ) -> None:
        super().__init__(name, group, outputs)
        self._req = req
        self._then = then
        self._wait_lock = threading.Lock()

    def _wait_done(self, timeout: float | None) -> None:
        with self._wait_lock:
            if self._done:
                return
            try:
                if timeout is None:
                    result = self._req.result()  # bounded by the group timeout
                else:
                    self._req.wait(timeout)
                    result = self._req.result()
                if isinstance(result, int):
                    self._source = result
                if self._then is not None:
                    self._then()
            except CollectiveTimeoutError as e:
                if timeout is not None and not self._req.is_completed():
                    raise _as_torch_error(e) from None  # only this wait gave up
                self._req.cancel()  # a receive past the group timeout is withdrawn
                self._finish(_as_torch_error(e))
            except BaseException as e:
                self._finish(_as_torch_error(e))
            else:
                self._finish()

    def is_completed(self) -> bool:
        return self._done or self._req.is_completed()

    def get_future(self) -> Future:
        with self._lock:
            start = self._future is None and not self._done
        fut = super().get_future()
        if start:  # nobody may ever call wait(): complete the future from a helper thread
            threading.Thread(target=self._wait_quietly, name="distlaunch-p2p-future", daemon=True).start()
        return fut

    def _wait_quietly(self) -> None:
        try:
            self._wait_done(None)
        except BaseException:
            pass  # delivered through the future


# ----------------------------------------------------------------------------- ordering


def _run_now(fn: Callable[[], Any], outputs: list) -> DistlaunchWork:
    """Run ``fn`` in the calling thread; its completed Work (failed with fn's error)."""
    try:
        fn()
    except BaseException as e:  # delivered by wait() / the future, as for queued ones
        return _DoneWork(outputs, _as_torch_error(e))
    return _DoneWork(outputs)


# ----------------------------------------------------------------------------- tensors


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


# ----------------------------------------------------------------------------- the group


class DistlaunchProcessGroup(_TorchProcessGroup):
    """torch ProcessGroup over one ``distlaunch.collectives`` group. Created by
    ``init_process_group("distlaunch")`` / ``new_group(backend="distlaunch")``; every
    method takes torch's arguments (lists of CPU tensors and an options object) and
    returns a :class:`DistlaunchWork` (see the module docstring for semantics)."""

    def __init__(self, group: Group, runtime: Runtime | None) -> None:
        super().__init__(group.rank, group.size)
        self._g = group
        self._runtime = runtime  # owned (closed on shutdown) when this is a runtime's world
        self._executor = Executor(f"distlaunch-torch-{group.name}")
        self._shut = False

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def transport(self) -> str | None:
        """The runtime's path for this group: "shm", "tcp" or "hierarchical", chosen by
        its first collective (None before)."""
        return self._g.backend

    def __repr__(self) -> str:
        return f"DistlaunchProcessGroup({self._g.name}, rank {self._g.rank} of {self._g.size})"

    # -- running

    def _submit(
        self, name: str, outputs: list, bufs: _Bufs, body: Callable[[], Any], nbytes: int, opts: Any
    ) -> DistlaunchWork:
        inline = not getattr(opts, "asyncOp", True) or nbytes <= INLINE_BYTES
        if bufs.back:

            def fn() -> None:
                body()
                bufs.finish()

            return self._run(fn, name, outputs, inline)
        return self._run(body, name, outputs, inline)

    def _run(self, fn: Callable[[], Any], name: str, outputs: list, inline: bool) -> DistlaunchWork:
        """Run ``fn`` in the calling thread (``inline`` and nothing of the group pending)
        or queue it on the group's executor (in call order); its Work."""
        executor = self._executor
        if not (inline and executor.idle()):
            work = DistlaunchWork(name, self._g.name, outputs)
            try:
                if executor.submit(fn, work, inline):
                    return work
            except CollectiveError as e:  # shut down
                raise _as_torch_error(e) from None
        return _run_now(fn, outputs)  # (the helper thread finished meanwhile)

    # -- collectives

    def allreduce(self, tensors: list, opts: Any = None) -> DistlaunchWork:
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        t = tensors[0]
        if (
            isinstance(t, Tensor)
            and t.is_cpu
            and t.layout == torch.strided
            and t.dtype in _PLAIN
            and t.is_contiguous()
        ):
            # the common case, kept short (torch's own layer costs about as much as the
            # runtime's small all_reduce): a view, no stand-ins to copy back
            op, g = _op(opts), self._g
            arr = (t.detach() if t.requires_grad else t).numpy()
            if arr.ndim != 1:
                arr = arr.reshape(-1)
            check_op(op, arr.dtype)
            inline = not getattr(opts, "asyncOp", True) or arr.nbytes <= INLINE_BYTES
            return self._run(lambda: g.all_reduce(arr, op), "all_reduce", tensors, inline)
        op, bufs = _op(opts), _Bufs()
        arr = bufs.reducible(tensors[0], "tensor", out=True)
        check_op(op, arr.dtype)
        g = self._g
        return self._submit("all_reduce", tensors, bufs, lambda: g.all_reduce(arr, op), arr.nbytes, opts)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> DistlaunchWork:
        """One all_reduce per dtype over the tensors flattened into one buffer."""
        op, g = _op(opts), self._g
        by_dtype: dict = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(_check(t, f"tensors[{i}]").dtype, []).append(t)
        flats = []
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            bufs = _Bufs()
            arr = bufs.reducible(flat, "tensors", out=True)
            check_op(op, arr.dtype)
            flats.append((ts, flat, arr, bufs))

        def body() -> None:
            for ts, flat, arr, bufs in flats:
                g.all_reduce(arr, op)
                bufs.finish()
                offset = 0
                for t in ts:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

        nbytes = sum(f[2].nbytes for f in flats)
        return self._submit("all_reduce_coalesced", tensors, _Bufs(), body, nbytes, opts)

    def broadcast(self, tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        root = opts.rootRank
        arr = bufs.view(tensors[0], "tensor", out=g.rank != root)
        return self._submit("broadcast", tensors, bufs, lambda: g.broadcast(arr, root), arr.nbytes, opts)

    def reduce(self, tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs, op = self._g, _Bufs(), _op(opts)
        root = opts.rootRank
        arr = bufs.reducible(tensors[0], "tensor", out=g.rank == root)
        check_op(op, arr.dtype)
        return self._submit("reduce", tensors, bufs, lambda: g.reduce(arr, op, root), arr.nbytes, opts)

    def allgather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        inp = bufs.view(input_tensors[0], "input_tensor", out=False)
        outs = self._list(bufs, output_tensors[0], "output_tensors", out=True)
        check_same(outs, inp, "output_tensors")
        return self._submit(
            "all_gather", output_tensors, bufs, lambda: g.all_gather(outs, inp), inp.nbytes * g.size, opts
        )

    def allgather_coalesced(self, output_lists: list, input_list: list, opts: Any = None) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        pairs = []
        for i, (outs_t, inp_t) in enumerate(zip(output_lists, input_list)):
            inp = bufs.view(inp_t, f"input_list[{i}]", out=False)
            outs = self._list(bufs, outs_t, f"output_lists[{i}]", out=True)
            check_same(outs, inp, f"output_lists[{i}]")
            pairs.append((outs, inp))

        def body() -> None:
            for outs, inp in pairs:
                g.all_gather(outs, inp)

        nbytes = sum(p[1].nbytes for p in pairs) * g.size
        return self._submit("all_gather_coalesced", output_lists, bufs, body, nbytes, opts)

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> DistlaunchWork:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        pairs = []
        for i, (o, t) in enumerate(zip(outputs, inputs)):
            inp = bufs.view(t, f"input[{i}]", out=False)
            out = bufs.view(o, f"output[{i}]", out=True)
            check_same([out], inp, "[output]", size=inp.size * g.size)
            pairs.append((out, inp))

        def body() -> None:
            for out, inp in pairs:
                g.all_gather_into_tensor(out, inp)

        nbytes = sum(p[0].nbytes for p in pairs)
        return self._submit("all_gather_into_tensor", outputs, bufs, body, nbytes, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs, op = self._g, _Bufs(), _op(opts)
        out = bufs.reducible(output_tensors[0], "output", out=True)
        ins = [bufs.reducible(t, f"input_list[{i}]", out=False) for i, t in enumerate(input_tensors[0])]
        if len(ins) != g.size:
            raise CollectiveArgumentError(f"input_list has {len(ins)} tensors; the group has {g.size} ranks")
        check_same(ins, out, "input_list")
        check_op(op, out.dtype)
        return self._submit(
            "reduce_scatter",
            output_tensors,
            bufs,
            lambda: g.reduce_scatter(out, ins, op),
            out.nbytes * g.size,
            opts,
        )

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> DistlaunchWork:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list, inputs: list, opts: Any = None
    ) -> DistlaunchWork:
        g, bufs, op = self._g, _Bufs(), _op(opts)
        pairs = []
        for i, (o, t) in enumerate(zip(outputs, inputs)):
            out = bufs.reducible(o, f"output[{i}]", out=True)
            inp = bufs.reducible(t, f"input[{i}]", out=False)
            check_same([inp], out, "[input]", size=out.size * g.size)
            check_op(op, out.dtype)
            pairs.append((out, inp))

        def body() -> None:
            for out, inp in pairs:
                g.reduce_scatter(out, inp, op)

        nbytes = sum(p[1].nbytes for p in pairs)
        return self._submit("reduce_scatter_tensor", outputs, bufs, body, nbytes, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors: list, input_tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        outs = self._list(bufs, output_tensors, "output_tensor_list", out=True)
        ins = self._list(bufs, input_tensors, "input_tensor_list", out=False)
        for name, arrs in (("output_tensor_list", outs), ("input_tensor_list", ins)):
            for i, a in enumerate(arrs):
                if a.dtype != ins[0].dtype:
                    raise CollectiveArgumentError(f"{name}[{i}] has dtype {a.dtype}; expected {ins[0].dtype}")
        nbytes = sum(a.nbytes for a in ins)
        return self._submit("all_to_all", output_tensors, bufs, lambda: g.all_to_all(outs, ins), nbytes, opts)

    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: list,
        input_split_sizes: list,
        opts: Any = None,
    ) -> DistlaunchWork:
        g, bufs = self._g, _Bufs()
        out = bufs.view(output, "output", out=True)
        inp = bufs.view(input, "input", out=False)
        if out.dtype != inp.dtype:
            raise CollectiveArgumentError(f"output has dtype {output.dtype} but input has {input.dtype}")
        ob = split_bounds(tuple(output.shape), output.numel(), output_split_sizes or None, g.size, "output")
        ib = split_bounds(tuple(input.shape), input.numel(), input_split_sizes or None, g.size, "input")
        return self._submit(
            "all_to_all_single",
            [output],
            bufs,
            lambda: g.all_to_all_single(out, inp, ob, ib),
            inp.nbytes,
            opts,
        )

    alltoall_base = all_to_all_single

    def gather(self, output_tensors: list, input_tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs, root = self._g, _Bufs(), opts.rootRank
        inp = bufs.view(input_tensors[0], "tensor", out=False)
        outs = None
        if g.rank == root:
            outs = self._list(bufs, output_tensors[0], "gather_list", out=True)
            check_same(outs, inp, "gather_list")
        return self._submit(
            "gather", output_tensors, bufs, lambda: g.gather(inp, outs, root), inp.nbytes * g.size, opts
        )

    def scatter(self, output_tensors: list, input_tensors: list, opts: Any = None) -> DistlaunchWork:
        g, bufs, root = self._g, _Bufs(), opts.rootRank
        out = bufs.view(output_tensors[0], "tensor", out=True)
        ins = None
        if g.rank == root:
            ins = self._list(bufs, input_tensors[0], "scatter_list", out=False)
            check_same(ins, out, "scatter_list")
        return self._submit(
            "scatter", output_tensors, bufs, lambda: g.scatter(out, ins, root), out.nbytes * g.size, opts
        )

    def barrier(self, opts: Any = None) -> DistlaunchWork:
        g = self._g
        return self._submit("barrier", [], _Bufs(), lambda: g.barrier(), 0, opts)

    def _list(self, bufs: _Bufs, tensors: list, what: str, out: bool) -> list:
        if len(tensors) != self._g.size:
            raise CollectiveArgumentError(
                f"{what} has {len(tensors)} tensors; the group has {self._g.size} ranks"
            )
        return [bufs.view(t, f"{what}[{i}]", out) for i, t in enumerate(tensors)]

    # -- point to point (group ranks; not ordered with the collectives, as in the runtime)

    def send(self, tensors: list, dstRank: int, tag: int) -> DistlaunchWork:
        t = _check(tensors[0], "tensor")
        src = t if t.is_contiguous() else t.contiguous()  # kept alive by the Work's outputs
        arr = _Bufs().view(src, "tensor", out=False)
        try:
            req = self._g.isend(arr, dstRank, tag)
        except CollectiveError as e:
            raise _as_torch_error(e) from None
        return _P2PWork(f"send to {dstRank}", self._g.name, [src], req)

    def recv(self, tensors: list, srcRank: int, tag: int) -> DistlaunchWork:
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list, tag: int) -> DistlaunchWork:
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list, peer: int | None, tag: int) -> DistlaunchWork:
        bufs = _Bufs()
        arr = bufs.view(tensors[0], "tensor", out=True)
        try:
            req = self._g.irecv(arr, peer, tag, group_src=True)
        except CollectiveError as e:
            raise _as_torch_error(e) from None
        return _P2PWork(f"recv from {peer}", self._g.name, tensors, req, bufs.finish)

    # -- lifetime

    def shutdown(self) -> None:
        """Called by destroy_process_group: stop the helper thread, free the group's
        shared memory; for the default group, close the runtime (connections)."""
        if self._shut:
            return
        self._shut = True
        self._executor.close()
        if self._runtime is not None:
            self._runtime.close()
            if _STATE.get("runtime") is self._runtime:
                _STATE.clear()
        else:
            self._g.shutdown()

    def abort(self) -> None:
        self.shutdown()


# ----------------------------------------------------------------------------- bootstrap

_STATE: dict = {}  # "runtime": the Runtime of the current distlaunch default group


class _TorchStore:
    """The runtime's store interface (set/get/add/wait/check/close) over a torch Store.
    torch's stores are not authenticated: the runtime is given a token for them
    (``Runtime(token=...)``), from which it derives its transport key."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def wait(self, keys: list, timeout: float) -> None:
        self._store.wait(list(keys), datetime.timedelta(seconds=max(0.001, timeout)))

    def check(self, keys: list) -> bool:
        return bool(self._store.check(list(keys)))

    def close(self) -> None:
        pass  # torch owns its store


def _machine_id() -> str:
    """Host name and boot id: ranks with the same value can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}:{boot}"


def _new_runtime(store: Any, rank: int, size: int, timeout: float) -> Runtime:
    if (
        os.environ.get("DISTLAUNCH_STORE_PORT")
        and os.environ.get("RANK") == str(rank)
        and os.environ.get("WORLD_SIZE") == str(size)
    ):
        return launcher_runtime("torch", timeout)
    host = local_host_towards(os.environ.get("MASTER_ADDR", "localhost"))
    return Runtime(
        rank,
        size,
        _TorchStore(store),
        "distlaunch/torch/",
        timeout,
        host,
        node_id=_machine_id(),
        token=shared_token("torch-backend"),
    )


def _group_id(name: str) -> int:
    """The runtime's group id for torch's group name (decimal, or a hash of it):
    alike on every member."""
    if name.isdigit() and 0 < int(name) < 1 << 30:
        return int(name)
    return (1 << 30) | int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (3 << 30)


def _create(opts: Any, pg_options: Any = None) -> DistlaunchProcessGroup:
    """torch's backend creator (extended API): the default group starts a Runtime;
    subgroups of a distlaunch default group are groups of that runtime; a distlaunch
    subgroup of a non-distlaunch default group gets a runtime of its own."""
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout.total_seconds()
    ranks = list(opts.global_ranks_in_group)
    rt = _STATE.get("runtime")
    try:
        if ranks and rt is not None:
            g = rt.new_group_with_id(sorted(ranks), _group_id(str(opts.group_id)), timeout)
            return DistlaunchProcessGroup(g, None)
        rt = _new_runtime(opts.store, rank, size, timeout)
    except CollectiveError as e:
        raise _as_torch_error(e) from None
    if not ranks:
        _STATE["runtime"] = rt
    return DistlaunchProcessGroup(rt.world, rt)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


_register()
