"""A distlaunch.mpi program (mpi4py's API) that deadlocks in a Recv: rank 0 waits for a
message from rank 1 with tag 5, which rank 1 never sends (it sleeps)."""

import time

import numpy as np

from distlaunch import mpi as MPI

comm = MPI.COMM_WORLD
print(f"rank {comm.Get_rank()} up", flush=True)
if comm.Get_rank() == 0:
    buf = np.empty(4, np.int32)
    comm.Recv(buf, source=1, tag=5)  # RECV-LINE
else:
    time.sleep(600)
