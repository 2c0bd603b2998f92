"""Small buffer collectives back to back: 300 rounds of Bcast, Gather, Scatter,
Allgather and Alltoall with the values changing every round and the size (odd ones
too) and roots every third, and IN_PLACE Allgather, Gather and Scatter on float64
arrays (so that each call repeats: distlaunch's plans of repeated calls run),
every result checked (the same `[buf, count, MPI.BYTE]` lists on `mmap` buffers
reused, as mpi4py's demos do, and fresh numpy arrays); then repeated calls on blocks
at displacements (`[buf, (count, displ), MPI.BYTE]`); then a reused list whose count
changes, and a bytearray that stays resizable after a Bcast; last, buffers used by
repeated calls are not kept by MPI: a numpy array is freed once the program drops it,
an mmap viewed by an array closes, an array resizes. Prints one line per rank."""

import gc
import mmap
import weakref

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()

# -- 300 mixed rounds (each size and root pair of the cycle recurs at least 8 times)
size = 64
sbuf, rbuf = mmap.mmap(-1, size * n), mmap.mmap(-1, size * n)
sview, rview = np.frombuffer(sbuf, np.uint8), np.frombuffer(rbuf, np.uint8)
SIZES = (1, 13, 8, size)  # bytes per block (an odd one too)
specs = {m: ([sbuf, m, MPI.BYTE], [rbuf, m, MPI.BYTE]) for m in SIZES}
full, part = np.zeros(5 * n), np.zeros(5)  # float64, reused: IN_PLACE calls repeat too
bad = []
for i in range(300):
    m = SIZES[(i // 3) % len(SIZES)]
    s_msg, r_msg = specs[m]
    root = (i // 3) % n

    def val(src, dst=0):
        return (np.arange(m) * 7 + i * 13 + src * 31 + dst * 5) % 251

    # Bcast from a moving root
    sview[:m] = val(root) if me == root else 0
    comm.Bcast(s_msg, root)
    if (sview[:m] != val(root)).any():
        bad.append(f"bcast {i}")
    # Gather to the next root
    g = (root + 1) % n
    sview[:m] = val(me)
    rview[:] = 0
    comm.Gather(s_msg, r_msg if me == g else [None, m, MPI.BYTE], g)
    if me == g and any((rview[j * m : (j + 1) * m] != val(j)).any() for j in range(n)):
        bad.append(f"gather {i}")
    # Scatter from another root
    sc = (root + 2) % n
    if me == sc:
        for j in range(n):
            sview[j * m : (j + 1) * m] = val(me, j)
    rview[:m] = 0
    comm.Scatter(s_msg if me == sc else None, r_msg, sc)
    if (rview[:m] != val(sc, me)).any():
        bad.append(f"scatter {i}")
    # Allgather and Alltoall
    sview[:m] = val(me)
    comm.Allgather(s_msg, r_msg)
    if any((rview[j * m : (j + 1) * m] != val(j)).any() for j in range(n)):
        bad.append(f"allgather {i}")
    for j in range(n):
        sview[j * m : (j + 1) * m] = val(me, j)
    comm.Alltoall(s_msg, r_msg)
    if any((rview[j * m : (j + 1) * m] != val(j, me)).any() for j in range(n)):
        bad.append(f"alltoall {i}")
    # IN_PLACE on float64 arrays (Allgather; the roots of Gather and Scatter)

    def fval(src, dst=0):
        return np.arange(5.0) + i * 3 + src * 100 + dst * 10

    full[:] = -1
    full[me * 5 : (me + 1) * 5] = fval(me)
    comm.Allgather(MPI.IN_PLACE, full)
    if any((full[j * 5 : (j + 1) * 5] != fval(j)).any() for j in range(n)):
        bad.append(f"allgather in place {i}")
    full[:] = -1
    part[:] = fval(me)
    if me == g:
        full[me * 5 : (me + 1) * 5] = fval(me)
        comm.Gather(MPI.IN_PLACE, full, g)
        if any((full[j * 5 : (j + 1) * 5] != fval(j)).any() for j in range(n)):
            bad.append(f"gather in place {i}")
    else:
        comm.Gather(part, None, g)
    if me == sc:
        for j in range(n):
            full[j * 5 : (j + 1) * 5] = fval(me, j)
        comm.Scatter(full, MPI.IN_PLACE, sc)
        if (full[me * 5 : (me + 1) * 5] != fval(me, me)).any():
            bad.append(f"scatter in place {i}")
    else:
        part[:] = -1
        comm.Scatter(None, part, sc)
        if (part != fval(sc, me)).any():
            bad.append(f"scatter in place {i}")
    # fresh numpy buffers every round
    a = np.full(3, i + me, np.float64)
    out = np.zeros(3 * n, np.float64)
    comm.Allgather(a, out)
    if out.tolist() != [float(i + j) for j in range(n) for _ in range(3)]:
        bad.append(f"numpy allgather {i}")
print(f"{me} rounds {'ok' if not bad else bad[:5]}")

# -- repeated calls on `[buf, (count, displ), MPI.BYTE]`: blocks away from the buffers'
# starts (the plans' copies place them), every result checked
m, bad = 5, []
ds, dr = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
for i in range(20):
    root = i % n

    def val(src, dst=0):
        return (np.arange(m) * 3 + i * 7 + src * 31 + dst * 5) % 251

    ds[:] = 0
    ds[3 : 3 + m] = val(root) if me == root else 0
    comm.Bcast([ds, (m, 3), MPI.BYTE], root)
    if (ds[3 : 3 + m] != val(root)).any() or ds[:3].any() or ds[3 + m :].any():
        bad.append(f"bcast {i}")
    ds[2 : 2 + m], dr[:] = val(me), 0
    comm.Gather([ds, (m, 2), MPI.BYTE], [dr, (m, 1), MPI.BYTE] if me == root else None, root)
    if me == root and any((dr[1 + j * m : 1 + (j + 1) * m] != val(j)).any() for j in range(n)):
        bad.append(f"gather {i}")
    for j in range(n):
        ds[1 + j * m : 1 + (j + 1) * m] = val(me, j)
    dr[:] = 0
    comm.Scatter([ds, (m, 1), MPI.BYTE] if me == root else None, [dr, (m, 7), MPI.BYTE], root)
    if (dr[7 : 7 + m] != val(root, me)).any() or dr[:7].any():
        bad.append(f"scatter {i}")
    ds[2 : 2 + m], dr[:] = val(me), 0
    comm.Allgather([ds, (m, 2), MPI.BYTE], [dr, (m, 2), MPI.BYTE])
    if any((dr[2 + j * m : 2 + (j + 1) * m] != val(j)).any() for j in range(n)):
        bad.append(f"allgather {i}")
    for j in range(n):
        ds[1 + j * m : 1 + (j + 1) * m] = val(me, j)
    dr[:] = 0
    comm.Alltoall([ds, (m, 1), MPI.BYTE], [dr, (m, 3), MPI.BYTE])
    if any((dr[3 + j * m : 3 + (j + 1) * m] != val(j, me)).any() for j in range(n)):
        bad.append(f"alltoall {i}")
print(f"{me} displaced {'ok' if not bad else bad[:5]}")

# -- the count of a reused list changes; a bytearray stays resizable
s_msg = [sbuf, 4, MPI.BYTE]
sview[:8] = np.arange(8) + 50 if me == 0 else 0
comm.Bcast(s_msg, 0)
first = sview[:8].tolist()
s_msg[1] = 8
comm.Bcast(s_msg, 0)
ba = bytearray(b"ab" if me == 0 else b"..")
comm.Bcast(ba, 0)
ba.extend(b"cd" if me == 0 else b"..")
comm.Bcast(ba, 0)
print(f"{me} reused {first} {sview[:8].tolist()} {ba.decode()}")
comm.Barrier()
del sview, rview  # our own views: the buffers were not kept by MPI, so they close
sbuf.close()
rbuf.close()

# -- repeated calls keep no buffer (nor an export of it) after they return (the last
# array of each kind is remembered by distlaunch's buffer parsing, datatypes._LAST:
# a call with another array, a size not seen before, replaces it)
arr = np.full(8, me, np.int64)
for _ in range(3):
    comm.Bcast(arr, 0)
comm.Bcast(np.zeros(1), 0)
gone = weakref.ref(arr)
del arr
gc.collect()
mm = mmap.mmap(-1, 64)
a = np.frombuffer(mm, np.uint8)
for _ in range(3):
    comm.Bcast(a, 0)
comm.Bcast(np.zeros(2), 0)
del a
try:
    mm.close()
    closed = "closed"
except BufferError as e:
    closed = f"BufferError {str(e).splitlines()[0]}"
grow = np.zeros(4)
for _ in range(3):
    comm.Bcast(grow, 0)
comm.Bcast(np.zeros(3), 0)
try:
    grow.resize(8)
    resized = "resized"
except ValueError as e:
    resized = f"ValueError {str(e).splitlines()[0]}"
print(f"{me} kept {'nothing' if gone() is None else 'the array'} {closed} {resized}")
