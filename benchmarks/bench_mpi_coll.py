"""mpi4py collectives: tests/mpi_programs/osu_coll.py (mpi4py's OSU collective demos:
``mmap`` buffers, ``[buf, count, MPI.BYTE]`` specs) verbatim under mpiexec (mpi4py +
MPICH) and under `distlaunch run` with the import swapped, on this node, alternately
``reps`` times; prints the median latency of each and ours/MPICH (lower is better) and
the load average (the machine may be shared). With ``before`` (a directory holding
another checkout's ``distlaunch`` package, e.g. a worktree of an earlier commit), that
version runs too, in the same rounds, through PYTHONPATH. No assert: figures only.
Usage: python benchmarks/bench_mpi_coll.py [reps] [ranks] [ops,...] [iterations] [before]"""

import contextlib
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mpi_run import have_mpich, run  # noqa: E402

OPS = ("bcast", "allgather", "gather", "scatter", "alltoall")
RANGES = ((1, 1 << 10), (1 << 16, 1 << 20))  # bytes: the small and the large sizes


@contextlib.contextmanager
def _pythonpath(path: str | None) -> Iterator[None]:
    """PYTHONPATH set to ``path`` (the workers import distlaunch from there) meanwhile."""
    old = os.environ.get("PYTHONPATH")
    if path is not None:
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    ops = sys.argv[3].split(",") if len(sys.argv) > 3 else OPS
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 200
    before = sys.argv[5] if len(sys.argv) > 5 else None
    if not have_mpich():
        sys.exit("needs mpi4py and mpiexec: pip install mpi4py mpich")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as d:
        for op in ops:
            got: dict[str, dict[int, list[float]]] = {"ours": {}, "MPICH": {}, "before": {}}
            runs = [("ours", True, None), ("MPICH", False, None)]
            if before:
                runs.append(("before", True, before))
            for _ in range(reps):
                for lo, hi in RANGES:
                    for key, mine, path in runs:
                        args = (op, str(lo), str(hi), str(iters))
                        with _pythonpath(path):
                            rc, lines, err = run("osu_coll", n, Path(d), mine, args, timeout=600)
                        if rc:
                            sys.exit(f"{op} ({key}) failed:\n{err[-2000:]}")
                        for ln in lines:
                            parts = ln.split()
                            if len(parts) == 2 and parts[0].isdigit():
                                got[key].setdefault(int(parts[0]), []).append(float(parts[1]))
            print(f"\nosu_{op} ({n} ranks, one node, median of {reps}) [us]")
            extra = f" {'before':>10} {'before/MPICH':>12}" if before else ""
            print(f"{'bytes':>10} {'distlaunch':>12} {'MPICH':>12} {'ours/MPICH':>11}{extra}")
            med = {k: {size: statistics.median(v) for size, v in d.items()} for k, d in got.items()}
            for size in sorted(med["ours"]):
                if size in med["MPICH"]:
                    a, b = med["ours"][size], med["MPICH"][size]
                    line = f"{size:>10} {a:>12.2f} {b:>12.2f} {a / b:>11.2f}"
                    if before and size in med["before"]:
                        c = med["before"][size]
                        line += f" {c:>10.2f} {c / b:>12.2f}"
                    print(line, flush=True)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
