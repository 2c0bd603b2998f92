"""Every op x dtype x root x ReduceOp against a numpy reference, in one launch.

Usage: matrix.py [--torch]   (torch: buffers are torch tensors sharing numpy memory)
Exits 1 naming the failing cases.
"""

import sys

import numpy as np
from common import DTYPES, Failures, data, init, wrap

import distlaunch.collectives as dist

USE_TORCH = "--torch" in sys.argv
rank, n = init()
F = Failures(rank)
W = lambda a: wrap(a, USE_TORCH)  # noqa: E731
SIZES = [1, 5, 33]
R = dist.ReduceOp


def valid_ops(dtype):
    kind = np.dtype(dtype).kind
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if kind in "biu":
        ops += [R.BAND, R.BOR, R.BXOR]
    if kind == "f":
        ops.append(R.AVG)
    return ops


def reference(inputs, op, dtype):
    ufunc = {
        R.SUM: np.add,
        R.AVG: np.add,
        R.PRODUCT: np.multiply,
        R.MIN: np.minimum,
        R.MAX: np.maximum,
        R.BAND: np.bitwise_and,
        R.BOR: np.bitwise_or,
        R.BXOR: np.bitwise_xor,
    }[op]
    acc = inputs[0].copy()
    for x in inputs[1:]:
        ufunc(acc, x, out=acc)
    if op == R.AVG:
        np.divide(acc, len(inputs), out=acc)
    return acc


def inputs_of(dtype, size, seed, op=None):
    return [data(r, dtype, size, seed, positive=(op == R.PRODUCT)) for r in range(n)]


seed = 0
for dtype in DTYPES:
    for size in SIZES:
        seed += 1
        tag = f"{dtype}[{size}]"
        # broadcast / scatter / gather from every root
        for root in range(n):
            x = data(rank, dtype, size, seed)
            F.run(f"broadcast {tag} root={root}", lambda: dist.broadcast(W(x), src=root))
            F.check(f"broadcast {tag} root={root}", x, data(root, dtype, size, seed))

            out = np.zeros(size, dtype)
            lst = [W(data(root, dtype, size, seed + 100 + i)) for i in range(n)] if rank == root else None
            F.run(f"scatter {tag} root={root}", lambda: dist.scatter(W(out), lst, src=root))
            F.check(f"scatter {tag} root={root}", out, data(root, dtype, size, seed + 100 + rank))

            x = data(rank, dtype, size, seed)
            outs = [np.zeros(size, dtype) for _ in range(n)] if rank == root else None
            F.run(
                f"gather {tag} root={root}",
                lambda: dist.gather(W(x), [W(o) for o in outs] if outs else None, dst=root),
            )
            if rank == root:
                for i in range(n):
                    F.check(f"gather {tag} root={root} from {i}", outs[i], data(i, dtype, size, seed))

        for op in valid_ops(dtype):
            ins = inputs_of(dtype, size, seed, op)
            want = reference(ins, op, dtype)
            x = ins[rank].copy()
            F.run(f"all_reduce {tag} {op.name}", lambda: dist.all_reduce(W(x), op=op))
            F.check(f"all_reduce {tag} {op.name}", x, want)
            for root in range(n):
                x = ins[rank].copy()
                F.run(f"reduce {tag} {op.name} root={root}", lambda: dist.reduce(W(x), dst=root, op=op))
                F.check(f"reduce {tag} {op.name} root={root}", x, want if rank == root else ins[rank])
            # reduce_scatter: rank i gets block i of the reduction of the concatenations
            blocks = [
                [data(r, dtype, size, seed + 200 + i, op == R.PRODUCT) for i in range(n)] for r in range(n)
            ]
            want_rs = reference([b[rank] for b in blocks], op, dtype)
            out = np.zeros(size, dtype)
            F.run(
                f"reduce_scatter {tag} {op.name}",
                lambda: dist.reduce_scatter(W(out), [W(b) for b in blocks[rank]], op=op),
            )
            F.check(f"reduce_scatter {tag} {op.name}", out, want_rs)
            out = np.zeros(size, dtype)
            flat_in = np.concatenate(blocks[rank])
            F.run(
                f"reduce_scatter_tensor {tag} {op.name}",
                lambda: dist.reduce_scatter_tensor(W(out), W(flat_in), op=op),
            )
            F.check(f"reduce_scatter_tensor {tag} {op.name}", out, want_rs)
            F.check(f"reduce_scatter_tensor {tag} input unchanged", flat_in, np.concatenate(blocks[rank]))

        x = data(rank, dtype, size, seed)
        outs = [np.zeros(size, dtype) for _ in range(n)]
        F.run(f"all_gather {tag}", lambda: dist.all_gather([W(o) for o in outs], W(x)))
        for i in range(n):
            F.check(f"all_gather {tag} from {i}", outs[i], data(i, dtype, size, seed))
        out = np.zeros(size * n, dtype)
        F.run(f"all_gather_into_tensor {tag}", lambda: dist.all_gather_into_tensor(W(out), W(x)))
        F.check(
            f"all_gather_into_tensor {tag}",
            out,
            np.concatenate([data(i, dtype, size, seed) for i in range(n)]),
        )

        # all_to_all: rank r sends block j = data(r, seed*1000+j) of size (r+j)%3+size to rank j
        sz = lambda src, dst: (src + dst) % 3 + size  # noqa: E731
        ins = [data(rank, dtype, sz(rank, j), seed + 300 + j) for j in range(n)]
        outs = [np.zeros(sz(j, rank), dtype) for j in range(n)]
        F.run(f"all_to_all {tag}", lambda: dist.all_to_all([W(o) for o in outs], [W(i) for i in ins]))
        for j in range(n):
            F.check(f"all_to_all {tag} from {j}", outs[j], data(j, dtype, sz(j, rank), seed + 300 + rank))
        # all_to_all_single with uneven splits along dim 0 (rows of 2 elements)
        in_splits = [sz(rank, j) for j in range(n)]
        out_splits = [sz(j, rank) for j in range(n)]
        inp = np.concatenate(
            [data(rank, dtype, 2 * s, seed + 400 + j) for j, s in enumerate(in_splits)]
        ).reshape(-1, 2)
        out = np.zeros((sum(out_splits), 2), dtype)
        F.run(
            f"all_to_all_single {tag}", lambda: dist.all_to_all_single(W(out), W(inp), out_splits, in_splits)
        )
        F.check(
            f"all_to_all_single {tag}",
            out.reshape(-1),
            np.concatenate([data(j, dtype, 2 * s, seed + 400 + rank) for j, s in enumerate(out_splits)]),
        )
        if size == 5:  # equal splits (defaults)
            inp = data(rank, dtype, n * 3, seed + 500).reshape(n, 3)
            out = np.zeros((n, 3), dtype)
            F.run(f"all_to_all_single equal {tag}", lambda: dist.all_to_all_single(W(out), W(inp)))
            F.check(
                f"all_to_all_single equal {tag}",
                out,
                np.stack([data(j, dtype, n * 3, seed + 500).reshape(n, 3)[rank] for j in range(n)]),
            )

        # point to point: ring shift, blocking and async
        if n > 1:
            right, left = (rank + 1) % n, (rank - 1) % n
            x = data(rank, dtype, size, seed + 600)
            got = np.zeros(size, dtype)

            def shift():  # noqa: E306
                w = dist.isend(W(x), dst=right, tag=size)
                src = dist.recv(W(got), src=left, tag=size)
                w.wait()
                assert src == left, src

            F.run(f"isend/recv {tag}", shift)
            F.check(f"isend/recv {tag}", got, data(left, dtype, size, seed + 600))
            got = np.zeros(size, dtype)

            def shift_any():  # noqa: E306
                w = dist.irecv(W(got), tag=7)
                dist.send(W(x), dst=right, tag=7)
                assert w.wait() and w.is_completed()
                assert w.result() == left, w.result()

            F.run(f"irecv(any)/send {tag}", shift_any)
            F.check(f"irecv(any)/send {tag}", got, data(left, dtype, size, seed + 600))

