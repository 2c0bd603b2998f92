"""Point-to-point: the OSU latency and bandwidth programs of tests/mpi_programs, run
verbatim under mpiexec (mpi4py + MPICH) and under `distlaunch run` with the import
swapped, side by side; prints ours/MPICH ratios (latency: lower is better, bandwidth:
higher is better). Usage: python benchmarks/bench_p2p.py [latency_max_bytes] [bw_max_bytes]"""

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
    lat_max = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 16
    bw_max = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 22
    if not have_mpich():
        sys.exit("needs mpi4py and mpiexec: pip install mpi4py mpich")
    with tempfile.TemporaryDirectory() as d:
        for name, args, unit in (("osu_latency", (lat_max,), "us"), ("osu_bw", (bw_max,), "MB/s")):
            rc1, ours, err1 = run(name, 2, Path(d), True, tuple(map(str, args)), timeout=600)
            rc2, theirs, err2 = run(name, 2, Path(d), False, tuple(map(str, args)), timeout=600)
            if rc1 or rc2:
                sys.exit(f"{name} failed:\n{err1[-2000:]}\n{err2[-2000:]}")
            a, b = table(ours), table(theirs)
            print(f"\n{name} (2 ranks, one node) [{unit}]")
            print(f"{'bytes':>10} {'distlaunch':>12} {'MPICH':>12} {'ours/MPICH':>11}")
            for size in sorted(a):
                if size in b:
                    print(f"{size:>10} {a[size]:>12.2f} {b[size]:>12.2f} {a[size] / b[size]:>11.2f}")


if __name__ == "__main__":
    main()
