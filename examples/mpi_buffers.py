"""Buffer collectives on numpy arrays: Allgather, Reduce, Allreduce, Bcast, Send/Recv.

distlaunch run --nproc-per-node 3 examples/mpi_buffers.py
"""

import numpy as np

from distlaunch import mpi as MPI  # with MPI installed: from mpi4py import MPI

comm = MPI.COMM_WORLD
size, rank = comm.Get_size(), comm.Get_rank()

send = np.full(4, rank, dtype="i")
everyone = np.empty(4 * size, dtype="i")
comm.Allgather([send, MPI.INT], [everyone, MPI.INT])
assert (everyone == np.repeat(np.arange(size), 4)).all()

values = np.arange(5, dtype="d") * (rank + 1)
total = np.empty(5, dtype="d") if rank == 0 else None
comm.Reduce(values, total, op=MPI.SUM, root=0)
if rank == 0:
    assert (total == np.arange(5) * size * (size + 1) / 2).all()
    print(f"Reduce SUM at root: {total.tolist()}", flush=True)

biggest = np.empty(5, dtype="d")
comm.Allreduce(values, biggest, op=MPI.MAX)
assert (biggest == np.arange(5) * size).all()

table = np.arange(6, dtype="d") if rank == 0 else np.empty(6, dtype="d")
comm.Bcast(table, root=0)
assert (table == np.arange(6)).all()

if rank == 0:
    comm.Send(np.array([42.0, 43.0]), dest=size - 1, tag=7)
if rank == size - 1:
    got = np.empty(2)
    comm.Recv(got, source=0, tag=7)
    assert got.tolist() == [42.0, 43.0]
print(f"rank {rank}: Allgather {everyone.tolist()} Allreduce MAX {biggest.tolist()}", flush=True)
