"""Point-to-point: the OSU programs of tests/mpi_programs (osu_latency, osu_bw,
osu_bibw, osu_multi_lat) run verbatim under mpiexec (mpi4py + MPICH) and under
`distlaunch run` with the import swapped, 2 ranks on this node, alternately ``reps``
times; prints the median of each and ours/MPICH (latency: lower is better, bandwidth:
higher is better) and the load average (the machine may be shared).
Usage: python benchmarks/bench_p2p.py [reps] [latency_max_bytes] [bw_max_bytes]"""

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mpi_run import have_mpich, run  # noqa: E402


def table(lines: list[str]) -> dict[int, float]:
    out = {}
    for ln in lines:
        parts = ln.split()
        if len(parts) == 2 and parts[0].isdigit():
            out[int(parts[0])] = float(parts[1])
    return out


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    lat_max = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 16
    bw_max = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 22
    if not have_mpich():
        sys.exit("needs mpi4py and mpiexec: pip install mpi4py mpich")
    programs = (
        ("osu_latency", (lat_max, 1000), "us"),
        ("osu_multi_lat", (lat_max, 1000), "us"),
        ("osu_bw", (bw_max, 20), "MB/s"),
        ("osu_bibw", (bw_max, 20), "MB/s"),
    )
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as d:
        for name, args, unit in programs:
            ours: dict[int, list[float]] = {}
            theirs: dict[int, list[float]] = {}
            for _ in range(reps):
                for mine, sink in ((True, ours), (False, theirs)):
                    rc, lines, err = run(name, 2, Path(d), mine, tuple(map(str, args)), timeout=600)
                    if rc:
                        sys.exit(f"{name} failed:\n{err[-2000:]}")
                    for size, v in table(lines).items():
                        sink.setdefault(size, []).append(v)
            print(f"\n{name} (2 ranks, one node, median of {reps}) [{unit}]")
            print(f"{'bytes':>10} {'distlaunch':>12} {'MPICH':>12} {'ours/MPICH':>11}")
            for size in sorted(ours):
                if size in theirs:
                    a, b = statistics.median(ours[size]), statistics.median(theirs[size])
                    print(f"{size:>10} {a:>12.2f} {b:>12.2f} {a / b:>11.2f}")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
