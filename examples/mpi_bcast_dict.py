"""Broadcast a Python dict from rank 0 (mpi4py style).

distlaunch run --nproc-per-node 3 examples/mpi_bcast_dict.py
"""

from distlaunch import mpi as MPI  # with MPI installed: from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
data = {"lr": 0.1, "layers": [64, 10], "name": "digits"} if rank == 0 else None
data = comm.bcast(data, root=0)
assert data["layers"] == [64, 10]
print(f"rank {rank} got {sorted(data.items())}", flush=True)
