"""Point-to-point with every buffer type (numpy, bytearray, bytes to send, memoryview
slices, mmap, array.array, torch CPU tensors) as programs pass them: ``[buf, count,
MPI.BYTE]`` sending exactly ``count`` bytes, received into a part of a larger buffer
(the bytes around it must stay untouched), bare buffers, typed specs, a truncated
receive, Isend/Irecv windows with mixed tags (delivered in order per tag) partly sent
before the receives were posted, ANY_TAG with statuses, and a persistent receive.
2 ranks: rank 0 sends, rank 1 prints what it received. ``--no-torch``: leave torch
tensors out (importing torch costs each rank seconds of CPU)."""

import array
import mmap
import sys

import numpy as np
from mpi4py import MPI

torch = None
if "--no-torch" not in sys.argv[1:]:
    try:
        import torch
    except ImportError:
        pass

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
PAT = bytes((i * 7 + 3) & 0xFF for i in range(64))
KINDS = ["numpy", "bytearray", "bytes", "memoryview", "mmap", "array"] + (["torch"] if torch else [])
_keep = []  # the mmaps behind memoryview slices


def make(kind, data):
    """A buffer of ``kind`` holding ``data`` (writable, except bytes)."""
    if kind == "numpy":
        return np.frombuffer(bytearray(data), np.uint8)
    if kind == "bytearray":
        return bytearray(data)
    if kind == "bytes":
        return bytes(data)
    if kind == "memoryview":  # a slice in the middle of a larger mapping
        m = mmap.mmap(-1, len(data) + 16)
        _keep.append(m)
        m[8 : 8 + len(data)] = data
        return memoryview(m)[8 : 8 + len(data)]
    if kind == "mmap":
        m = mmap.mmap(-1, max(len(data), 1))
        m[: len(data)] = data
        return m
    if kind == "array":
        return array.array("B", data)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def content(buf):
    return bytes(buf.numpy()) if torch is not None and isinstance(buf, torch.Tensor) else bytes(buf)


def show(*what):
    print(*what, flush=True)


for kind in KINDS:
    rkind = "bytearray" if kind == "bytes" else kind
    if rank == 0:
        s = make(kind, PAT)
        comm.Send([s, 10, MPI.BYTE], dest=1, tag=1)  # exactly 10 bytes of 64
        comm.Send(make(kind, PAT[5:9]), dest=1, tag=2)  # a bare buffer: all of it
        comm.Send([s, 20, MPI.BYTE], dest=1, tag=3)  # longer than the receive
        reqs = [comm.Isend([make(kind, PAT[k : k + 12]), 3 + k, MPI.BYTE], 1, 10 + k % 2) for k in range(4)]
        comm.Barrier()  # half the window sent before rank 1 posts its receives
        reqs += [
            comm.Isend([make(kind, PAT[k : k + 12]), 3 + k, MPI.BYTE], 1, 10 + k % 2) for k in range(4, 8)
        ]
        MPI.Request.Waitall(reqs)
        comm.Barrier()
    else:
        r = make(rkind, b"\xee" * 64)
        st = MPI.Status()
        comm.Recv([r, 45, MPI.BYTE], source=0, tag=1, status=st)
        show(kind, "count", st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE), content(r).hex())
        r2 = make(rkind, b"\xee" * 6)
        comm.Recv(r2, source=0, tag=2, status=st)
        show(kind, "bare", st.Get_count(MPI.BYTE), content(r2).hex())
        try:
            comm.Recv([r, 10, MPI.BYTE], source=0, tag=3)
            show(kind, "truncate", "not raised")
        except MPI.Exception as e:
            show(kind, "truncate", e.Get_error_class() == MPI.ERR_TRUNCATE)
        comm.Barrier()
        bufs = [make(rkind, b"\xee" * 12) for _ in range(8)]
        # tag 11 first, then tag 10: each tag's messages in the order sent
        reqs = [comm.Irecv([bufs[k], 12, MPI.BYTE], 0, 11) for k in range(4)]
        reqs += [comm.Irecv([bufs[k], 12, MPI.BYTE], 0, 10) for k in range(4, 8)]
        sts = [MPI.Status() for _ in reqs]
        MPI.Request.Waitall(reqs, sts)
        for k, (b, x) in enumerate(zip(bufs, sts)):
            show(kind, "window", k, x.Get_tag(), x.Get_count(MPI.BYTE), content(b).hex())
        comm.Barrier()

# typed: [buf, count, DOUBLE] of an array.array('d') sends count doubles; ANY_TAG window
if rank == 0:
    comm.Send([array.array("d", [1.5, 2.5, 3.5, 4.5]), 3, MPI.DOUBLE], dest=1, tag=5)
    for k in range(6):
        comm.Send([np.full(k + 1, k, np.int32), MPI.INT], dest=1, tag=20 + k % 3)
    comm.Send([bytearray(PAT), 16, MPI.BYTE], dest=1, tag=7)
