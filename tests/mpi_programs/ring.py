"""Pass a token around a ring (Send/Recv and sendrecv), as in the tutorials."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
token = np.zeros(1, dtype="i")
if rank == 0:
    token[0] = 100
    comm.Send([token, MPI.INT], dest=(rank + 1) % size, tag=7)
    comm.Recv([token, MPI.INT], source=(rank - 1) % size, tag=7)
    print("token back at 0:", token[0] + 0, flush=True)
else:
    comm.Recv([token, MPI.INT], source=rank - 1, tag=7)
    token += rank
    comm.Send([token, MPI.INT], dest=(rank + 1) % size, tag=7)
right, left = (rank + 1) % size, (rank - 1) % size
got = comm.sendrecv(("from", rank), dest=right, source=left)
print(rank, "got", got, flush=True)
buf = np.full(3, rank, dtype="d")
out = np.empty(3, dtype="d")
st = MPI.Status()
comm.Sendrecv(buf, dest=right, sendtag=rank, recvbuf=out, source=left, recvtag=MPI.ANY_TAG, status=st)
print(rank, "Sendrecv", out.tolist(), st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE), flush=True)
comm.Sendrecv_replace(buf, dest=right, source=left)
print(rank, "replace", buf.tolist(), flush=True)
