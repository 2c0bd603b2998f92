"""Collectives as the tutorials use them: IN_PLACE, v-variants, alltoall, scan,
reduce_scatter, MINLOC/MAXLOC, user-defined ops."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# IN_PLACE in Gather, Scatter, Allgather, Reduce
full = np.zeros(size * 2, dtype="i")
full[rank * 2 : rank * 2 + 2] = rank + 1
comm.Allgather(MPI.IN_PLACE, [full, MPI.INT])
print(rank, "allgather in place", full.tolist(), flush=True)
g = np.zeros(size * 2, dtype="d")
if rank == 0:
    g[:2] = 7
    comm.Gather(MPI.IN_PLACE, g, root=0)
    print("gather in place", g.tolist(), flush=True)
else:
    comm.Gather(np.full(2, rank, dtype="d"), None, root=0)
sc = np.arange(size * 3, dtype="d") if rank == 0 else None
mine = np.zeros(3)
if rank == 0:
    comm.Scatter(sc, MPI.IN_PLACE, root=0)
    print("scatter in place root keeps", sc[:3].tolist(), flush=True)
else:
    comm.Scatter(None, mine, root=0)
    print(rank, "scatter", mine.tolist(), flush=True)
# v-variants
counts = [r + 1 for r in range(size)]
displs = [sum(counts[:r]) for r in range(size)]
send = np.full(rank + 1, rank, dtype="i")
recv = np.zeros(sum(counts), dtype="i") if rank == 0 else None
comm.Gatherv(send, [recv, counts, displs, MPI.INT] if rank == 0 else None, root=0)
if rank == 0:
    print("gatherv", recv.tolist(), flush=True)
allv = np.zeros(sum(counts), dtype="i")
comm.Allgatherv([send, MPI.INT], [allv, (counts, displs), MPI.INT])
print(rank, "allgatherv", allv.tolist(), flush=True)
src = np.arange(sum(counts), dtype="d") * 10 if rank == 0 else None
part = np.zeros(rank + 1)
comm.Scatterv([src, counts, displs, MPI.DOUBLE] if rank == 0 else None, part, root=0)
print(rank, "scatterv", part.tolist(), flush=True)
scounts = [1] * size
sdispls = list(range(size))
rcounts = [1] * size
a2a_in = np.arange(size, dtype="i") + 100 * rank
a2a_out = np.zeros(size, dtype="i")
comm.Alltoallv([a2a_in, (scounts, sdispls), MPI.INT], [a2a_out, (rcounts, sdispls), MPI.INT])
print(rank, "alltoallv", a2a_out.tolist(), flush=True)
sendbuf = np.arange(size * 2, dtype="i") + rank * 100
recvbuf = np.zeros(size * 2, dtype="i")
comm.Alltoall(sendbuf, recvbuf)
print(rank, "Alltoall", recvbuf.tolist(), flush=True)
print(rank, "alltoall", comm.alltoall([(rank, i) for i in range(size)]), flush=True)
# Scan / Exscan
val = np.array([rank + 1], dtype="i")
out = np.zeros(1, dtype="i")
comm.Scan(val, out, op=MPI.SUM)
ex = np.full(1, -5, dtype="i")
comm.Exscan(val, ex, op=MPI.SUM)
print(rank, "scan", out[0] + 0, "exscan", ex[0] + 0 if rank else None, flush=True)
print(rank, "scan obj", comm.scan(rank + 1), comm.exscan(rank + 1), comm.scan(rank, op=MPI.MAX), flush=True)
# Reduce_scatter
rs_in = np.arange(size * 2, dtype="d") * (rank + 1)
rs_out = np.zeros(2)
comm.Reduce_scatter_block(rs_in, rs_out, op=MPI.SUM)
print(rank, "reduce_scatter_block", rs_out.tolist(), flush=True)
rc = [2] * size
rs2 = np.zeros(2)
comm.Reduce_scatter(rs_in, rs2, recvcounts=rc, op=MPI.MAX)
print(rank, "reduce_scatter", rs2.tolist(), flush=True)
# MINLOC / MAXLOC, objects and pair buffers
value = (rank * 7) % 5
print(
    rank,
    "minloc",
    comm.allreduce((value, rank), op=MPI.MINLOC),
    comm.allreduce((value, rank), op=MPI.MAXLOC),
    flush=True,
)
pair = np.dtype([("v", "f8"), ("i", "i4")], align=True)
pairs = np.array([(float(value), rank)], dtype=pair)
res = np.zeros(1, dtype=pair)
comm.Allreduce([pairs, MPI.DOUBLE_INT], [res, MPI.DOUBLE_INT], op=MPI.MAXLOC)
print(rank, "MAXLOC", float(res["v"][0]), int(res["i"][0]), flush=True)
two = np.array([value, rank], dtype="i")
two_out = np.zeros(2, dtype="i")
comm.Allreduce([two, MPI.TWOINT], [two_out, MPI.TWOINT], op=MPI.MINLOC)
print(rank, "MINLOC 2INT", two_out.tolist(), flush=True)


# user-defined ops
def myadd(xmem, ymem, dt):
    x = np.frombuffer(xmem, dtype="i")
    y = np.frombuffer(ymem, dtype="i")
    y[0] += x[0]
    y[1] = max(x[1], y[1])


op = MPI.Op.Create(myadd, commute=True)
a = np.array([rank, 3 * rank % 4], dtype="i")
b = np.zeros(2, dtype="i")
comm.Allreduce(a, b, op=op)
op.Free()
print(rank, "user op", b.tolist(), flush=True)
concat = MPI.Op.Create(lambda x, y, dt: x + y, commute=False)
print(rank, "user op obj", comm.allreduce([rank], op=concat), flush=True)
prod = np.array([rank + 1.0])
comm.Allreduce(MPI.IN_PLACE, prod, op=MPI.PROD)
flags = np.array([rank % 2, 1], dtype="i")
lor = np.zeros(2, dtype="i")
comm.Allreduce(flags, lor, op=MPI.LOR)
mx = np.zeros(1, dtype="i")
comm.Reduce(np.array([rank], "i"), mx if rank == 0 else None, op=MPI.MAX, root=0)
print(rank, "ops", prod.tolist(), lor.tolist(), mx[0] + 0 if rank == 0 else "", flush=True)
