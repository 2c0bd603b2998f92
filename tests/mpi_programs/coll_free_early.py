"""A new communicator's first collective is small and eager-shaped (Bcast: the root
may leave at once), then the communicator is freed: a slow rank 1 (0.5 s late) must
still get the data -- the fast root must not unlink the group's segment before every
member mapped it (rank 1 then waited in a fresh, empty one until the timeout). Each of
Bcast, Scatter and Gather, twice. Prints one line per rank."""

import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()
got = []
for rnd in range(2):
    sub = comm.Dup()
    if me == 1:
        time.sleep(0.5)
    buf = np.full(4, 7 + rnd if me == 0 else -1, np.int32)
    sub.Bcast(buf, 0)
    sub.Free()
    got.append(int(buf.sum()))
    sub = comm.Dup()
    if me == 1:
        time.sleep(0.5)
    part = np.zeros(2, np.int64)
    sub.Scatter(np.arange(2 * n, dtype=np.int64) if me == 0 else None, part, 0)
    sub.Free()
    got.append(part.tolist())
    sub = comm.Dup()
    if me == 0:
        time.sleep(0.5)
    out = np.zeros(n, np.int32) if me == 0 else None
    sub.Gather(np.array([me + 10], np.int32), out, 0)
    sub.Free()
    if me == 0:
        got.append(out.tolist())
print(f"{me} freed early {got}")
