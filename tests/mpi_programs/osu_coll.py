"""OSU MPI collective latency tests, as in mpi4py's demos osu_bcast, osu_allgather,
osu_gather, osu_scatter and osu_alltoall: ``mmap`` buffers passed as ``[buf, count,
MPI.BYTE]`` (the scatter root receives IN_PLACE, as there); prints one line per size
on rank 0. Usage: osu_coll.py op [min_bytes] [max_bytes] [iterations]"""

import mmap
import sys

from mpi4py import MPI


def sizes(lo, hi):
    out = [0] if lo == 0 else []
    return out + [1 << i for i in range(31) if lo <= (1 << i) <= hi]


def main(op, lo=0, hi=1 << 10, iters=200, skip=20):
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    sbuf = mmap.mmap(-1, max(hi * n, 1))
    rbuf = mmap.mmap(-1, max(hi * n, 1))
    for i in range(len(sbuf)):  # distinct bytes, so a wrong block shows
        sbuf[i] = (i * 7 + me * 31) & 0xFF
    if me == 0:
        print(f"# OSU MPI {op} Latency Test\n# Size [B]  Latency [us]", flush=True)
    for size in sizes(lo, hi):
        s_msg, r_msg = [sbuf, size, MPI.BYTE], [rbuf, size, MPI.BYTE]
        if op == "scatter":
            s_msg, r_msg = (s_msg, MPI.IN_PLACE) if me == 0 else (None, r_msg)
        elif op == "gather" and me != 0:
            r_msg = [None, size, MPI.BYTE]
        call = {
            "bcast": lambda: comm.Bcast(s_msg, 0),
            "allgather": lambda: comm.Allgather(s_msg, r_msg),
            "gather": lambda: comm.Gather(s_msg, r_msg, 0),
            "scatter": lambda: comm.Scatter(s_msg, r_msg, 0),
            "alltoall": lambda: comm.Alltoall(s_msg, r_msg),
        }[op]
        loops = iters if size <= 8192 else max(10, iters // 10)
        comm.Barrier()
        for i in range(loops + skip):
            if i == skip:
                t0 = MPI.Wtime()
            call()
        t1 = MPI.Wtime()
        comm.Barrier()
        if me == 0:
            print(f"{size} {(t1 - t0) * 1e6 / loops:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
