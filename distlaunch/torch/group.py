"""The backend's torch ProcessGroup over one ``distlaunch.collectives`` group (see the
package docstring for semantics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.buffers import check_same, split_bounds
from ..collectives.errors import CollectiveArgumentError, CollectiveError
from ..collectives.group import ProcessGroup as Group
from ..collectives.ops import check_op
from ..collectives.runtime import Runtime
from ..collectives.work import Executor
from .bootstrap import _STATE
from .errors import _as_torch_error
from .tensors import _PLAIN, Tensor, _Bufs, _check, _op
from .work import DistlaunchWork, _P2PWork, _run_now

BACKEND = "distlaunch"
# bytes up to which an async_op=True operation still runs in the calling thread (when
# the group is idle): handing it to a thread costs more than it could overlap
INLINE_BYTES = 1 << 16

# torch's stubs give ProcessGroup's methods pybind overloads (e.g. ``allreduce(tensor,
# op)``) that a Python override taking torch's C++ signature cannot match; the trampoline
# only ever calls the C++ signature, so the bases are typed loosely
_TorchProcessGroup: Any = dist.ProcessGroup


class DistlaunchProcessGroup(_TorchProcessGroup):
    """torch ProcessGroup over one ``distlaunch.collectives`` group. Created by
    ``init_process_group("distlaunch")`` / ``new_group(backend="distlaunch")``; every
    method takes torch's arguments (lists of CPU tensors and an options object) and
    returns a :class:`DistlaunchWork` (see the package docstring for semantics)."""

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
