"""OSU MPI latency test, as in mpi4py's demo/osu_latency.py (ping-pong, 2 ranks).
Usage: osu_latency.py [max_bytes] [iterations]"""

import sys

import numpy as np
from mpi4py import MPI


def osu_latency(max_size=1 << 16, iters=200, skip=20):
    comm = MPI.COMM_WORLD
    myid = comm.Get_rank()
    s_buf = np.full(max_size, ord("a"), dtype="B")
    r_buf = np.empty(max_size, dtype="B")
    if myid == 0:
        print("# OSU MPI Latency Test")
        print("# {:<10} {:>18}".format("Size [B]", "Latency [us]"), flush=True)
    size = 0
    while size <= max_size:
        comm.Barrier()
        for i in range(iters + skip):
            if i == skip:
                t_start = MPI.Wtime()
            if myid == 0:
                comm.Send([s_buf, size, MPI.BYTE], dest=1, tag=1)
                comm.Recv([r_buf, size, MPI.BYTE], source=1, tag=1)
            elif myid == 1:
                comm.Recv([r_buf, size, MPI.BYTE], source=0, tag=1)
                comm.Send([s_buf, size, MPI.BYTE], dest=0, tag=1)
        t_end = MPI.Wtime()
        if myid == 0:
            latency = (t_end - t_start) * 1e6 / (2 * iters)
            print(f"{size:<12} {latency:>18.2f}", flush=True)
        size = size * 2 if size else 1
    if myid == 1:
        assert (r_buf[:max_size] == ord("a")).all()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    osu_latency(*args)
