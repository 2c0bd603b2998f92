"""OSU MPI bi-directional bandwidth test, as in mpi4py's demo/osu_bibw.py (both ranks
post a window of Irecv then a window of Isend, 2 ranks).
Usage: osu_bibw.py [max_bytes] [iterations] [window]"""

import sys

import numpy as np
from mpi4py import MPI


def osu_bibw(max_size=1 << 22, iters=20, window=16):
    comm = MPI.COMM_WORLD
    myid = comm.Get_rank()
    peer = 1 - myid
    s_buf = np.full(max_size, ord("a"), dtype="B")
    r_buf = np.empty(max_size, dtype="B")
    if myid == 0:
        print("# OSU MPI Bi-Directional Bandwidth Test")
        print("# {:<10} {:>18}".format("Size [B]", "Bandwidth [MB/s]"), flush=True)
    size = 1
    while size <= max_size:
        comm.Barrier()
        t_start = MPI.Wtime()
        for _ in range(iters):
            recvs = [comm.Irecv([r_buf, size, MPI.BYTE], source=peer, tag=10) for _ in range(window)]
            sends = [comm.Isend([s_buf, size, MPI.BYTE], dest=peer, tag=10) for _ in range(window)]
            MPI.Request.Waitall(sends)
            MPI.Request.Waitall(recvs)
        t_end = MPI.Wtime()
        if myid == 0:
            mbs = 2 * size / 1e6 * iters * window / (t_end - t_start)
            print(f"{size:<12} {mbs:>18.2f}", flush=True)
        size *= 4


if __name__ == "__main__":
    osu_bibw(*[int(a) for a in sys.argv[1:]])
