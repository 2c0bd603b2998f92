"""distlaunch only: the ranks disagree on the root of the program's last (small, eager)
Bcast, so nobody reads anybody's data and the call cannot see it, and the program ends
without MPI.Finalize. MPI is finalized at exit (as mpi4py does), which compares the
calls: every rank prints CollectiveMismatchError on stderr and exits with status 1."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me = comm.Get_rank()
comm.Bcast(np.zeros(2, np.uint8), 0)  # an agreed first call
comm.Bcast(np.zeros(2, np.uint8), me % 2)
print(f"{me} left without Finalize", flush=True)
