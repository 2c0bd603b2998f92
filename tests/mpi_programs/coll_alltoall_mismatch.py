"""Alltoall with rank 0 sending blocks of another size than the others, on every path:
``planned`` (both sizes ran correctly before on their own buffers, so every rank has a
plan of its call: the repeated small calls' path), ``first`` (a first call: the general
path) and ``large`` (blocks longer than one eager phase on a small slot: several
phases). Each wrong call must raise on every rank (the general path accepted it and
moved garbage); a correct call on fresh buffers checks the data. Prints one line per
case and rank. Usage: coll_alltoall_mismatch.py case"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()
case = sys.argv[1]
small, big = (8, 16) if case != "large" else (6000, 9000)


def alltoall(nb, send, recv):
    comm.Alltoall([send, nb, MPI.BYTE], [recv, nb, MPI.BYTE])


def data(nb, rank):
    return ((np.arange(nb * n) * 7 + rank * 31) & 0xFF).astype(np.uint8)


bufs = {nb: (data(nb, me), np.zeros(nb * n, np.uint8)) for nb in (small, big)}
if case == "planned":
    for nb in (small, big):  # correct calls: every rank keeps a plan of each
        for _ in range(3):
            alltoall(nb, *bufs[nb])
        want = np.concatenate([data(nb, j)[me * nb : (me + 1) * nb] for j in range(n)])
        assert (bufs[nb][1] == want).all(), (nb, bufs[nb][1], want)
mine = small if me == 0 else big
try:
    alltoall(mine, *bufs[mine])
    print(f"{me} {case}: no error, got {bufs[mine][1][:4].tolist()}", flush=True)
except Exception as e:
    print(f"{me} {case}: {type(e).__name__}: {str(e)[:160]}", flush=True)
