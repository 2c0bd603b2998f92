"""Feature checks, one launch per mode; usage: features.py MODE [--torch].
Exits 1 naming the failing case (via common.Failures).

subgroups  new_group membership, ranks, ops inside overlapping groups, NON_GROUP_MEMBER
async      isend/irecv overlap, async_op=True collectives, Work.wait/is_completed
objects    object collectives with arbitrary picklable objects (small and > 1 MiB)
large      8 B .. 16 MiB messages across the algorithm thresholds
runahead   two ranks' chunked all_reduce runs a slot ahead of a stalled peer; results
chunked    n > 2 ranks' chunked all_reduce and reduce: every rank gets the bits of the
           reduction in rank order (dtypes, ops, roots, NaN payloads, 1/2/many chunks, a
           stalling rank; run with a small slot and chunk)
badargs    bad buffers/arguments raise CollectiveArgumentError locally; group still works
basic      a small all_reduce + broadcast (used for the init-method tests)
"""

import os
import sys

import numpy as np
from common import Failures, data, init, wrap

import distlaunch.collectives as dist

mode = sys.argv[1]
USE_TORCH = "--torch" in sys.argv
W = lambda a: wrap(a, USE_TORCH)  # noqa: E731
rank, n = init(timeout=float(os.environ.get("COLL_TEST_INIT_TIMEOUT", 30)))
F = Failures(rank)
R = dist.ReduceOp


def expect_error(name, cls, fn, words=()):
    F.count += 1
    try:
        fn()
    except cls as e:
        missing = [w for w in words if w not in str(e)]
        if missing:
            F.items.append(f"{name}: message {str(e)!r} lacks {missing}")
        return
    except Exception as e:
        F.items.append(f"{name}: {type(e).__name__} instead of {cls.__name__}: {e}")
        return
    F.items.append(f"{name}: no error")


