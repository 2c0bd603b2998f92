"""Every operation of the distlaunch torch backend x representative dtypes, checked
against gloo run in the same processes (a gloo group over the same ranks, same inputs).

Run under `distlaunch run` (or torchrun) with the distlaunch backend as the default
group. Inputs are integer-valued (reductions are then exact in every dtype, so results
must be bit-identical whatever the reduction order), plus one random-valued pass per
floating dtype compared with torch.testing's default tolerances for the dtype (exact at
world <= 2, where a sum of two values has one rounding). Where gloo does not support an
operation/dtype pair (e.g. AVG), the reference is torch computing the result from every
rank's inputs (each rank can regenerate all inputs from their seeds).

Prints "ops ok <checks>", "futures ok", "large ok", "ddp ok" (one line per check group) and exits 0;
any difference raises.
"""

import os
import sys
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import distlaunch.torch as dlt

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int8, torch.uint8]
ALL = FLOATS + INTS + [torch.bool]
checks = 0


def data(rank, key, dtype, shape=(6, 4), small=False, rand=False):
    """Deterministic input of ``rank`` for the check named ``key``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{key}/{dtype}".encode()))
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if rand:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if small:  # products of 4 of these stay exact in bfloat16
        return torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, shape, generator=g)].to(dtype)
    lo = 0 if dtype in (torch.uint8,) else -8
    return torch.randint(lo, 9, shape, generator=g).to(dtype)


def same(ours, ref, what, exact=True):
    global checks
    checks += 1
    ours, ref = list(ours), list(ref)
    assert len(ours) == len(ref), what
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
        if exact:
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
            ok = torch.equal(a.view(bits), b.view(bits)) if a.dtype.is_floating_point else torch.equal(a, b)
            assert ok, f"{what}: {a} != {b}"
        else:
            torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}")


def both(fn, *args, **kw):
    """fn run on the distlaunch world and on the gloo group: (ours, gloo or None)."""
    ours = fn(None, *args, **kw)
    try:
        ref = fn(GLOO, *args, **kw)
    except (RuntimeError, ValueError) as e:  # gloo lacks the op/dtype: caller uses torch
        if "distlaunch" in str(e):
            raise
        print(f"gloo: {e}".splitlines()[0][:200], file=sys.stderr)
        ref = None
    return ours, ref


def reduce_ref(xs, op, dtype):
    """torch's own reduction of every rank's inputs (reference where gloo has none)."""
    wide = [x.to(torch.float64) if dtype.is_floating_point else x.to(torch.int64) for x in xs]
    acc = wide[0].clone()
    for x in wide[1:]:
        if op in (R.SUM, R.AVG):
            acc = (acc + x) if dtype is not torch.bool else (acc.bool() | x.bool())
        elif op == R.PRODUCT:
            acc = acc * x if dtype is not torch.bool else (acc.bool() & x.bool())
        elif op == R.MIN:
            acc = torch.minimum(acc, x)
        elif op == R.MAX:
            acc = torch.maximum(acc, x)
        elif op == R.BAND:
            acc = acc & x
        elif op == R.BOR:
            acc = acc | x
        elif op == R.BXOR:
            acc = acc ^ x
    if op == R.AVG:
        acc = acc / len(xs)
    return acc.to(dtype)


def ops_for(dtype):
    if dtype is torch.bool:
        return [R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_floating_point:
        return [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def check_all_reduce():
    global checks
    for dtype in ALL:
        for op in ops_for(dtype):
            key, small = f"ar{op}", op == R.PRODUCT

            def run(group):
                t = data(RANK, key, dtype, small=small)
                dist.all_reduce(t, op=op, group=group)
                return [t]

            ours, ref = both(run)
            if ref is None:
                ref = [reduce_ref([data(r, key, dtype, small=small) for r in range(N)], op, dtype)]
            same(ours, ref, f"all_reduce {op} {dtype}")
    for dtype in FLOATS:  # random values: rounding depends on the order beyond two ranks

        def run(group):
            t = data(RANK, "rand", dtype, shape=(257,), rand=True)
            dist.all_reduce(t, group=group)
            return [t]

        ours, ref = both(run)
        if N <= 2 or dtype not in (torch.float16, torch.bfloat16):
            same(ours, ref, f"all_reduce random {dtype}", exact=N <= 2)
            continue
        # half precision beyond two ranks: distlaunch sums in float32 and rounds once, gloo
        # rounds after every addition. Bounds (eps: the dtype's machine epsilon, S: the sum
        # of |inputs|): ours within eps/2 of the exact sum (+ float32's error), and within
        # the recursive-summation bound (N-1) * eps * S of gloo's.
        xs = torch.stack([data(r, "rand", dtype, shape=(257,), rand=True).double() for r in range(N)])
        exact, mag, eps = xs.sum(0), xs.abs().sum(0), torch.finfo(dtype).eps
        mine, theirs = ours[0].double(), ref[0].double()
        assert ((mine - exact).abs() <= eps / 2 * exact.abs() + 2**-23 * mag).all(), f"{dtype} vs exact"
        assert ((mine - theirs).abs() <= (N - 1) * eps * mag).all(), f"{dtype} vs gloo"
        checks += 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64):  # non-contiguous views

        def run(group):
            base = data(RANK, "nc", dtype, shape=(6, 8))
            view = base.t()[::2]  # strided, non-contiguous
            dist.all_reduce(view, group=group)
            return [base]

        ours = run(None)
        ref = data(RANK, "nc", dtype, shape=(6, 8))
        total = reduce_ref([data(r, "nc", dtype, shape=(6, 8)).t()[::2] for r in range(N)], R.SUM, dtype)
        ref.t()[::2].copy_(total)
        same(ours, [ref], f"all_reduce non-contiguous {dtype}")
    for dtype in (torch.float32, torch.bfloat16):  # the coalesced form (mixed shapes, one call)

        def run(group):
            ts = [data(RANK, f"co{i}", dtype, shape=(i + 1, 3)) for i in range(3)]
            dist.all_reduce_coalesced(ts, group=group)
            return ts

        same(*both(run), f"all_reduce_coalesced {dtype}")


def check_movement():
    last = N - 1
    for dtype in ALL:

        def bcast(group):
            t = data(RANK, "bc", dtype)
            dist.broadcast(t, src=last, group=group)
            return [t]

        def gather_list(group):
            outs = [torch.empty(3, 5, dtype=dtype) for _ in range(N)]
            dist.all_gather(outs, data(RANK, "ag", dtype, shape=(3, 5)), group=group)
            return outs

        def gather_tensor(group):
            out = torch.empty(N * 3, 5, dtype=dtype)
            dist.all_gather_into_tensor(out, data(RANK, "agt", dtype, shape=(3, 5)), group=group)
            return [out]

        def a2a(group):
            outs = [torch.empty(2, 2, dtype=dtype) for r in range(N)]  # gloo: equal sizes only
            ins = [data(RANK, f"a2a{d}", dtype, shape=(2, 2)) for d in range(N)]
            dist.all_to_all(outs, ins, group=group)
            return outs

        def a2a_single(group):
            in_splits = [(RANK + d) % 3 for d in range(N)]
            out_splits = [(r + RANK) % 3 for r in range(N)]
            out = torch.empty(sum(out_splits), 3, dtype=dtype)
            inp = data(RANK, "a2as", dtype, shape=(sum(in_splits), 3))
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
            return [out]

        def gather(group):
            outs = [torch.empty(4, dtype=dtype) for _ in range(N)] if RANK == 0 else None
            dist.gather(data(RANK, "ga", dtype, shape=(4,)), outs, dst=0, group=group)
            return outs or []

        def scatter(group):
            out = torch.empty(4, dtype=dtype)
            ins = [data(d, "sc", dtype, shape=(4,)) for d in range(N)] if RANK == last else None
            dist.scatter(out, ins, src=last, group=group)
            return [out]

        for fn in (bcast, gather_list, gather_tensor, a2a, a2a_single, gather, scatter):
            same(*both(fn), f"{fn.__name__} {dtype}")


def check_reduce_family():
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8):
        for op in (R.SUM, R.MAX) + ((R.BXOR,) if not dtype.is_floating_point else ()):

            def red(group):
                t = data(RANK, f"rd{op}", dtype)
                dist.reduce(t, dst=N - 1, op=op, group=group)
                return [t] if RANK == N - 1 else []

            def rs_list(group):
                out = torch.empty(2, 3, dtype=dtype)
                ins = [data(RANK, f"rs{op}{d}", dtype, shape=(2, 3)) for d in range(N)]
                dist.reduce_scatter(out, ins, op=op, group=group)
                return [out]

            def rs_tensor(group):
                out = torch.empty(2, 3, dtype=dtype)
                inp = data(RANK, f"rst{op}", dtype, shape=(2 * N, 3))
                dist.reduce_scatter_tensor(out, inp, op=op, group=group)
                return [out]

            for fn in (red, rs_list, rs_tensor):
                ours, ref = both(fn)
                if ref is None:  # gloo has no reduce_scatter: torch reduces every rank's inputs
                    ref = ref_reduce_family(fn.__name__, op, dtype)
                same(ours, ref, f"{fn.__name__} {op} {dtype}")


def ref_reduce_family(name, op, dtype):
    if name == "red":
        return [reduce_ref([data(r, f"rd{op}", dtype) for r in range(N)], op, dtype)] if RANK == N - 1 else []
    if name == "rs_list":
        return [reduce_ref([data(r, f"rs{op}{RANK}", dtype, shape=(2, 3)) for r in range(N)], op, dtype)]
    blocks = [data(r, f"rst{op}", dtype, shape=(2 * N, 3))[2 * RANK : 2 * RANK + 2] for r in range(N)]
    return [reduce_ref(blocks, op, dtype)]


def check_p2p_and_groups():
    global checks
    if N > 1:
        for tag, dtype in enumerate((torch.float32, torch.bfloat16, torch.int64), start=1):
            right, left = (RANK + 1) % N, (RANK - 1) % N
            for group in (None, GLOO):
                out = torch.empty(7, dtype=dtype)
                reqs = [dist.isend(data(RANK, "p2p", dtype, shape=(7,)), right, group=group)]
                reqs.append(dist.irecv(out, left, group=group))
                for q in reqs:
                    q.wait()
                same([out], [data(left, "p2p", dtype, shape=(7,))], f"isend/irecv {dtype}")
            if RANK == 0:  # blocking send/recv, and recv from any source
                for _ in range(1, N):
                    buf = torch.empty(3, dtype=dtype)
                    got = dist.recv(buf, tag=tag)  # any source: the tag keeps phases apart
                    same([buf], [data(got, "any", dtype, shape=(3,))], f"recv any {dtype}")
            else:
                dist.send(data(RANK, "any", dtype, shape=(3,)), 0, tag=tag)
    # subgroups: every rank creates every group (as torch requires), members use it
    sub_ranks = [r for r in range(N) if r % 2 == 0]
    sub = dist.new_group(sub_ranks)
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(N)])
    t = data(RANK, "alone", torch.int32)
    dist.all_reduce(t, group=alone)
    same([t], [data(RANK, "alone", torch.int32)], "one-rank subgroup")
    if RANK in sub_ranks:
        t = data(RANK, "sub", torch.float32)
        dist.all_reduce(t, group=sub)
        ref = reduce_ref([data(r, "sub", torch.float32) for r in sub_ranks], R.SUM, torch.float32)
        same([t], [ref], "subgroup")
    dist.barrier()
    objs = [None] * N
    dist.all_gather_object(objs, {"rank": RANK, "s": "x" * RANK})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(N)], objs
    checks += 1


def check_futures():
    """async_op=True: Work.wait() and get_future() (value: the output tensors), chained."""
    works = []
    for i in range(4):
        t = torch.full((1 << (10 + 3 * i),), float(RANK + i))  # 4 KiB .. 2 MiB: inline and queued
        w = dist.all_reduce(t, async_op=True)
        works.append((t, w, w.get_future().then(lambda f: f.value()[0] * 2)))
    for i, (t, w, chained) in enumerate(works):
        expect = float(sum(r + i for r in range(N)))
        assert w.wait() is True
        assert w.is_completed() and w.is_success()
        assert torch.equal(chained.wait(), torch.full_like(t, 2 * expect)), i
        assert torch.equal(t, torch.full_like(t, expect))
    print("futures ok", flush=True)


def check_large_bits():
    """all_reduce / reduce of a multi-chunk float32 tensor (5 MiB + 3 elements: the
    shared-memory chunked algorithms, a ragged last chunk) with random values and NaNs
    of a different payload on every rank: every rank's result has the bits of the sum in
    rank order (x0 + x1 + ...; for two NaNs x86 keeps the first operand's payload, so a
    rank adding in another order differs), blocking and async_op=True (DDP's path)."""
    size = (5 << 20) // 4 + 3

    def inp(r):
        x = torch.randn(size, generator=torch.Generator().manual_seed(100 + r))
        nan = torch.tensor([0x7FC00001 + r], dtype=torch.int32).view(torch.float32)
        x[r :: 1 << 16] = nan  # some positions: every rank's NaN; some: one rank's
        x[N :: 1 << 16] = nan
        return x

    ins = [inp(r).numpy() for r in range(N)]
    want = ins[0].copy()
    for x in ins[1:]:
        np.add(want, x, out=want)
    want_t = torch.from_numpy(want)
    for async_op in (False, True):
        t = inp(RANK)
        w = dist.all_reduce(t, async_op=async_op)
        if async_op:
            w.wait()
        same([t], [want_t], f"all_reduce {size} float32 bits async_op={async_op}")
        t = inp(RANK)
        w = dist.reduce(t, dst=N - 1, async_op=async_op)
        if async_op:
            w.wait()
        same([t], [want_t if RANK == N - 1 else inp(RANK)], f"reduce to {N - 1} bits async_op={async_op}")
    print("large ok", flush=True)


def check_ddp():
    """The same model trained with DDP over distlaunch and over gloo: identical parameters
    on every rank, and equal to each other."""
    params = {}
    for name, group in (("distlaunch", None), ("gloo", GLOO)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        if RANK:  # different starts: DDP's initial broadcast must fix them
            for p in model.parameters():
                p.data.add_(RANK)
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(RANK)
        for _ in range(5):
            x = torch.randn(8, 16, generator=gen)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(flat) for _ in range(N)]
        dist.all_gather(everyone, flat, group=GLOO)
        for other in everyone:
            assert torch.equal(other, flat), f"{name}: parameters differ between ranks"
        params[name] = flat
    same([params["distlaunch"]], [params["gloo"]], "ddp distlaunch vs gloo", exact=N <= 2)
    print("ddp ok", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group(dlt.BACKEND)
    RANK, N = dist.get_rank(), dist.get_world_size()
    GLOO = dist.new_group(backend="gloo")
    assert dist.get_backend() == "distlaunch"
    check_all_reduce()
    check_movement()
    check_reduce_family()
    check_p2p_and_groups()
    print(f"ops ok {checks}", flush=True)
    check_futures()
    if N > 1:
        check_large_bits()
    if N in (2, 4):
        check_ddp()
    time.sleep(0.2)  # let gloo's worker thread release its last op first (as init_methods.py)
    dist.destroy_process_group()
    sys.exit(0 if os.environ.get("RANK") is not None else 1)
