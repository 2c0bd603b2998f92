"""Persistent requests (MPI_Send_init / MPI_Recv_init, mpi4py's Prequest): a halo-style
exchange around a ring started with Startall and completed with Waitall, the send
buffer changing between rounds (each Start sends what it holds then), Status of a
persistent receive, Waitany/Testall over persistent requests, completing an inactive
request, and Free. Every rank prints what it saw."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % size, (rank - 1) % size


def show(*what):
    print(rank, *what, flush=True)


# 1. ring exchange, 5 rounds, the same requests
out, into = np.zeros(4, "i"), np.zeros(4, "i")
reqs = [
    comm.Recv_init([into, MPI.INT], source=left, tag=7),
    comm.Send_init([out, MPI.INT], dest=right, tag=7),
]
seen = []
for k in range(5):
    out[:] = np.arange(4) + 100 * rank + k
    MPI.Prequest.Startall(reqs)
    MPI.Request.Waitall(reqs)
    seen.append(into.tolist())
show("ring", seen, [bool(r) for r in reqs], [r == MPI.REQUEST_NULL for r in reqs])

# 2. Status of a persistent receive from any source / any tag; Ssend_init
st = MPI.Status()
rbuf = np.zeros(8, "d")
recv = comm.Recv_init([rbuf, MPI.DOUBLE], source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
send = comm.Ssend_init([np.full(3, rank, "d"), MPI.DOUBLE], dest=right, tag=20 + rank)
recv.Start()
send.Start()
recv.Wait(st)
send.Wait()
show("status", st.Get_source(), st.Get_tag(), st.Get_count(MPI.DOUBLE), rbuf[:3].tolist())

# 3. completing an inactive request returns at once with an empty status
st = MPI.Status()
show("inactive", recv.Test(st), st.Get_source() == MPI.ANY_SOURCE, st.Get_tag() == MPI.ANY_TAG)
recv.Wait()

# 4. Waitany over persistent requests, then all inactive -> UNDEFINED
bufs = [np.zeros(1, "i") for _ in range(3)]
recvs = [comm.Recv_init(bufs[t], source=left, tag=30 + t) for t in range(3)]
sends = [comm.Send_init(np.full(1, 10 * rank + t, "i"), dest=right, tag=30 + t) for t in range(3)]
MPI.Prequest.Startall(recvs)
MPI.Prequest.Startall(sends)
done = sorted(MPI.Request.Waitany(recvs) for _ in range(3))
show("waitany", done, [b[0] for b in bufs], MPI.Request.Waitany(recvs) == MPI.UNDEFINED)
MPI.Request.Waitall(sends)
show("testall", MPI.Request.Testall(recvs + sends))

# 5. Free: the request becomes REQUEST_NULL
for r in reqs + recvs + sends + [recv, send]:
    r.Free()
show("freed", [bool(r) for r in reqs], reqs[0] == MPI.REQUEST_NULL)
comm.Barrier()