# zero-size buffers and a bigger-than-ring-threshold size for the main reductions
for size in (0, 40_000):
    for dtype in ("float32", "int64"):
        for op in (R.SUM, R.MAX):
            ins = inputs_of(dtype, size, 77)
            x = ins[rank].copy()
            F.run(f"all_reduce {dtype}[{size}] {op.name}", lambda: dist.all_reduce(W(x), op=op))
            F.check(f"all_reduce {dtype}[{size}] {op.name}", x, reference(ins, op, dtype))
            for root in range(n):
                x = ins[rank].copy()
                F.run(f"reduce {dtype}[{size}] root={root}", lambda: dist.reduce(W(x), dst=root, op=op))
                F.check(
                    f"reduce {dtype}[{size}] root={root}",
                    x,
                    reference(ins, op, dtype) if rank == root else ins[rank],
                )
            x = data(rank, dtype, size, 78)
            F.run(f"broadcast {dtype}[{size}]", lambda: dist.broadcast(W(x), src=n - 1))
            F.check(f"broadcast {dtype}[{size}]", x, data(n - 1, dtype, size, 78))

# multi-dimensional buffers, memoryview/bytearray buffers
x = np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1)
F.run("all_reduce 2-D", lambda: dist.all_reduce(W(x)))
F.check("all_reduce 2-D", x, np.arange(12, dtype=np.float64).reshape(3, 4) * (n * (n + 1) // 2))
if not USE_TORCH:
    ba = bytearray([rank + 1] * 8)
    F.run("all_reduce bytearray", lambda: dist.all_reduce(ba, op=R.MAX))
    F.check("all_reduce bytearray", np.frombuffer(ba, np.uint8), np.full(8, n, np.uint8))
    mv = memoryview(bytearray(np.full(3, rank, np.int32).tobytes())).cast("i")
    F.run("all_reduce memoryview", lambda: dist.all_reduce(mv))
    F.check("all_reduce memoryview", np.asarray(mv), np.full(3, n * (n - 1) // 2, np.int32))

# bit-identical float results on every rank (non-integer values; small and ring sizes)
for size in (1000, 100_000):
    for dtype in ("float32", "float64", "float16"):
        x = np.random.default_rng(rank).standard_normal(size).astype(dtype)
        F.run(f"all_reduce bits {dtype}[{size}]", lambda: dist.all_reduce(W(x)))
        allx = np.zeros(size * n, dtype)
        F.run("all_gather bits", lambda: dist.all_gather_into_tensor(W(allx), W(x)))
        for i in range(n):
            F.check(
                f"all_reduce bit-identical {dtype}[{size}] rank {i}",
                allx[i * size : (i + 1) * size].view(np.uint8),
                x.view(np.uint8),
            )

F.run("barrier", dist.barrier)
F.exit()
dist.destroy_process_group()
