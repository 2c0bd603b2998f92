"""Wrong buffer collectives on 2 ranks: a Gather root whose receive blocks are smaller
than what is sent raises one clear MPI.Exception before anything moves (so a correct
Gather after it still works); a Gather on one rank against a Scatter on the other
raises on both. Prints what each rank saw."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me = comm.Get_rank()
send = np.arange(4, dtype=np.uint8) + 10 * me
recv = np.zeros(8, np.uint8)
if me == 0:
    try:
        comm.Gather([send, 4, MPI.BYTE], [recv, 1, MPI.BYTE], root=0)
        print("rank 0: no error for a short recvbuf")
    except MPI.Exception as e:
        print(f"rank 0: {type(e).__name__}: {e}")
comm.Gather([send, 4, MPI.BYTE], [recv, 4, MPI.BYTE] if me == 0 else None, root=0)
if me == 0:
    print(f"rank 0: gathered {recv.tolist()}")
try:
    if me == 0:
        comm.Gather([send, 4, MPI.BYTE], [recv, 4, MPI.BYTE], root=0)
    else:
        comm.Scatter(None, [recv, 4, MPI.BYTE], root=0)
    print(f"rank {me}: no error for a mismatch")
except Exception as e:
    print(f"rank {me}: mismatch {type(e).__name__}: {str(e)[:120]}")
