"""Blocking Send/Recv in the shapes programs use (the fast path of distlaunch.mpi):
typed buffer specifications, sizes that wrap a small ring, ANY_TAG with Status, a
message with another tag queued ahead of the wanted one (non-overtaking per tag), a
receive buffer larger than the message, a probed message received afterwards, a
ping-pong reusing the same buffers, and two threads receiving from one peer at once.
Ranks pair up (0-1, 2-3, ...); every rank prints what it received."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
peer = rank ^ 1 if rank ^ 1 < size else MPI.PROC_NULL
first = rank % 2 == 0


def fill(n, k):
    return ((np.arange(n, dtype=np.int64) * 13 + k) % 251).astype(np.uint8)


def show(*what):
    print(rank, *what, flush=True)


if peer != MPI.PROC_NULL:
    # 1. sizes around the record size (64) and the size of a small ring (4096)
    for n in (0, 1, 48, 63, 64, 65, 100, 1000, 2000, 3000, 4000, 5000, 70000):
        buf = np.empty(n, np.uint8)
        for turn in (0, 1):
            if first == (turn == 0):
                comm.Send([fill(n, turn), n, MPI.BYTE], dest=peer, tag=n % 7)
            else:
                st = MPI.Status()
                comm.Recv([buf, n, MPI.BYTE], source=peer, tag=MPI.ANY_TAG, status=st)
                ok = bool((buf == fill(n, turn)).all())
                show("size", n, turn, ok, st.Get_source(), st.Get_tag(), st.Get_count(MPI.BYTE))
    # 2. typed specifications: [buf, datatype], [buf, count, datatype], bare arrays
    d = np.arange(10, dtype="d") + rank
    i = np.arange(6, dtype="i") * (rank + 1)
    f = np.linspace(0, 1, 5, dtype="f") + rank
    rd, ri, rf = np.zeros(10), np.zeros(6, "i"), np.zeros(5, "f")
    if first:
        comm.Send([d, MPI.DOUBLE], dest=peer, tag=1)
        comm.Send([i, 4, MPI.INT], dest=peer, tag=2)
        comm.Send(f, dest=peer, tag=3)
    else:
        comm.Recv([rd, MPI.DOUBLE], source=peer, tag=1)
        st = MPI.Status()
        comm.Recv([ri, 6, MPI.INT], source=peer, tag=2, status=st)
        comm.Recv(rf, source=peer, tag=3)
        show("typed", rd.tolist(), ri.tolist(), st.Get_count(MPI.INT), rf.tolist())
    # 3. another tag queued ahead: received after the wanted one
    if first:
        comm.Send([fill(200, 5), MPI.BYTE], dest=peer, tag=21)
        comm.Send([fill(300, 6), MPI.BYTE], dest=peer, tag=22)
    else:
        b22, b21 = np.empty(300, np.uint8), np.empty(200, np.uint8)
        comm.Recv(b22, source=peer, tag=22)
        comm.Recv(b21, source=peer, tag=21)
        show("ahead", bool((b22 == fill(300, 6)).all()), bool((b21 == fill(200, 5)).all()))
    # 4. probed first, then received
    if not first:
        comm.Send([fill(40, 9), MPI.BYTE], dest=peer, tag=30)
    else:
        st = MPI.Status()
        comm.Probe(source=peer, tag=MPI.ANY_TAG, status=st)
        buf = np.empty(st.Get_count(MPI.BYTE), np.uint8)
        comm.Recv(buf, source=peer, tag=st.Get_tag())
        show("probed", st.Get_tag(), len(buf), bool((buf == fill(40, 9)).all()))
    # 5. ping-pong with the same buffers, the payload changing in place
    s, r = np.zeros(16, np.uint8), np.zeros(16, np.uint8)
    total = 0
    for k in range(300):
        if first:
            s[:] = k % 256
            comm.Send([s, 16, MPI.BYTE], dest=peer, tag=40)
            comm.Recv([r, 16, MPI.BYTE], source=peer, tag=40)
        else:
            comm.Recv([r, 16, MPI.BYTE], source=peer, tag=40)
            s[:] = r + 1
            comm.Send([s, 16, MPI.BYTE], dest=peer, tag=40)
        total += int(r.sum())
    show("pingpong", total)
    # 6. two threads receiving from the same peer at once, by tag (MPI_THREAD_MULTIPLE)
    if first:
        for k in range(50):
            comm.Send([fill(10 + k, k), MPI.BYTE], dest=peer, tag=51)
            comm.Send([fill(20 + k, k), MPI.BYTE], dest=peer, tag=50)
    else:
        import threading

        sums = {}

        def take(tag, base):
            got = []
            for k in range(50):
                buf = np.empty(base + k, np.uint8)
                comm.Recv(buf, source=peer, tag=tag)
                got.append(bool((buf == fill(base + k, k)).all()))
            sums[tag] = all(got)

        threads = [threading.Thread(target=take, args=(50, 20)), threading.Thread(target=take, args=(51, 10))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        show("threads", sorted(sums.items()))
comm.Barrier()
show("done")
