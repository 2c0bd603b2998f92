"""Point-to-point: the OSU programs of tests/mpi_programs (osu_latency, osu_bw,
osu_bibw, osu_multi_lat) and the per-buffer-type ping-pong (osu_latency_types: numpy,
bytearray, bytes, memoryview slices, mmap, array.array, torch CPU tensors, each as
mpi4py's ``[buf, count, MPI.BYTE]``) and the per-call cost of an osu_bw window's pieces
(p2p_window_calls: Irecv of a message already there or posted before it, Waitall,
Isend) run verbatim under mpiexec (mpi4py + MPICH, the
same buffer type) and under `distlaunch run` with the import swapped, 2 ranks on this
node, alternately ``reps`` times; prints the median of each and ours/MPICH (latency:
lower is better, bandwidth: higher is better) and the load average (the machine may be
shared).

Usage: python benchmarks/bench_p2p.py [reps] [latency_max_bytes] [bw_max_bytes]
           [--programs osu_latency,osu_multi_lat,osu_bw,osu_bibw,types,calls]
           [--types numpy,bytearray,...] [--sizes 0,8,1024,65536] [--iters N] [--bw-iters N]
           [--call-size BYTES]"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from mpi_run import have_mpich, run  # noqa: E402

TYPES = "numpy,bytearray,bytes,memoryview,mmap,array,torch"


def table(lines: list[str]) -> dict[tuple[str, int], float]:
    """(buffer type or "", size) -> value of a program's output lines."""
    out = {}
    for ln in lines:
        parts = ln.split()
        if len(parts) == 2 and parts[0].isdigit():
            out["", int(parts[0])] = float(parts[1])
        elif len(parts) == 3 and parts[1].isdigit():
            out[parts[0], int(parts[1])] = float(parts[2])
    return out


def measure(name: str, args: tuple, reps: int, tmp: Path) -> tuple[dict, dict]:
    """Medians of ``reps`` runs of ``name``, ours and MPICH's, interleaved."""
    ours: dict[tuple[str, int], list[float]] = {}
    theirs: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        for mine, sink in ((True, ours), (False, theirs)):
            rc, lines, err = run(name, 2, tmp, mine, tuple(map(str, args)), timeout=600)
            if rc:
                sys.exit(f"{name} failed:\n{err[-2000:]}")
            for key, v in table(lines).items():
                sink.setdefault(key, []).append(v)
    med = {k: statistics.median(v) for k, v in ours.items()}
    return med, {k: statistics.median(v) for k, v in theirs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reps", nargs="?", type=int, default=3)
    ap.add_argument("lat_max", nargs="?", type=int, default=1 << 16)
    ap.add_argument("bw_max", nargs="?", type=int, default=1 << 22)
    ap.add_argument("--programs", default="osu_latency,osu_multi_lat,osu_bw,osu_bibw,types")
    ap.add_argument("--types", default=TYPES, help="buffer types of the per-type ping-pong")
    ap.add_argument("--sizes", default="0,8,1024,65536", help="bytes, of the per-type ping-pong")
    ap.add_argument("--iters", type=int, default=2000, help="round trips per size (types)")
    ap.add_argument("--bw-iters", type=int, default=20, help="windows per size (osu_bw, osu_bibw)")
    ap.add_argument("--call-size", type=int, default=8, help="bytes per message (calls)")
    a = ap.parse_args()
    if not have_mpich():
        sys.exit("needs mpi4py and mpiexec: pip install mpi4py mpich")
    known = {
        "osu_latency": ((a.lat_max, 1000), "us"),
        "osu_multi_lat": ((a.lat_max, 1000), "us"),
        "osu_bw": ((a.bw_max, a.bw_iters), "MB/s"),
        "osu_bibw": ((a.bw_max, a.bw_iters), "MB/s"),
        "types": ((a.types, a.sizes, a.iters), "us"),
        "calls": ((a.call_size, 800, 7), "us per call"),
    }
    for p in a.programs.split(","):
        if p not in known:
            sys.exit(f"--programs: unknown program {p!r} (choose from {','.join(known)})")
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as d:
        for name in a.programs.split(","):
            args, unit = known[name]
            prog = {"types": "osu_latency_types", "calls": "p2p_window_calls"}.get(name, name)
            ours, theirs = measure(prog, args, a.reps, Path(d))
            print(f"\n{prog} (2 ranks, one node, median of {a.reps}) [{unit}]")
            print(f"{'buffer/call':>16} {'bytes':>10} {'distlaunch':>12} {'MPICH':>12} {'ours/MPICH':>11}")
            order = ["", *a.types.split(",")]
            for kind, size in sorted(ours, key=lambda k: (order.index(k[0]) if k[0] in order else 99, k)):
                if (kind, size) in theirs:
                    x, y = ours[kind, size], theirs[kind, size]
                    ratio = f"{x / y:>11.2f}" if y else f"{'n/a':>11}"  # 0.00 MB/s rounded
                    print(f"{kind or '-':>16} {size:>10} {x:>12.2f} {y:>12.2f} {ratio}")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