else:
    d = np.zeros(5)
    st = MPI.Status()
    comm.Recv(d, source=0, tag=MPI.ANY_TAG, status=st)
    show("typed", st.Get_tag(), st.Get_count(MPI.DOUBLE), d.tolist())
    bufs = [array.array("i", [-1] * 8) for _ in range(6)]
    reqs = [comm.Irecv([b, MPI.INT], 0, MPI.ANY_TAG) for b in bufs]
    sts = [MPI.Status() for _ in reqs]
    MPI.Request.Waitall(reqs, sts)
    for b, x in zip(bufs, sts):
        show("anytag", x.Get_tag(), x.Get_count(MPI.INT), list(b))
    m = mmap.mmap(-1, 64)
    p = comm.Recv_init([memoryview(m)[16:48], 32, MPI.BYTE], 0, 7)
    p.Start()
    p.Wait(st)
    show("persistent", st.Get_count(MPI.BYTE), m[:].hex())
    p.Free()

# numpy arrays over mmaps (np.frombuffer): after a Send and a Recv the program can close
# its mmaps (nothing of ours keeps a view of them)
comm.Barrier()
mm = mmap.mmap(-1, 64)
arr = np.frombuffer(mm, np.uint8)
if rank == 0:
    arr[:] = np.arange(64, dtype=np.uint8)
    comm.Send(arr, dest=1, tag=30)
else:
    comm.Recv(arr, source=0, tag=30)
    show("frombuffer", int(arr.sum()))
del arr
try:
    mm.close()
    show("mmap closed")
except BufferError as e:
    show("mmap not closed:", e)

# a bytearray and an mmap sent and received with a count (a view cut to it): afterwards
# the program can resize the one and close the other (nothing of ours keeps a view)
comm.Barrier()
ba, mm = bytearray(PAT), mmap.mmap(-1, 64)
if rank == 0:
    comm.Send([ba, 8, MPI.BYTE], dest=1, tag=31)
    comm.Send([mm, 8, MPI.BYTE], dest=1, tag=32)
else:
    comm.Recv([ba, 8, MPI.BYTE], source=0, tag=31)
    comm.Recv([mm, 8, MPI.BYTE], source=0, tag=32)
reqs = [comm.Isend([ba, 4, MPI.BYTE], dest=1 - rank, tag=33), comm.Irecv([mm, 4, MPI.BYTE], 1 - rank, 33)]
MPI.Request.Waitall(reqs)
try:
    ba.extend(b"x")
    show(rank, "bytearray resized", len(ba))
except BufferError as e:
    show(rank, "bytearray not resized:", e)
try:
    mm.close()
    show(rank, "cut mmap closed")
except BufferError as e:
    show(rank, "cut mmap not closed:", e)

# a numpy array sent and received with a count, then another one bare: the first can be
# resized afterwards (what is kept of the last array lets go of it once another takes
# its place)
a, b = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
for x in ([a, 8, MPI.BYTE], b):
    if rank == 0:
        comm.Send(x, dest=1, tag=34)
    else:
        comm.Recv(x, source=0, tag=34)
try:
    a.resize(128)
    show(rank, "first array resized", a.size)
except ValueError as e:
    show(rank, "first array not resized:", type(e).__name__)

# an Irecv into an mmap completed by Test (the message routed to it, not taken from the
# ring by a wait), one cancelled and one whose message was already kept (probed): the
# program still holds the requests, and can close the mmaps (a completed or cancelled
# request keeps no view of its buffer)
comm.Barrier()
m1, m2, m3 = mmap.mmap(-1, 64), mmap.mmap(-1, 64), mmap.mmap(-1, 64)
if rank == 0:
    comm.Send([bytearray(PAT), 4, MPI.BYTE], dest=1, tag=35)
    comm.Send([bytearray(PAT), 6, MPI.BYTE], dest=1, tag=37)
else:
    r1 = comm.Irecv([m1, 4, MPI.BYTE], source=0, tag=35)
    while not r1.Test():
        pass
    r2 = comm.Irecv([m2, 4, MPI.BYTE], source=0, tag=36)
    r2.Cancel()
    st = MPI.Status()
    r2.Wait(st)
    while not comm.Iprobe(source=0, tag=37):
        pass
    r3 = comm.Irecv([m3, 6, MPI.BYTE], source=0, tag=37)
    r3.Wait()
    show("tested", m1[:4] == PAT[:4], "cancelled", st.Is_cancelled(), "probed", m3[:6] == PAT[:6])
for name, m in (("tested", m1), ("cancelled", m2), ("probed", m3)):
    try:
        m.close()
        show(rank, name, "mmap closed")
    except BufferError as e:
        show(rank, name, "mmap not closed:", e)
