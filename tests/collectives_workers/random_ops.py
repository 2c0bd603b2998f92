"""A seeded random sequence of collectives (same on every rank): random op, dtype, size
(0 .. ~600 KB, log-uniform, so both sides of every algorithm threshold), root, reduce op,
group (world or a subgroup), each checked against a numpy reference; async_op drawn for
each rank (one rank's blocking call meets another's asynchronous one), and a quarter of
the calls repeat the previous one's op, group, dtype, size, reduce op and root (small
blocking calls on shared memory then take cached plans, on some ranks only when the
others' call is asynchronous or new to them). all_to_all and all_to_all_single move
blocks of one size, or (a third of them) with one block longer than a phase of the
shared-memory channel (``long``; from the second member to the third, or in a group of
two from the first to the second, so a rank whose
own blocks are all of one size may be on its plan while the others run that long
block's further phases), their split sizes given or (equal) left out.
Usage: random_ops.py SEED COUNT"""

import os
import sys

import numpy as np
from common import Failures, data, init

import distlaunch.collectives as dist

seed, count = int(sys.argv[1]), int(sys.argv[2])
rank, n = init(timeout=60)
F = Failures(rank)
R = dist.ReduceOp
rng = np.random.default_rng(seed)  # identical stream on every rank
SLOT = int(os.environ.get("DISTLAUNCH_SHM_SLOT", 4 << 20))  # (bytes per shared-memory phase buffer)
groups = [(dist.GroupMember.WORLD, list(range(n)))]
for members in ([0, n - 1], list(range(1, n)), list(range(0, n, 2))):
    members = sorted(set(members))
    g = dist.new_group(members)
    groups.append((g, members))
UF = {
    R.SUM: np.add,
    R.PRODUCT: np.multiply,
    R.MIN: np.minimum,
    R.MAX: np.maximum,
    R.BAND: np.bitwise_and,
    R.BOR: np.bitwise_or,
    R.BXOR: np.bitwise_xor,
}
pending = []  # (work, check) of async collectives, checked after their wait
last = None  # the previous call's (group, members, dtype, size, kind, op, root_pos)

for i in range(count):
    g, members = groups[rng.integers(len(groups))]
    dtype = str(rng.choice(["float32", "float64", "int32", "int64", "uint8", "bool", "float16"]))
    size = int(np.exp(rng.uniform(0, np.log(150_000)))) - 1
    kind = str(
        rng.choice(
            ["all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"]
            + ["gather", "scatter", "all_to_all", "all_to_all_single"]
        )
    )
    long = bool(rng.integers(3) == 0)  # (all_to_all)
    ops = [R.SUM, R.MIN, R.MAX] + (
        [R.BAND, R.BOR, R.BXOR] if dtype in ("int32", "int64", "uint8", "bool") else []
    )
    op = ops[rng.integers(len(ops))]
    if dtype in ("float16", "uint8", "bool") and op == R.SUM:
        op = R.MAX  # keep sums exact/meaningful in narrow dtypes
    root_pos = int(rng.integers(len(members)))
    if rng.integers(4) == 0 and last is not None:
        g, members, dtype, size, kind, op, root_pos, long = last
    last = g, members, dtype, size, kind, op, root_pos, long
    async_op = bool(rng.integers(2, size=n)[rank])  # (all n drawn: the stream stays identical)
    flush = rng.integers(3) == 0  # drawn on every rank: the stream must stay identical
    if rank not in members:
        continue
    m = len(members)
    me = members.index(rank)
    ins = [data(r, dtype, size, seed * 100000 + i) for r in members]
    red = ins[0].copy()
    for x in ins[1:]:
        UF[op](red, x, out=red)
    name = f"#{i} {kind} {dtype}[{size}] {op.name} group={members} root={members[root_pos]} async={async_op}"
    name += f" long={long}" if kind.startswith("all_to_all") else ""
    x = ins[me].copy()
    if kind == "all_reduce":
        w = dist.all_reduce(x, op=op, group=g, async_op=async_op)
        check = lambda x=x, red=red, name=name: F.check(name, x, red)
    elif kind == "reduce":
        w = dist.reduce(x, dst=members[root_pos], op=op, group=g, async_op=async_op)
        want = red if me == root_pos else ins[me]
        check = lambda x=x, want=want, name=name: F.check(name, x, want)
    elif kind == "broadcast":
        w = dist.broadcast(x, src=members[root_pos], group=g, async_op=async_op)
        check = lambda x=x, want=ins[root_pos], name=name: F.check(name, x, want)
    elif kind == "all_gather_into_tensor":
        out = np.zeros(size * m, dtype)
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=async_op)
        check = lambda out=out, want=np.concatenate(ins), name=name: F.check(name, out, want)
    elif kind == "gather":
        outs = [np.zeros(size, dtype) for _ in members] if me == root_pos else None
        w = dist.gather(x, outs, dst=members[root_pos], group=g, async_op=async_op)
        got, want = (outs, ins) if outs is not None else ([x], [ins[me]])
        check = lambda got=got, want=np.concatenate(want), name=name: F.check(name, np.concatenate(got), want)
    elif kind == "scatter":
        blocks = [data(r, dtype, size, seed * 100000 + i + 7) for r in members]
        sent = blocks if me == root_pos else None
        w = dist.scatter(x, sent, src=members[root_pos], group=g, async_op=async_op)
        check = lambda x=x, want=blocks[me], name=name: F.check(name, x, want)
    elif kind.startswith("all_to_all"):
        sizes = [[size] * m for _ in members]  # elements member a sends member b
        if long and m > 1:  # longer than a phase's block (slot / m) for this group
            sizes[min(1, m - 2)][min(2, m - 1)] = SLOT // m // np.dtype(dtype).itemsize + 3
        blocks = [
            [data(r, dtype, sizes[a][b], seed * 100000 + i + 11 * b) for b in range(m)]
            for a, r in enumerate(members)
        ]
        want = np.concatenate([blocks[a][me] for a in range(m)])
        sent = [sizes[me][b] for b in range(m)]
        got = [sizes[a][me] for a in range(m)]
        if kind == "all_to_all":
            outs = [np.zeros(k, dtype) for k in got]
            w = dist.all_to_all(outs, blocks[me], group=g, async_op=async_op)
            check = lambda outs=outs, want=want, name=name: F.check(name, np.concatenate(outs), want)
        else:
            out = np.zeros(sum(got), dtype)
            equal = len(set(sent + got)) == 1 and root_pos % 2  # (the split sizes left out)
            w = dist.all_to_all_single(
                out,
                np.concatenate(blocks[me]),
                None if equal else got,
                None if equal else sent,
                group=g,
                async_op=async_op,
            )
            check = lambda out=out, want=want, name=name: F.check(name, out, want)
    else:
        big = [data(r, dtype, size * m, seed * 100000 + i + 7) for r in members]
        redb = big[0].copy()
        for b in big[1:]:
            UF[op](redb, b, out=redb)
        out = np.zeros(size, dtype)
        w = dist.reduce_scatter_tensor(out, big[me], op=op, group=g, async_op=async_op)
        check = lambda out=out, want=redb[me * size : (me + 1) * size], name=name: F.check(name, out, want)
    if async_op:
        pending.append((w, check))
        if len(pending) > 4 or flush:
            for w, c in pending:
                F.run("wait", w.wait)
                c()
            pending = []
    else:
        check()
for w, c in pending:
    F.run("wait", w.wait)
    c()
F.run("barrier", dist.barrier)
F.exit()
dist.destroy_process_group()
