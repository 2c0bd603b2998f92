"""distlaunch only (MPICH's algorithms may wait here): small Bcast, Scatter and Gather
are eager on shared memory -- the root of Bcast and Scatter and the non-roots of
Gather leave without waiting for the others, so a program that sends to the others
after such a call, while they receive before making it, completes (for every root);
then two ranks that each call Bcast as its root (nobody reads the other) get
CollectiveMismatchError from the next call. Prints what each rank saw."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()

# -- eager: the root (Bcast, Scatter) or the non-roots (Gather) go on at once
eager = 0
for root in range(n):
    box = np.full(4, me, np.int32)
    if me == root:
        comm.Bcast(box, root)
        for j in range(n):
            if j != root:
                comm.Send(np.array([root], np.int32), j, tag=7)
    else:
        token = np.zeros(1, np.int32)
        comm.Recv(token, root, tag=7)
        comm.Bcast(box, root)
        eager += int(token[0] == root and (box == root).all())
    part = np.zeros(2, np.int64)
    if me == root:
        comm.Scatter(np.arange(2 * n, dtype=np.int64) + 100 * root, part, root)
        for j in range(n):
            if j != root:
                comm.Send(np.array([root], np.int32), j, tag=8)
    else:
        token = np.zeros(1, np.int32)
        comm.Recv(token, root, tag=8)
        comm.Scatter(None, part, root)
        eager += int(part.tolist() == [100 * root + 2 * me, 100 * root + 2 * me + 1])
    got = np.zeros(n, np.int32) if me == root else None
    if me != root:
        comm.Gather(np.array([me + root], np.int32), got, root)
        comm.Send(np.array([me], np.int32), root, tag=9)
    else:
        for j in range(n):
            if j != root:
                comm.Recv(np.zeros(1, np.int32), j, tag=9)
        comm.Gather(np.array([me + root], np.int32), got, root)
        eager += int(got.tolist() == [j + root for j in range(n)])
print(f"{me} eager {eager}")

# -- disagreeing roots: each rank is a root, nobody reads; the next call compares
where = "call"
try:
    comm.Bcast(np.zeros(2, np.uint8), me % 2)
    where = "next call"
    comm.Barrier()
    print(f"{me} roots: no error")
except Exception as e:
    print(f"{me} roots: {type(e).__name__} in the {where}: {str(e)[:400]}")