if mode == "basic":
    x = W(np.full(3, rank + 1, np.int64))
    F.run("all_reduce", lambda: dist.all_reduce(x))
    F.check("all_reduce", np.asarray(x), np.full(3, n * (n + 1) // 2, np.int64))
    y = np.arange(4.0) if rank == 0 else np.zeros(4)
    F.run("broadcast", lambda: dist.broadcast(W(y), src=0))
    F.check("broadcast", y, np.arange(4.0))
    F.check("is_initialized", dist.is_initialized(), True)
    out = np.zeros(2 * n)
    F.run("all_gather_single", lambda: dist.all_gather_single(W(out), W(np.full(2, float(rank)))))
    F.check("all_gather_single", out, np.repeat(np.arange(n, dtype=float), 2))
    red = np.zeros(1)
    F.run("reduce_scatter_single", lambda: dist.reduce_scatter_single(W(red), W(np.arange(float(n)))))
    F.check("reduce_scatter_single", red, np.array([float(rank * n)]))

elif mode == "subgroups":
    assert n == 4
    evens = dist.new_group([0, 2])
    upper = dist.new_group([1, 2, 3])
    world2 = dist.new_group()
    F.check("WORLD", dist.GroupMember.WORLD is not None, True)
    in_evens, in_upper = rank in (0, 2), rank in (1, 2, 3)
    F.check("non-member sentinel evens", evens is dist.GroupMember.NON_GROUP_MEMBER, not in_evens)
    F.check("non-member sentinel upper", upper is dist.GroupMember.NON_GROUP_MEMBER, not in_upper)
    F.check("get_rank evens", dist.get_rank(evens), {0: 0, 2: 1}.get(rank, -1))
    F.check("get_rank upper", dist.get_rank(upper), {1: 0, 2: 1, 3: 2}.get(rank, -1))
    F.check("get_world_size evens", dist.get_world_size(evens), 2 if in_evens else -1)
    F.check("get_world_size upper", dist.get_world_size(upper), 3 if in_upper else -1)
    if in_upper:
        F.check("get_global_rank", dist.get_global_rank(upper, 2), 3)
        F.check("get_group_rank", dist.get_group_rank(upper, 3), 2)
        F.check("get_process_group_ranks", dist.get_process_group_ranks(upper), [1, 2, 3])
    for _rep in range(3):
        # ops on both groups issued async at once (rank 2 is in both), then the world
        x = np.full(5, rank + 1.0)
        y = np.full(4, 10.0 * (rank + 1))
        w1 = dist.all_reduce(W(x), group=evens, async_op=True)
        w2 = dist.all_reduce(W(y), op=R.MAX, group=upper, async_op=True)
        F.check("non-member op returns None", w1 is None, not in_evens)
        for w in (w1, w2):
            if w is not None:
                F.run("wait", w.wait)
        F.check("evens all_reduce", x, np.full(5, 4.0) if in_evens else np.full(5, rank + 1.0))
        F.check("upper all_reduce MAX", y, np.full(4, 40.0) if in_upper else np.full(4, 10.0 * (rank + 1)))
        # broadcast with a global src inside the group, and group_src
        z = np.full(3, float(rank))
        F.run("upper broadcast src=3", lambda: dist.broadcast(W(z), src=3, group=upper))
        F.check("upper broadcast src=3", z, np.full(3, 3.0) if in_upper else np.full(3, float(rank)))
        z = np.full(3, float(rank))
        F.run("evens broadcast group_src=1", lambda: dist.broadcast(W(z), group=evens, group_src=1))
        F.check("evens broadcast group_src=1", z, np.full(3, 2.0) if in_evens else np.full(3, float(rank)))
        if in_upper:  # gather to global rank 1 (group rank 0)
            outs = [np.zeros(2) for _ in range(3)] if rank == 1 else None
            F.run(
                "upper gather",
                lambda: dist.gather(
                    W(np.full(2, float(rank))), outs and [W(o) for o in outs], dst=1, group=upper
                ),
            )
            if rank == 1:
                F.check("upper gather", np.stack(outs), np.array([[1.0, 1], [2, 2], [3, 3]]))
            # p2p inside the group, group ranks
            if rank == 1:
                F.run("group send", lambda: dist.send(W(np.arange(3.0)), group=upper, group_dst=2))
            if rank == 3:
                got = np.zeros(3)
                src = dist.recv(W(got), group=upper, group_src=0)
                F.check("group recv", got, np.arange(3.0))
                F.check("group recv source (group rank)", src, 0)
        ws = np.full(2, 1.0)
        F.run("world2 all_reduce", lambda: dist.all_reduce(W(ws), group=world2))
        F.check("world2 all_reduce", ws, np.full(2, 4.0))
        F.run("world barrier", dist.barrier)
    expect_error(
        "src outside group",
        dist.CollectiveArgumentError,
        lambda: dist.broadcast(np.zeros(1), src=0, group=upper),
        ["not a rank"],
    ) if in_upper else None
    dist.destroy_process_group(evens)
    F.run("world after destroying a subgroup", dist.barrier)

elif mode == "async":
    right, left = (rank + 1) % n, (rank - 1) % n
    # many isend/irecv in flight at once, large enough not to fit in socket buffers
    big = [data(rank, "float32", 1 << 20, s) for s in range(4)]
    got = [np.zeros(1 << 20, np.float32) for _ in range(4)]
    recvs = [dist.irecv(W(g), src=left, tag=s) for s, g in enumerate(got)]
    sends = [dist.isend(W(b), dst=right, tag=s) for s, b in enumerate(big)]
    for w in recvs + sends:
        F.run("p2p wait", w.wait)
        F.check("p2p is_completed", w.is_completed(), True)
    for s in range(4):
        F.check(f"isend/irecv tag {s}", got[s], data(left, "float32", 1 << 20, s))
    # both directions at once (exchange) with blocking calls ordered to deadlock without overlap
    a = data(rank, "float64", 300_000, 9)
    b = np.zeros_like(a)
    peer = rank ^ 1
    if peer < n:
        w = dist.isend(W(a), dst=peer, tag=99)
        dist.recv(W(b), src=peer, tag=99)
        w.wait()
        F.check("exchange", b, data(peer, "float64", 300_000, 9))
    # batch_isend_irecv: receives listed before sends, both neighbours at once
    fl, fr = np.zeros(1000), np.zeros(1000)
    ops = [
        dist.P2POp(dist.irecv, W(fl), left),
        dist.P2POp(dist.irecv, W(fr), right, tag=1),
        dist.P2POp(dist.isend, W(np.full(1000, float(rank))), right),
        dist.P2POp(dist.isend, W(np.full(1000, float(rank))), left, tag=1),
    ]
    if n > 1:
        for w in dist.batch_isend_irecv(ops):
            F.run("batch wait", w.wait)
        F.check("batch_isend_irecv", (fl[0], fr[0]), (float(left), float(right)))
    # tags are matched independently of arrival order
    if n > 1:
        if rank == 0:
            first, second = np.zeros(2), np.zeros(2)
            w2 = dist.irecv(W(second), src=1, tag=2)
            dist.recv(W(first), src=1, tag=1)
            w2.wait()
            F.check("tag order", np.concatenate([first, second]), np.array([1.0, 1, 2, 2]))
        elif rank == 1:
            dist.send(W(np.full(2, 2.0)), dst=0, tag=2)
            dist.send(W(np.full(2, 1.0)), dst=0, tag=1)
    # async collectives: several queued, results in order
    xs = [np.full(1000 * (i + 1), float(rank + i)) for i in range(5)]
    works = [dist.all_reduce(W(x), async_op=True) for x in xs]
    bw = dist.broadcast(W(np.zeros(10) if rank else np.arange(10.0)), src=0, async_op=True)
    bar = dist.barrier(async_op=True)
    for i, w in enumerate(works):
        F.check("Work.wait returns True", w.wait(), True)
        F.check(f"async all_reduce {i}", xs[i], np.full(1000 * (i + 1), float(sum(r + i for r in range(n)))))
    F.run("broadcast wait", bw.wait)
    F.run("barrier wait", bar.wait)
    F.check("is_completed", all(w.is_completed() for w in works + [bw, bar]), True)
    # a blocking collective after async ones runs after them
    x = np.ones(3)
    w = dist.all_reduce(W(np.ones(200_000)), async_op=True)
    dist.all_reduce(W(x))
    F.check("blocking after async", (w.is_completed(), x.tolist()), (True, [float(n)] * 3))
    # Work.wait(timeout) on a receive nobody sends yet
    if n > 1:
        if rank == 0:
            g = np.zeros(1)
            w = dist.irecv(W(g), src=1, tag=1234)
            expect_error("Work.wait(timeout)", dist.CollectiveTimeoutError, lambda: w.wait(timeout=0.2))
            F.check("not completed", w.is_completed(), False)
            dist.send(W(np.zeros(1)), dst=1, tag=55)  # tell rank 1 to send now
            F.check("wait after timeout", w.wait(), True)
            F.check("late value", g, np.array([7.0]))
        elif rank == 1:
            dist.recv(W(np.zeros(1)), src=0, tag=55)
            dist.send(W(np.array([7.0])), dst=0, tag=1234)

elif mode == "objects":

    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def __eq__(self, other):
            return (self.x, self.y) == (other.x, other.y)

    def obj(r):
        return {
            "rank": r,
            "name": f"worker-{r}",
            "nested": [r, (r, r * 2), {r}],
            "p": Point(r, -r),
            "arr": np.arange(r + 1),
            "blob": b"x" * (r * 1000),
        }

    def same(a, b):
        return all((np.array_equal(a[k], b[k]) if k == "arr" else a[k] == b[k]) for k in a)

    for root in range(n):
        lst = [obj(root), "two", 3] if rank == root else [None, None, None]
        F.run("broadcast_object_list", lambda: dist.broadcast_object_list(lst, src=root))
        F.check(f"broadcast_object_list root={root}", same(lst[0], obj(root)) and lst[1:] == ["two", 3], True)
        out = [None] * n if rank == root else None
        F.run("gather_object", lambda: dist.gather_object(obj(rank), out, dst=root))
        if rank == root:
            F.check(f"gather_object root={root}", all(same(out[i], obj(i)) for i in range(n)), True)
        mine = [None]
        F.run(
            "scatter_object_list",
            lambda: dist.scatter_object_list(
                mine, [obj(10 + i) for i in range(n)] if rank == root else None, src=root
            ),
        )
        F.check(f"scatter_object_list root={root}", same(mine[0], obj(10 + rank)), True)
    out = [None] * n
    F.run("all_gather_object", lambda: dist.all_gather_object(out, obj(rank)))
    F.check("all_gather_object", all(same(out[i], obj(i)) for i in range(n)), True)
    huge = {"big": np.arange(300_000) * rank}  # ~2.4 MB pickled: crosses the ring threshold
    out = [None] * n
    F.run("all_gather_object large", lambda: dist.all_gather_object(out, huge))
    F.check(
        "all_gather_object large",
        all(np.array_equal(out[i]["big"], np.arange(300_000) * i) for i in range(n)),
        True,
    )
    if n > 1:
        if rank == 0:
            F.run("send_object_list", lambda: dist.send_object_list([obj(0), "tail"], dst=n - 1))
        elif rank == n - 1:
            lst = [None, None]
            src = dist.recv_object_list(lst)
            F.check("recv_object_list", (src, same(lst[0], obj(0)), lst[1]), (0, True, "tail"))

elif mode == "large":
    from distlaunch.collectives.transport.shm import ShmConfig

    small = ShmConfig.from_env().small
    # bytes of float32, around the TCP and shared-memory algorithm switches
    sizes = [8, 4096, 65535, 65536, 65537, small - 4, small, small + 4, 1 << 20, 16 << 20]
    for nbytes in sizes:
        size = nbytes // 4
        ins = [data(r, "float32", size, nbytes) for r in range(n)]
        want = np.sum(ins, axis=0, dtype=np.float32)  # integer-valued: order-independent
        x = ins[rank].copy()
        F.run(f"all_reduce {nbytes}B", lambda: dist.all_reduce(W(x)))
        F.check(f"all_reduce {nbytes}B", x, want)
        for root in (0, n - 1):
            x = ins[rank].copy()
            F.run(f"reduce {nbytes}B", lambda: dist.reduce(W(x), dst=root, op=R.MAX))
            F.check(f"reduce {nbytes}B root={root}", x, np.max(ins, axis=0) if rank == root else ins[rank])
            x = ins[rank].copy()
            F.run(f"broadcast {nbytes}B", lambda: dist.broadcast(W(x), src=root))
            F.check(f"broadcast {nbytes}B root={root}", x, ins[root])
        if nbytes <= 1 << 20:
            out = np.zeros(size * n, np.float32)
            F.run(
                f"all_gather_into_tensor {nbytes}B", lambda: dist.all_gather_into_tensor(W(out), W(ins[rank]))
            )
            F.check(f"all_gather_into_tensor {nbytes}B", out, np.concatenate(ins))
            blocks = [data(r, "float32", size * n, nbytes + 1) for r in range(n)]
            out = np.zeros(size, np.float32)
            F.run(
                f"reduce_scatter_tensor {nbytes}B",
                lambda: dist.reduce_scatter_tensor(W(out), W(blocks[rank])),
            )
            F.check(
                f"reduce_scatter_tensor {nbytes}B",
                out,
                np.sum(blocks, axis=0, dtype=np.float32)[rank * size : (rank + 1) * size],
            )
        if n > 1:
            got = np.zeros(size, np.float32)
            w = dist.isend(W(ins[rank]), dst=(rank + 1) % n)
            F.run(f"recv {nbytes}B", lambda: dist.recv(W(got), src=(rank - 1) % n))
            F.run("isend wait", w.wait)
            F.check(f"send/recv {nbytes}B", got, ins[(rank - 1) % n])

elif mode == "runahead":
    # two ranks' chunked all_reduce (shared memory): while rank 1 stalls after its first
    # chunk, rank 0 publishes a slot of chunks ahead (2 chunks of 2 MiB), not one; then
    # the results, of a ring that wraps and of the operations right after it
    import time

    assert n == 2
    x = W(np.ones(4))
    F.run("first all_reduce", lambda: dist.all_reduce(x))
    world = dist.GroupMember.WORLD
    size = (9 << 20) // 4 + 3  # 5 chunks, the last ragged: the 4-chunk ring wraps
    ins = [data(r, "float32", size, 3) for r in range(n)]
    x = ins[rank].copy()
    shm = world.backend == "shm"
    if shm:
        ch = world._fast.channel
        chunks = -(-size * 4 // ch.config.chunk)
        lead = min(ch.slot // ch.config.chunk, chunks - 1)  # the run-ahead, in chunks
        before = ch.phase
    if rank == 1 and shm:
        begin = ch.begin

        def stalled_begin(ctx, fill=None):
            p0 = begin(ctx, fill)
            ch.begin = begin
            idx, end = ch.counter_index(0), time.monotonic() + 10
            while (ch.words[idx] - p0) % 2**32 < lead and time.monotonic() < end:
                time.sleep(0.01)
            time.sleep(0.05)  # (one more chunk would need ours)
            F.check("rank 0's lead in chunks while rank 1 stalls", (ch.words[idx] - p0) % 2**32, lead)
            return p0

        ch.begin = stalled_begin
    F.run("all_reduce 9 MiB", lambda: dist.all_reduce(W(x)))
    F.check("all_reduce 9 MiB", x, np.sum(ins, axis=0, dtype=np.float32))
    if shm:  # a phase per chunk, and the closing one that restores the channel's rule
        F.check("phases of the 9 MiB all_reduce", ch.phase - before, chunks + (lead > 1))
    # 4 MiB: two chunks, no run-ahead; 8 MiB: the ring full; 16 MiB: it wraps twice
    for nbytes in (9 << 20, (5 << 20) + 12, 64, 1 << 20, 4 << 20, 8 << 20, (16 << 20) + 12):
        size = nbytes // 4
        ins = [data(r, "float32", size, nbytes) for r in range(n)]
        for root in (None, 0, 1):
            x = ins[rank].copy()
            if root is None:
                F.run(f"all_reduce {nbytes}B", lambda: dist.all_reduce(W(x)))
            else:
                F.run(f"reduce {nbytes}B", lambda: dist.reduce(W(x), dst=root))
            want = np.sum(ins, axis=0, dtype=np.float32)
            F.check(f"reduce {nbytes}B root={root}", x, want if root in (None, rank) else ins[rank])
            y = ins[rank].copy()  # an operation right after it (phases, buffers reused)
            F.run(f"broadcast {nbytes}B", lambda: dist.broadcast(W(y), src=1))
            F.check(f"broadcast {nbytes}B after root={root}", y, ins[1])
            z = np.full(16, rank, np.float32)  # and an eager one-phase operation after that
            F.run(f"small broadcast after {nbytes}B", lambda: dist.broadcast(W(z), src=0))
            F.check(f"small broadcast after {nbytes}B root={root}", z, np.zeros(16, np.float32))

elif mode == "chunked":
    # n > 2 ranks' chunked all_reduce / reduce (shared memory: reduce-scatter and
    # all-gather per chunk). Floats
    # of random values (the order of the reduction shows in the bits) and NaN payloads:
    # every rank must hold the bits of ((x0 op x1) op x2) op ... (rank order), or, a
    # reduce's non-root, its input untouched. Sizes: one chunk, two, many with a ragged
    # last; back to back, so each operation starts on the buffers (and phase parity) the
    # one before left. The test runs it with a 1 MiB slot and 384 KiB chunks.
    import hashlib
    import time

    from distlaunch.collectives.ops import finalize, ufunc

    assert n > 2
    world = dist.GroupMember.WORLD
    F.run("first all_reduce", lambda: dist.all_reduce(W(np.ones(4))))  # (picks the backend)
    shm = world.backend == "shm"
    ch = world._fast.channel if shm else None

    def inputs(dtype, size, seed, nan):
        rng = np.random.default_rng(seed)
        dt = np.dtype(dtype)
        ins = []
        for r in range(n):
            if dt.kind in "fc":
                x = (rng.standard_normal(size) * 3).astype(dt)
                if dt.kind == "c":
                    x.imag = rng.standard_normal(size)
            else:
                x = data(r, dtype, size, seed)
            if nan:  # some positions: every rank's NaN, others: one rank's
                payload = np.array([0x7FC00001 + r], np.uint32).view(np.float32)[0]
                x[r::61] = payload
                x[n::53] = payload
            ins.append(x)
        return ins

    def want_of(ins, op):
        uf = ufunc(op)
        w = uf(ins[0], ins[1])
        for x in ins[2:]:
            uf(w, x, out=w)
        finalize(w, op, n)
        return w

    def stall_in(rank_to_stall, seed):
        """Rank ``rank_to_stall`` sleeps 0-4 ms before each of its publishes."""
        if not shm or rank != rank_to_stall:
            return lambda: None
        signal, rng = ch.signal, np.random.default_rng(seed)

        def slow_signal(p):
            time.sleep(rng.uniform(0, 0.004))
            signal(p)

        ch.signal = slow_signal
        return lambda: vars(ch).pop("signal")

    cases = [
        ("float32", R.SUM, True),
        ("float32", R.AVG, False),
        ("float32", R.PRODUCT, True),
        ("float32", R.MAX, False),
        ("float64", R.SUM, False),
        ("float16", R.SUM, False),
        ("complex64", R.SUM, False),
        ("int64", R.SUM, False),
        ("int32", R.MIN, False),
        ("uint8", R.BXOR, False),
        ("bool", R.SUM, False),
    ]
    # many chunks (ragged last), a one-phase one, one chunk, two chunks
    sizes = [(2 << 20) - 12345, 40, 300 << 10, 700 << 10]
    calls = 0
    for ci, (dtype, op, nan) in enumerate(cases):
        isz = np.dtype(dtype).itemsize
        for nbytes in sizes:
            size = nbytes // isz | 1  # odd: uneven slices
            ins = inputs(dtype, size, ci * 101 + nbytes % 97, nan)
            want = want_of(ins, op)
            for root in (None, *range(n)):
                what = f"{'all_reduce' if root is None else f'reduce to {root}'} {dtype} {op.name} {size}"
                x = ins[rank].copy()
                calls += 1
                unstall = stall_in(calls % n, calls) if ci < 2 else (lambda: None)
                try:
                    if root is None:
                        F.run(what, lambda: dist.all_reduce(W(x), op=op))
                    else:
                        F.run(what, lambda: dist.reduce(W(x), dst=root, op=op))
                finally:
                    unstall()
                if root not in (None, rank):
                    F.check(f"{what}: input untouched", x.view(np.uint8), ins[rank].view(np.uint8))
                elif nan:  # (numpy's own loops keep either NaN's payload: not compared)
                    nans = np.isnan(want)
                    F.check(f"{what}: NaNs", np.isnan(x), nans)
                    F.check(f"{what}: bits", x[~nans].view(np.uint8), want[~nans].view(np.uint8))
                else:
                    F.check(f"{what}: bits", x.view(np.uint8), want.view(np.uint8))
                if root is None:  # every rank the same bits, NaN payloads included
                    mine = np.frombuffer(hashlib.sha256(x.tobytes()).digest(), np.uint8).copy()
                    every = np.zeros(32 * n, np.uint8)
                    F.run(f"{what}: digests", lambda: dist.all_gather_into_tensor(W(every), W(mine)))
                    F.check(f"{what}: same bits on every rank", every, np.tile(mine, n))
    if shm:
        F.check("many chunks in the largest size", (2 << 20) // ch.config.chunk >= 4, True)
    y = np.arange(8.0) * (rank + 1)  # the group is still in step
    F.run("broadcast after", lambda: dist.broadcast(W(y), src=n - 1))
    F.check("broadcast after", y, np.arange(8.0) * n)

elif mode == "badargs":
    A = dist.CollectiveArgumentError
    # one good call first: it sets up the shared-memory channel, so the checks below also
    # go through the cached small-call paths
    F.run("all_reduce before errors", lambda: dist.all_reduce(W(np.ones(3))))
    nc = np.zeros((4, 4))[:, 1]
    expect_error("non-contiguous", A, lambda: dist.all_reduce(nc), ["tensor", "contiguous"])
    ro = np.zeros(4)
    ro.flags.writeable = False
    expect_error("read-only", A, lambda: dist.all_reduce(ro), ["tensor", "read-only"])
    expect_error("read-only bytes", A, lambda: dist.all_reduce(b"abcd"), ["read-only"])
    expect_error("bitwise on float", A, lambda: dist.all_reduce(np.zeros(3), op=R.BXOR), ["BXOR", "float64"])
    expect_error("AVG on int", A, lambda: dist.all_reduce(np.zeros(3, np.int32), op=R.AVG), ["AVG", "int32"])
    expect_error("not a ReduceOp", A, lambda: dist.all_reduce(np.zeros(3), op="median"), ["median"])
    expect_error("unhashable op", A, lambda: dist.all_reduce(np.zeros(3), op=["SUM"]), ["ReduceOp"])
    expect_error("object dtype", A, lambda: dist.all_reduce(np.array([None, 1])), ["dtype"])
    expect_error("not a buffer", A, lambda: dist.all_reduce([1, 2, 3]), ["tensor"])
    expect_error("src out of range", A, lambda: dist.broadcast(np.zeros(2), src=n), ["src"])
    expect_error("no src", A, lambda: dist.broadcast(np.zeros(2)), ["src"])
    expect_error(
        "list length", A, lambda: dist.all_gather([np.zeros(2)] * (n + 1), np.zeros(2)), ["tensor_list"]
    )
    expect_error("list sizes", A, lambda: dist.all_gather([np.zeros(3)] * n, np.zeros(2)), ["tensor_list[0]"])
    expect_error(
        "output size",
        A,
        lambda: dist.all_gather_into_tensor(np.zeros(2 * n + 1), np.zeros(2)),
        ["output_tensor"],
    )
    expect_error(
        "splits", A, lambda: dist.all_to_all_single(np.zeros(n), np.zeros(n), [5] * n, None), ["split"]
    )
    expect_error("send to self", A, lambda: dist.send(np.zeros(1), dst=rank), ["oneself"])
    expect_error("bad tag", A, lambda: dist.send(np.zeros(1), dst=(rank + 1) % n, tag="x"), ["tag"])
    expect_error("bad timeout", A, lambda: dist.barrier(timeout=-1), ["timeout"])
    expect_error("bad group", A, lambda: dist.barrier(group="world"), ["group"])
    expect_error("double init", A, lambda: dist.init_process_group(), ["already"])
    if USE_TORCH:
        import torch

        t = torch.zeros(4, 4)
        expect_error("torch non-contiguous", A, lambda: dist.all_reduce(t.t()), ["contiguous"])
        expect_error(
            "torch bfloat16", A, lambda: dist.all_reduce(torch.zeros(3, dtype=torch.bfloat16)), ["bfloat16"]
        )
        g = torch.ones(3, requires_grad=True)
        x = g.detach().clone()
        dist.all_reduce(x)
        F.check("torch detached all_reduce", x.numpy(), np.full(3, float(n), np.float32))
    # nothing was sent: the group is still in step
    x = np.ones(2)
    F.run("all_reduce after errors", lambda: dist.all_reduce(W(x)))
    F.check("all_reduce after errors", x, np.full(2, float(n)))
    F.run("barrier after errors", dist.barrier)
else:
    raise SystemExit(f"unknown mode {mode}")

F.exit()
dist.destroy_process_group()
