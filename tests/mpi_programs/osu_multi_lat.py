"""OSU MPI multi-pair latency test, as in mpi4py's demo/osu_multi_lat.py (rank i of the
first half ping-pongs with rank i + n/2; rank 0 prints the mean over all ranks).
Usage: osu_multi_lat.py [max_bytes] [iterations]"""

import sys

import numpy as np
from mpi4py import MPI


def osu_multi_lat(max_size=1 << 16, iters=200, skip=20):
    comm = MPI.COMM_WORLD
    myid, nprocs = comm.Get_rank(), comm.Get_size()
    pairs = nprocs // 2
    s_buf = np.full(max_size, ord("a"), dtype="B")
    r_buf = np.empty(max_size, dtype="B")
    if myid == 0:
        print("# OSU MPI Multi Latency Test")
        print("# {:<10} {:>18}".format("Size [B]", "Latency [us]"), flush=True)
    size = 0
    while size <= max_size:
        comm.Barrier()
        latency = 0.0
        if myid < 2 * pairs:
            partner = myid + pairs if myid < pairs else myid - pairs
            for i in range(iters + skip):
                if i == skip:
                    t_start = MPI.Wtime()
                if myid < pairs:
                    comm.Send([s_buf, size, MPI.BYTE], partner, 1)
                    comm.Recv([r_buf, size, MPI.BYTE], partner, 1)
                else:
                    comm.Recv([r_buf, size, MPI.BYTE], partner, 1)
                    comm.Send([s_buf, size, MPI.BYTE], partner, 1)
            latency = (MPI.Wtime() - t_start) * 1e6 / (2 * iters)
        total = comm.reduce(latency, op=MPI.SUM, root=0)
        if myid == 0:
            print(f"{size:<12} {total / (2 * pairs):>18.2f}", flush=True)
        size = size * 2 if size else 1


if __name__ == "__main__":
    osu_multi_lat(*[int(a) for a in sys.argv[1:]])
