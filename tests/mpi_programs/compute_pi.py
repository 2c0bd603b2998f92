"""Compute pi by numerical integration (the classic cpi example, buffer version)."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
nprocs, myrank = comm.Get_size(), comm.Get_rank()
n = np.array(0, dtype="i")
if myrank == 0:
    n.fill(10000)
comm.Bcast([n, MPI.INT], root=0)
h = 1.0 / n
s = 0.0
for i in range(myrank + 1, int(n) + 1, nprocs):
    x = h * (i - 0.5)
    s += 4.0 / (1.0 + x**2)
mypi = np.array(s * h, dtype="d")
pi = np.array(0.0, dtype="d")
comm.Reduce([mypi, MPI.DOUBLE], [pi, MPI.DOUBLE], op=MPI.SUM, root=0)
if myrank == 0:
    print(f"pi is approximately {float(pi):.12f}, error is {abs(pi - np.pi):.12f}", flush=True)
# the object version
pi2 = comm.reduce(s * h, op=MPI.SUM, root=0)
if myrank == 0:
    print(f"object pi {pi2:.10f}", flush=True)
