"""Communicators: Dup, Split, Split_type, Create with groups, Free, COMM_SELF,
COMM_NULL, subclassing Intracomm, attributes and names."""

import numpy as np
from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.rank, world.size
dup = world.Dup()
print(rank, "dup", dup.Get_rank(), dup.Get_size(), dup.Compare(world) == MPI.CONGRUENT, flush=True)
# messages on the duplicate do not mix with the parent's
other = (rank + 1) % size
prev = (rank - 1) % size
world.send("on world", dest=other, tag=5)
dup.send("on dup", dest=other, tag=5)
print(rank, "separate", dup.recv(source=prev, tag=5), world.recv(source=prev, tag=5), flush=True)
half = world.Split(color=rank % 2, key=-rank)
print(rank, "split", half.rank, half.size, half.allreduce(rank), flush=True)
node = world.Split_type(MPI.COMM_TYPE_SHARED)
print(rank, "shared", node.size == size, node.rank == rank, flush=True)
none = world.Split(MPI.UNDEFINED if rank == 0 else 1, 0)
print(rank, "undefined", none == MPI.COMM_NULL, flush=True)
if none != MPI.COMM_NULL:
    none.Free()
grp = world.Get_group()
evens = grp.Incl(list(range(0, size, 2)))
sub = world.Create(evens)
print(
    rank,
    "create",
    sub == MPI.COMM_NULL,
    sub.Get_rank() if sub != MPI.COMM_NULL else -1,
    evens.Get_size(),
    evens.Get_rank(),
    flush=True,
)
if sub != MPI.COMM_NULL:
    x = np.array([rank], "i")
    sub.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    print(rank, "sub sum", x[0] + 0, flush=True)
    sub.Free()
print(rank, "translate", MPI.Group.Translate_ranks(evens, [0], grp), flush=True)
selfc = MPI.COMM_SELF
print(
    rank, "self", selfc.Get_rank(), selfc.Get_size(), selfc.allreduce(rank + 1), selfc.Get_name(), flush=True
)
buf = np.array([rank], "d")
selfc.Bcast(buf, root=0)


class MyComm(MPI.Intracomm):
    def hello(self):
        return f"hello from {self.Get_rank()}"


mine = MyComm(world)
print(rank, "subclass", mine.hello(), mine.Get_size(), mine.bcast("b"), flush=True)
print(
    rank,
    "attrs",
    world.Get_attr(MPI.TAG_UB) >= 32767,
    world.Is_inter(),
    world.Is_intra(),
    world.Get_name(),
    flush=True,
)
dup.Set_name("my dup")
print(rank, "name", dup.Get_name(), dup.name, flush=True)
d2 = dup.Dup()
print(rank, "dup of dup", d2.allgather(rank) == list(range(size)), flush=True)
d2.Free()
dup.Free()
print(rank, "freed", dup == MPI.COMM_NULL, flush=True)
half.Free()
node.Free()
world.Barrier()
