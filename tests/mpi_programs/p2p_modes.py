"""Point-to-point beyond Send/Recv: counts in buffer specs, nonblocking requests, probe,
status, wildcards, PROC_NULL, sending to oneself."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
other = (rank + 1) % size
prev = (rank - 1) % size

# [buf, count, datatype] sends only count elements; the receiver learns the count
big = np.arange(10, dtype="d") + rank
comm.Send([big, 4, MPI.DOUBLE], dest=other, tag=1)
recv = np.full(10, -1.0)
st = MPI.Status()
comm.Recv([recv, MPI.DOUBLE], source=prev, tag=1, status=st)
print(rank, "count", st.Get_count(MPI.DOUBLE), recv.tolist(), flush=True)
# (count, displ) and a typecode datatype
comm.Send([big, (3, 2), "d"], dest=other, tag=2)
part = np.zeros(3)
comm.Recv([part, "d"], source=prev, tag=2)
print(rank, "displ", part.tolist(), flush=True)
# zero-size messages
comm.Send([None, "B"], dest=other, tag=3)
comm.Recv([None, "B"], source=prev, tag=3, status=st)
print(rank, "empty", st.Get_count(), st.Get_tag(), flush=True)
# ANY_TAG really matches any tag, and Status says which
comm.send("tagged", dest=other, tag=42)
msg = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
print(
    rank, "anytag", msg, st.Get_source(), st.Get_tag(), st.source, st.tag, st.error == MPI.SUCCESS, flush=True
)
# tags are matched: the later tag can be received first
comm.send("first", dest=other, tag=10)
comm.send("second", dest=other, tag=11)
b = comm.recv(source=prev, tag=11)
a = comm.recv(source=prev, tag=10)
print(rank, "order", a, b, flush=True)
# Isend/Irecv with Wait, Waitall, Test, Waitany
sreqs = [comm.Isend([np.full(2, rank * 10 + k, "i"), MPI.INT], dest=other, tag=20 + k) for k in range(3)]
rbufs = [np.zeros(2, "i") for _ in range(3)]
rreqs = [comm.Irecv([rbufs[k], MPI.INT], source=prev, tag=20 + k) for k in range(3)]
first = MPI.Request.Waitany(rreqs)
MPI.Request.Waitall(rreqs)
MPI.Request.Waitall(sreqs)
print(
    rank, "waitall", [x.tolist() for x in rbufs], 0 <= first < 3, rreqs[first] == MPI.REQUEST_NULL, flush=True
)
req = comm.isend({"k": rank}, dest=other, tag=30)
r2 = comm.irecv(source=prev, tag=30)
obj = r2.wait()
req.wait()
print(rank, "irecv obj", obj, flush=True)
r3 = comm.irecv(source=prev, tag=31)
comm.send(rank, dest=other, tag=31)
while True:
    flag, val = r3.test()
    if flag:
        break
print(rank, "test", flag, val, flush=True)
sr = [comm.isend(k, dest=other, tag=40) for k in range(3)]
rr = [comm.irecv(source=prev, tag=40) for _ in range(3)]
print(rank, "waitall objs", MPI.Request.waitall(rr), flush=True)
MPI.Request.waitall(sr)
print(
    rank,
    "testall",
    MPI.Request.Testall([MPI.REQUEST_NULL]),
    MPI.Request.Waitany([MPI.REQUEST_NULL]) == MPI.UNDEFINED,
    flush=True,
)
# Probe then receive a message of the probed size
if rank == 0:
    comm.Send(np.arange(5, dtype="i"), dest=other, tag=50)
if rank == 1 % size:
    comm.Probe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=st)
    n = st.Get_count(MPI.INT)
    data = np.empty(n, dtype="i")
    comm.Recv([data, MPI.INT], source=st.Get_source(), tag=st.Get_tag())
    print(rank, "probed", n, st.Get_source(), st.Get_tag(), data.tolist(), flush=True)
comm.Barrier()
print(rank, "iprobe", comm.Iprobe(source=MPI.ANY_SOURCE, tag=99), flush=True)
# PROC_NULL: completes at once
comm.Send(big, dest=MPI.PROC_NULL)
comm.Recv(recv, source=MPI.PROC_NULL, status=st)
print(
    rank,
    "procnull",
    st.Get_source() == MPI.PROC_NULL,
    st.Get_count(),
    comm.recv(source=MPI.PROC_NULL),
    flush=True,
)
# sending to oneself
comm.send(("me", rank), dest=rank, tag=60)
print(rank, "self", comm.recv(source=rank, tag=60), flush=True)
mine = np.zeros(3, "i")
r = comm.Irecv(mine, source=rank, tag=61)
comm.Send(np.arange(3, dtype="i") * rank, dest=rank, tag=61)
r.Wait()
print(rank, "self buf", mine.tolist(), flush=True)
# the send modes
sreq = comm.Issend([big, 2, MPI.DOUBLE], dest=other, tag=70)
comm.Recv([recv, 2, MPI.DOUBLE], source=prev, tag=70)
sreq.Wait()
MPI.Attach_buffer(bytearray(1 << 16))
comm.Bsend([big, 1, MPI.DOUBLE], dest=other, tag=71)
comm.Recv([recv, 1, MPI.DOUBLE], source=prev, tag=71)
MPI.Detach_buffer()
sreq = comm.issend("s", dest=other, tag=72)
print(rank, "modes", recv[:2].tolist(), comm.recv(source=prev, tag=72), flush=True)
sreq.wait()
# truncation is an error
comm.Send(np.zeros(4), dest=other, tag=80)
try:
    comm.Recv(np.zeros(2), source=prev, tag=80)
    print(rank, "truncate: no error", flush=True)
except MPI.Exception as e:
    print(rank, "truncate", e.Get_error_class() == MPI.ERR_TRUNCATE, flush=True)
comm.Barrier()
