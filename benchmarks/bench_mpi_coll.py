"""mpi4py collectives: tests/mpi_programs/osu_coll.py (mpi4py's OSU collective demos:
``mmap`` buffers, ``[buf, count, MPI.BYTE]`` specs) verbatim under mpiexec (mpi4py +
MPICH) and under `distlaunch run` with the import swapped, on this node, alternately
``reps`` times; prints the median latency of each and ours/MPICH (lower is better) and
the load average (the machine may be shared). No assert: figures only.
Usage: python benchmarks/bench_mpi_coll.py [reps] [ranks] [ops,...] [iterations]"""

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mpi_run import have_mpich, run  # noqa: E402

OPS = ("bcast", "allgather", "gather", "scatter", "alltoall")
RANGES = ((1, 1 << 10), (1 << 16, 1 << 20))  # bytes: the small and the large sizes


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ops = sys.argv[3].split(",") if len(sys.argv) > 3 else OPS
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 200
    if not have_mpich():
        sys.exit("needs mpi4py and mpiexec: pip install mpi4py mpich")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as d:
        for op in ops:
            ours: dict[int, list[float]] = {}
            theirs: dict[int, list[float]] = {}
            for _ in range(reps):
                for lo, hi in RANGES:
                    for mine, sink in ((True, ours), (False, theirs)):
                        args = (op, str(lo), str(hi), str(iters))
                        rc, lines, err = run("osu_coll", n, Path(d), mine, args, timeout=600)
                        if rc:
                            sys.exit(f"{op} failed:\n{err[-2000:]}")
                        for ln in lines:
                            parts = ln.split()
                            if len(parts) == 2 and parts[0].isdigit():
                                sink.setdefault(int(parts[0]), []).append(float(parts[1]))
            print(f"\nosu_{op} ({n} ranks, one node, median of {reps}) [us]")
            print(f"{'bytes':>10} {'distlaunch':>12} {'MPICH':>12} {'ours/MPICH':>11}")
            for size in sorted(ours):
                if size in theirs:
                    a, b = statistics.median(ours[size]), statistics.median(theirs[size])
                    print(f"{size:>10} {a:>12.2f} {b:>12.2f} {a / b:>11.2f}", flush=True)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
