"""OSU MPI bandwidth test, as in mpi4py's demo/osu_bw.py (windows of Isend, 2 ranks).
Usage: osu_bw.py [max_bytes] [iterations]"""

import sys

import numpy as np
from mpi4py import MPI


def osu_bw(max_size=1 << 22, iters=20, window=16):
    comm = MPI.COMM_WORLD
    myid = comm.Get_rank()
    s_buf = np.full(max_size, ord("a"), dtype="B")
    r_buf = np.empty(max_size, dtype="B")
    ack = np.empty(4, dtype="B")
    if myid == 0:
        print("# OSU MPI Bandwidth Test")
        print("# {:<10} {:>18}".format("Size [B]", "Bandwidth [MB/s]"), flush=True)
    size = 1
    while size <= max_size:
        comm.Barrier()
        t_start = MPI.Wtime()
        for _ in range(iters):
            if myid == 0:
                reqs = [comm.Isend([s_buf, size, MPI.BYTE], dest=1, tag=100) for _ in range(window)]
                MPI.Request.Waitall(reqs)
                comm.Recv([ack, 4, MPI.BYTE], source=1, tag=101)
            else:
                reqs = [comm.Irecv([r_buf, size, MPI.BYTE], source=0, tag=100) for _ in range(window)]
                MPI.Request.Waitall(reqs)
                comm.Send([ack, 4, MPI.BYTE], dest=0, tag=101)
        t_end = MPI.Wtime()
        if myid == 0:
            mbs = size / 1e6 * iters * window / (t_end - t_start)
            print(f"{size:<12} {mbs:>18.2f}", flush=True)
        size *= 4


if __name__ == "__main__":
    osu_bw(*[int(a) for a in sys.argv[1:]])
