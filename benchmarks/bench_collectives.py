"""distlaunch.collectives next to torch.distributed (gloo) and MPICH (mpi4py), same sizes,
same timing, one node.

    python benchmarks/bench_collectives.py [--worlds 2,4]
        [--ops all_reduce,broadcast,all_gather,reduce_scatter]
        [--sizes 8,1MiB,16MiB,64MiB] [--libs distlaunch,gloo,mpich] [--rounds 2]

The driver starts, for each world size and library, one job of workers running this file
with ``--worker LIB`` (distlaunch and gloo under ``distlaunch run``, MPICH under the
``mpiexec`` next to ``sys.executable``), and the libraries alternate round by round
(``--rounds``, default 2) so that background load hits all of them alike. Each worker
measures every (op, size): 2 warm-up calls, then 5 (small sizes: 15) repetitions of
``iters`` back-to-back calls after a barrier; a repetition's time is the slowest rank's
mean per call; the result is the median over repetitions, then the median over rounds.
Sizes are bytes of the per-rank buffer (all_reduce, broadcast) or of the larger buffer
(all_gather: output; reduce_scatter: input), float32.

The table gives each library's time and the ratios ours / theirs (< 1: we are faster).
``--nodes 2`` starts two launchers per job on this machine (``--nnodes 2 --node-rank K``,
n/2 workers each): distlaunch then uses shared memory inside each launcher's workers and
TCP between the two (hierarchical collectives); MPICH is left out there.

``--libs distlaunch,distlaunch-unbound --rounds 8`` compares distlaunch run's default CPU
binding with ``--bind-to none`` (the same workers; the ratio column then reads
bound / unbound).

``--before TREE`` adds the library "before": the same workers with the distlaunch of
another checkout (e.g. a worktree at the base commit), so that a change is measured
side by side with what it changes, the ratio column "ours/before".

``--ops`` also takes gather, scatter (root 0; size: the larger buffer, as all_gather)
and all_to_all (``all_to_all_single``, MPI's Alltoall; size: either buffer).

A worker can also be run by hand, e.g.::

    distlaunch run --nproc-per-node 4 benchmarks/bench_collectives.py --worker distlaunch --sizes 1MiB
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# a "before" worker imports the distlaunch of the tree it was given (see _launch)
sys.path.insert(0, os.environ.get("BENCH_COLL_TREE", REPO))
from distlaunch.collectives.bench import parse_size  # noqa: E402

OPS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]


def _iters(nbytes):
    return 200 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 5 if nbytes <= 16 << 20 else 2


# --------------------------------------------------------------------- workers


class _Lib:
    def __init__(self, name):
        self.name = name
        if name == "mpich":
            from mpi4py import MPI

            self.MPI, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.n = self.comm.Get_rank(), self.comm.Get_size()
        elif name == "gloo":
            import torch
            import torch.distributed as tdist

            self.torch, self.d = torch, tdist
            tdist.init_process_group("gloo", init_method="env://")
            self.rank, self.n = tdist.get_rank(), tdist.get_world_size()
        else:
            import distlaunch.collectives as dist

            self.d = dist
            dist.init_process_group()
            self.rank, self.n = dist.get_rank(), dist.get_world_size()

    def wrap(self, a):
        return self.torch.from_numpy(a) if self.name == "gloo" else a

    def call(self, op, nbytes):
        """A zero-argument function running ``op`` once on buffers of ``nbytes``."""
        n = self.n
        blocked = op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")
        per = max(1, nbytes // 4 // n) if blocked else max(1, nbytes // 4)
        x = np.ones(per, np.float32)
        big = np.ones(per * n, np.float32)
        big2 = np.ones(per * n, np.float32)
        root = self.rank == 0
        if self.name == "mpich":
            c, MPI = self.comm, self.MPI
            return {
                "all_reduce": lambda: c.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
                "broadcast": lambda: c.Bcast(x, root=0),
                "all_gather": lambda: c.Allgather(x, big),
                "reduce_scatter": lambda: c.Reduce_scatter_block(big, x, op=MPI.SUM),
                "gather": lambda: c.Gather(x, big if root else None, root=0),
                "scatter": lambda: c.Scatter(big if root else None, x, root=0),
                "all_to_all": lambda: c.Alltoall(big, big2),
            }[op]
        d, tx, tbig, tbig2 = self.d, self.wrap(x), self.wrap(big), self.wrap(big2)
        blocks = [self.wrap(b) for b in big.reshape(n, per)] if root else None
        return {
            "all_reduce": lambda: d.all_reduce(tx),
            "broadcast": lambda: d.broadcast(tx, src=0),
            "all_gather": lambda: d.all_gather_into_tensor(tbig, tx),
            "reduce_scatter": lambda: d.reduce_scatter_tensor(tx, tbig),
            "gather": lambda: d.gather(tx, blocks, dst=0),
            "scatter": lambda: d.scatter(tx, blocks, src=0),
            "all_to_all": lambda: d.all_to_all_single(tbig2, tbig),
        }[op]

    def barrier(self):
        (self.comm.Barrier if self.name == "mpich" else self.d.barrier)()

    def max(self, a):
        if self.name == "mpich":
            self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self.MPI.MAX)
        elif self.name == "gloo":
            self.d.all_reduce(self.wrap(a), op=self.d.ReduceOp.MAX)
        else:
            self.d.all_reduce(a, op=self.d.ReduceOp.MAX)

    def close(self):
        if self.name != "mpich":
            self.d.destroy_process_group()


def worker(lib_name, ops, sizes):
    lib = _Lib(lib_name)
    for op in ops:
        for nbytes in sizes:
            fn = lib.call(op, nbytes)
            iters = _iters(nbytes)
            reps = 15 if nbytes <= 64 << 10 else 5
            for _ in range(2):
                fn()
            times = np.zeros(reps)
            for k in range(reps):
                lib.barrier()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[k] = (time.perf_counter() - t) / iters
            lib.max(times)
            if lib.rank == 0:
                print(
                    "RESULT "
                    + json.dumps(
                        dict(
                            lib=lib_name,
                            n=lib.n,
                            op=op,
                            size=nbytes,
                            us=statistics.median(times.tolist()) * 1e6,
                        )
                    ),
                    flush=True,
                )
    lib.close()


# --------------------------------------------------------------------- driver


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(lib, n, ops, sizes, nodes=1, before=None):
    # "distlaunch-unbound": the same workers under `distlaunch run --bind-to none`
    bind = ["--bind-to", "none"] if lib == "distlaunch-unbound" else []
    worker = "distlaunch" if lib.startswith("distlaunch") or lib == "before" else lib
    args = ["--worker", worker, "--ops", ",".join(ops), "--sizes", ",".join(map(str, sizes))]
    tree = before if lib == "before" else REPO
    env = dict(
        os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    if lib == "before":
        env["BENCH_COLL_TREE"] = tree
    if nodes > 1:  # loopback "nodes": one launcher per node, TCP between them
        port = _free_port()
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distlaunch",
                    "run",
                    "--nnodes",
                    str(nodes),
                    "--node-rank",
                    str(k),
                    "--master-port",
                    str(port),
                    "--nproc-per-node",
                    str(n // nodes),
                    *bind,
                    __file__,
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for k in range(nodes)
        ]
        outs = [p.communicate(timeout=1800) for p in procs]
        rows = [
            json.loads(line.split("RESULT ", 1)[1])
            for out, _ in outs
            for line in out.splitlines()
            if "RESULT " in line
        ]
        if not rows:
            print(f"# {lib} {nodes} nodes failed: {outs[0][1][-800:]}", file=sys.stderr)
        return rows
    if lib == "mpich":
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        cmd = [
            mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec"),
            "-n",
            str(n),
            sys.executable,
            __file__,
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", str(n), *bind, __file__, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in p.stdout.splitlines() if "RESULT " in line]
    if p.returncode != 0 or not rows:
        print(f"# {lib} world {n} failed ({p.returncode}): {p.stderr[-800:]}", file=sys.stderr)
    return rows


def _fmt_us(us):
    return f"{us:.0f} us" if us < 1000 else f"{us / 1000:.2f} ms"


def _fmt_size(b):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"


def driver(args):
    ops, sizes = args.ops.split(","), [parse_size(s) for s in args.sizes.split(",")]
    libs = args.libs.split(",") + (["before"] if args.before else [])
    if args.nodes > 1:
        libs = [lib for lib in libs if lib != "mpich"]
    results = {}
    for n in map(int, args.worlds.split(",")):
        for rnd in range(args.rounds):
            for lib in libs if rnd % 2 == 0 else libs[::-1]:
                if args.nodes > 1 and lib == "mpich":
                    continue
                for row in _launch(lib, n, ops, sizes, args.nodes, args.before):
                    results.setdefault((row["n"], row["op"], row["size"], lib), []).append(row["us"])
    med = {k: statistics.median(v) for k, v in results.items()}
    head = (
        ["op", "n", "size"]
        + [f"{lib}" for lib in libs]
        + [f"ours/{lib}" for lib in libs if lib != "distlaunch"]
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for op in ops:
        for n in map(int, args.worlds.split(",")):
            for s in sizes:
                t = {lib: med.get((n, op, s, lib)) for lib in libs}
                cells = [op, str(n), _fmt_size(s)] + [_fmt_us(t[lib]) if t[lib] else "-" for lib in libs]
                ours = t.get("distlaunch")
                cells += [
                    f"{ours / t[lib]:.2f}" if ours and t[lib] else "-" for lib in libs if lib != "distlaunch"
                ]
                print("| " + " | ".join(cells) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=["distlaunch", "gloo", "mpich"])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default="8,1MiB,16MiB,64MiB")
    p.add_argument(
        "--libs",
        default="distlaunch,gloo,mpich",
        help="any of distlaunch, distlaunch-unbound (under --bind-to none), gloo, mpich",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="loopback nodes (one distlaunch launcher each, TCP between them; no MPICH)",
    )
    p.add_argument(
        "--before",
        metavar="TREE",
        help="also run the distlaunch workers with the distlaunch of checkout TREE (library 'before')",
    )
    args = p.parse_args()
    if args.before:  # (for PYTHONPATH and sys.path: the same tree from whatever directory a worker starts in)
        args.before = os.path.abspath(args.before)
    if args.worker:
        with np.errstate(all="ignore"):  # repeated in-place sums overflow to inf, harmlessly
            worker(args.worker, args.ops.split(","), [parse_size(s) for s in args.sizes.split(",")])
    else:
        driver(args)


if __name__ == "__main__":
    main()
