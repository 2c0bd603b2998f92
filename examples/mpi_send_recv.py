"""Point-to-point messages of Python objects with tags (mpi4py's lowercase send/recv).

distlaunch run --nproc-per-node 2 examples/mpi_send_recv.py
"""

from distlaunch import mpi as MPI  # with MPI installed: from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if rank == 0:
    for dest in range(1, size):
        comm.send({"to": dest, "payload": list(range(dest))}, dest=dest, tag=11)
    replies = sorted(comm.recv(source=MPI.ANY_SOURCE, tag=12) for _ in range(1, size))
    print(f"rank 0 got replies {replies}", flush=True)
else:
    msg = comm.recv(source=0, tag=11)
    assert msg["to"] == rank
    comm.send(f"ack from {rank}", dest=0, tag=12)
    print(f"rank {rank} received {msg}", flush=True)
