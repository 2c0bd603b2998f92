"""Collective latency/bandwidth of distlaunch.collectives, optionally next to torch's gloo
backend in the same launch (same processes, same buffers).

    distlaunch run --nproc-per-node 4 benchmarks/bench_collectives.py [--torch] [--ops all_reduce,broadcast]
        [--sizes 8,1024,65536,1048576,16777216] [--iters 20]

Rank 0 prints one line per (op, size, runtime): median and best time per call over
``--iters`` timed calls (after 3 warm-up calls), and the bus bandwidth for all_reduce
(2(n-1)/n x bytes / time, as nccl-tests). Sizes are bytes of float32.
"""
import argparse
import os
import statistics
import time

import numpy as np

import distlaunch.collectives as dist

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="8,1024,65536,1048576,16777216")
p.add_argument("--ops", default="all_reduce,broadcast,all_gather_into_tensor,reduce_scatter_tensor")
p.add_argument("--iters", type=int, default=20)
p.add_argument("--torch", action="store_true", help="also measure torch.distributed (gloo)")
args = p.parse_args()

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
tdist = None
if args.torch:
    import torch
    import torch.distributed as tdist
    tdist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)


def run(lib, op, nbytes):
    n = max(1, nbytes // 4)
    to = (lambda a: torch.from_numpy(a)) if lib is tdist else (lambda a: a)
    x = to(np.ones(n, np.float32))
    big = to(np.ones(n * world, np.float32))
    calls = {
        "all_reduce": lambda: lib.all_reduce(x),
        "broadcast": lambda: lib.broadcast(x, src=0),
        # the *_single names (torch >= 2.13 deprecates *_tensor); distlaunch has both
        "all_gather_into_tensor": lambda: getattr(lib, "all_gather_single", lib.all_gather_into_tensor)(big, x),
        "reduce_scatter_tensor": lambda: getattr(lib, "reduce_scatter_single", lib.reduce_scatter_tensor)(x, big),
    }
    fn = calls[op]
    for _ in range(3):
        fn()
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    # the slowest rank defines the collective's time
    worst = np.array(times)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return statistics.median(worst), worst.min()


if rank == 0:
    print(f"world={world} iters={args.iters} pid0={os.getpid()}")
    print(f"{'op':24} {'bytes':>10} {'runtime':>10} {'median':>11} {'best':>11} {'busbw':>10}")
for op in args.ops.split(","):
    for nbytes in map(int, args.sizes.split(",")):
        for name, lib in (("distlaunch", dist), ("torch-gloo", tdist)):
            if lib is None:
                continue
            med, best = run(lib, op, nbytes)
            if rank == 0:
                bw = f"{2 * (world - 1) / world * nbytes / med / 1e6:7.0f}MB/s" if op == "all_reduce" else "-"
                print(f"{op:24} {nbytes:>10} {name:>10} {med * 1e6:>9.1f}us {best * 1e6:>9.1f}us {bw:>11}",
                      flush=True)
if tdist is not None:
    tdist.destroy_process_group()
dist.destroy_process_group()
