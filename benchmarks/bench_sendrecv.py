"""distlaunch.collectives send/recv next to mpi4py + MPICH Send/Recv: ping-pong latency
between 2 ranks of this node.

    python benchmarks/bench_sendrecv.py [--rounds 3] [--sizes 4,1KiB,64KiB,1MiB]

Each round runs one job per library, alternating (so background load hits both alike):
distlaunch.collectives under ``distlaunch run --nproc-per-node 2`` and mpi4py under the
``mpiexec -n 2`` next to ``sys.executable``. A worker ping-pongs uint8 numpy arrays of
every size (rank 0 sends then receives, rank 1 the reverse), first with the blocking
calls (``send``/``recv``; ``Send``/``Recv``), then with the non-blocking ones waited at
once (``isend``/``irecv(...).wait()``; ``Isend``/``Irecv`` + ``Wait``): warm-up, then
``iters`` round trips; a message's latency is half a round trip, in microseconds (the
osu_latency convention). The table gives the median over rounds of each library and
ours/MPICH (lower is better), and the load average before and after.

A worker can be run by hand: ``distlaunch run --nproc-per-node 2
benchmarks/bench_sendrecv.py --worker distlaunch``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from distlaunch.collectives.bench import parse_sizes


def iters_for(size: int) -> int:
    return 2000 if size <= 4096 else 500 if size <= 1 << 17 else 100


def worker(lib: str, sizes: list[int]) -> None:
    import numpy as np

    if lib == "distlaunch":
        import distlaunch.collectives as dist

        dist.init_process_group()
        rank = dist.get_rank()
        send, recv, isend, irecv = dist.send, dist.recv, dist.isend, dist.irecv
        barrier, done = dist.barrier, dist.destroy_process_group
        wait = "wait"
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        send, recv, isend, irecv = comm.Send, comm.Recv, comm.Isend, comm.Irecv
        barrier, done = comm.Barrier, (lambda: None)
        wait = "Wait"
    peer = 1 - rank

    def blocking(a, b):
        if rank == 0:
            send(a, peer)
            recv(b, peer)
        else:
            recv(b, peer)
            send(a, peer)

    def nonblocking(a, b):
        if rank == 0:
            getattr(isend(a, peer), wait)()
            getattr(irecv(b, peer), wait)()
        else:
            getattr(irecv(b, peer), wait)()
            getattr(isend(a, peer), wait)()

    results = {}
    for kind, fn in (("blocking", blocking), ("nonblocking", nonblocking)):
        for size in sizes:
            a, b = np.full(size, rank, np.uint8), np.empty(size, np.uint8)
            iters = iters_for(size)
            for _ in range(iters // 10 + 5):
                fn(a, b)
            barrier()
            t = time.perf_counter()
            for _ in range(iters):
                fn(a, b)
            results[f"{kind} {size}"] = (time.perf_counter() - t) / iters / 2 * 1e6
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    done()


def run_job(lib: str, sizes: str) -> dict:
    me = os.path.abspath(__file__)
    args = [me, "--worker", lib, "--sizes", sizes]
    if lib == "distlaunch":
        cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", *args]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable, *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in res.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    sys.exit(f"{lib} failed (rc {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("distlaunch", "mpich"))
    ap.add_argument("--sizes", default="4,1KiB,64KiB,1MiB")
    ap.add_argument("--rounds", type=int, default=3)
    opts = ap.parse_args()
    sizes = parse_sizes(opts.sizes)
    if opts.worker:
        worker(opts.worker, sizes)
        return
    print(f"load average before: {os.getloadavg()}")
    got: dict[str, dict[str, list[float]]] = {"distlaunch": {}, "mpich": {}}
    for _ in range(opts.rounds):
        for lib in got:
            for key, us in run_job(lib, opts.sizes).items():
                got[lib].setdefault(key, []).append(us)
    print(f"\nping-pong latency, 2 ranks on one node, median of {opts.rounds} rounds [us]")
    print(f"{'call':>12} {'bytes':>9} {'distlaunch':>11} {'MPICH':>9} {'ours/MPICH':>11}")
    for key in got["distlaunch"]:
        kind, size = key.split()
        a, b = statistics.median(got["distlaunch"][key]), statistics.median(got["mpich"][key])
        print(f"{kind:>12} {size:>9} {a:>11.2f} {b:>9.2f} {a / b:>11.2f}")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
