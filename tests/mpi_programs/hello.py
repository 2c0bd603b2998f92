"""Hello world (mpi4py tutorial)."""

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
size = comm.Get_size()
rank = comm.Get_rank()
sys.stdout.write(f"Hello, World! I am process {rank} of {size}.\n")
sys.stdout.flush()
