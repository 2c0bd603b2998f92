"""Derived datatypes: contiguous, vector (a matrix column), indexed, struct, subarray."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
other, prev = (rank + 1) % size, (rank - 1) % size
print(
    rank,
    "sizes",
    MPI.DOUBLE.Get_size(),
    MPI.INT.Get_extent(),
    MPI.DOUBLE_INT.Get_size(),
    MPI.DOUBLE.Get_name(),
    flush=True,
)
row = MPI.DOUBLE.Create_contiguous(4).Commit()
print(rank, "contiguous", row.Get_size(), row.Get_extent(), flush=True)
a = np.arange(16, dtype="d").reshape(4, 4) + 100 * rank
comm.Send([a, 1, row], dest=other, tag=1)
got = np.zeros(4)
comm.Recv([got, MPI.DOUBLE], source=prev, tag=1)
print(rank, "row", got.tolist(), flush=True)
col = MPI.DOUBLE.Create_vector(4, 1, 4).Commit()
print(rank, "vector", col.Get_size(), col.Get_extent(), flush=True)
comm.Send([a, 1, col], dest=other, tag=2)
b = np.zeros((4, 4))
comm.Recv([b, 1, col], source=prev, tag=2)
print(rank, "column", b[:, 0].tolist(), b.sum(), flush=True)
idx = MPI.INT.Create_indexed([2, 1], [0, 5]).Commit()
ints = np.arange(8, dtype="i") + rank
comm.Send([ints, 1, idx], dest=other, tag=3)
packed = np.zeros(3, "i")
comm.Recv(packed, source=prev, tag=3)
print(rank, "indexed", packed.tolist(), idx.Get_size(), idx.Get_extent(), flush=True)
rec = np.dtype([("x", "i4"), ("y", "f8")], align=True)
st = MPI.Datatype.Create_struct(
    [1, 1], [rec.fields["x"][1], rec.fields["y"][1]], [MPI.INT, MPI.DOUBLE]
).Commit()
print(rank, "struct", st.Get_size(), st.Get_extent(), flush=True)
recs = np.array([(rank, rank / 2), (rank + 1, 0.25)], dtype=rec)
comm.Send([recs, 2, st], dest=other, tag=4)
back = np.zeros(2, dtype=rec)
comm.Recv([back, 2, st], source=prev, tag=4)
print(rank, "records", back["x"].tolist(), back["y"].tolist(), flush=True)
sa = MPI.INT.Create_subarray([4, 4], [2, 2], [1, 1]).Commit()
grid = np.arange(16, dtype="i").reshape(4, 4) * (rank + 1)
comm.Send([grid, 1, sa], dest=other, tag=5)
block = np.zeros(4, "i")
comm.Recv(block, source=prev, tag=5)
print(rank, "subarray", block.tolist(), sa.Get_size(), sa.Get_extent(), flush=True)
bc = np.zeros((4, 4))
if rank == 0:
    bc[:] = a
comm.Bcast([bc, 1, col], root=0)
print(rank, "collective with types", bc[:, 0].tolist(), bc[:, 1].tolist(), flush=True)
for t in (row, col, idx, st, sa):
    t.Free()
