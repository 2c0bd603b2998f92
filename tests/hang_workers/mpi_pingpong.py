"""A distlaunch.mpi ping-pong for SECONDS, silent after one line (which ends the start-up
grace of --hang-timeout): its receives are its only progress."""

import sys
import time

import numpy as np

from distlaunch import mpi as MPI

comm = MPI.COMM_WORLD
rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
buf = np.zeros(1, np.int64)
print(f"rank {rank} up", flush=True)
end = time.monotonic() + float(sys.argv[1])
while True:
    stop = np.array([time.monotonic() > end], np.int64) if rank == 0 else buf
    if rank == 0:
        comm.Send(stop, dest=peer)
        comm.Recv(buf, source=peer)
    else:
        comm.Recv(buf, source=peer)
        comm.Send(buf, dest=peer)
    if (stop if rank == 0 else buf)[0]:
        break
    time.sleep(0.01)
