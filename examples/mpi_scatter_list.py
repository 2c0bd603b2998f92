"""Scatter a list (one item per rank), square each item, gather the results at rank 0.

distlaunch run --nproc-per-node 3 examples/mpi_scatter_list.py
"""

from distlaunch import mpi as MPI  # with MPI installed: from mpi4py import MPI

comm = MPI.COMM_WORLD
size, rank = comm.Get_size(), comm.Get_rank()
items = [(i + 1) ** 2 for i in range(size)] if rank == 0 else None
mine = comm.scatter(items, root=0)
assert mine == (rank + 1) ** 2
squares = comm.gather(mine * mine, root=0)
if rank == 0:
    assert squares == [(i + 1) ** 4 for i in range(size)]
    print(f"gathered {squares}", flush=True)
print(f"rank {rank} had {mine}", flush=True)
