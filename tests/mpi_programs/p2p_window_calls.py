"""Per-call cost of the pieces of an osu_bw window, in microseconds (best of ``reps``
rounds, each ``n`` messages of ``size`` bytes, ``[buf, size, MPI.BYTE]``): rank 1's
``Irecv`` of a message already there and the ``Waitall`` after them; ``Irecv`` posted
before its message and the ``Waitall`` that takes them once they are all there; rank
0's windows of 16 ``Isend`` and their ``Waitall``. The timed rank runs alone (the other
waits in a Barrier): what each call costs, without waiting for the peer. 2 ranks.
Usage: p2p_window_calls.py [size] [n] [reps]"""

import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me = comm.Get_rank()
size, n, reps = (int(a) for a in (sys.argv[1:] + ["8", "800", "7"][len(sys.argv) - 1 :])[:3])
s = np.full(max(size, 1), 97, np.uint8)
r = np.empty(max(size, 1), np.uint8)
best = {}


def keep(name, seconds):
    best[name] = min(best.get(name, 1e9), seconds / n * 1e6)


def sends():
    for _ in range(n):
        comm.Send([s, size, MPI.BYTE], 1, 100)


for _ in range(reps):
    if me == 0:
        sends()
    comm.Barrier()
    if me == 1:  # every message already there
        t0 = time.perf_counter()
        reqs = [comm.Irecv([r, size, MPI.BYTE], 0, 100) for _ in range(n)]
        t1 = time.perf_counter()
        MPI.Request.Waitall(reqs)
        keep("irecv_arrived", t1 - t0)
        keep("waitall_arrived", time.perf_counter() - t1)
        t0 = time.perf_counter()  # posted before any message came
        reqs = [comm.Irecv([r, size, MPI.BYTE], 0, 100) for _ in range(n)]
        keep("irecv_posted", time.perf_counter() - t0)
    comm.Barrier()
    if me == 0:
        sends()
    comm.Barrier()
    if me == 1:
        t0 = time.perf_counter()
        MPI.Request.Waitall(reqs)
        keep("waitall_posted", time.perf_counter() - t0)
    comm.Barrier()
    if me == 0:  # windows of 16 Isend, as osu_bw
        t0 = time.perf_counter()
        for _ in range(n // 16):
            MPI.Request.Waitall([comm.Isend([s, size, MPI.BYTE], 1, 100) for _ in range(16)])
        keep("isend_window", time.perf_counter() - t0)
    comm.Barrier()
    if me == 1:
        for _ in range(n // 16 * 16):
            comm.Recv([r, size, MPI.BYTE], 0, 100)
    comm.Barrier()
for name, us in best.items():
    print(f"{name} {size} {us:.3f}", flush=True)
