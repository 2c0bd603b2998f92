"""Buffer collectives on every buffer type mpi4py accepts (bytearray, a memoryview
slice, mmap, array.array, numpy, a torch CPU tensor when torch is installed), as
``[buf, count, MPI.BYTE]`` with the buffers larger than the count (the count must be
honoured), at sizes across the shared-memory slot given as argv[1] (bytes); every
result is checked against numpy's. argv[2] ``--no-torch``: leave torch tensors out
(importing torch costs each rank seconds of CPU). Prints one line per rank: the number
of checks.
With COLL_EXPECT_NO_TCP=1 (one node, shared memory on), a rank that opened a TCP
connection during the collectives fails: they must all run over shared memory."""

import array
import mmap
import os
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()
slot = int(sys.argv[1]) if len(sys.argv) > 1 else 4 << 20
SIZES = sorted({0, 1, 7, slot // n - 1, slot // n + 3, slot + 5, 2 * slot + 1})
PAD = 3  # every buffer is this many bytes longer than what the call uses


def make(kind, nbytes):
    """A zeroed buffer of ``kind`` holding at least nbytes + PAD bytes, and a writable
    numpy view of all its bytes (to fill and to check)."""
    size = nbytes + PAD
    if kind == "bytearray":
        b = bytearray(size)
    elif kind == "memoryview":
        b = memoryview(bytearray(size + 5))[5:]
    elif kind == "mmap":
        b = mmap.mmap(-1, max(size, 1))
    elif kind == "array":
        b = array.array("B", bytes(size))
    elif kind == "numpy":
        b = np.zeros(size, np.uint8)
    else:
        import torch

        b = torch.zeros(size, dtype=torch.uint8)
        return b, b.numpy()
    return b, np.frombuffer(b, np.uint8)


def data(rank, nbytes, salt):
    return ((np.arange(nbytes, dtype=np.int64) * 7 + rank * 31 + salt) % 251).astype(np.uint8)


checks = 0


def tcp_connections():
    import psutil

    return len([c for c in psutil.Process().net_connections("tcp") if c.raddr])


comm.Barrier()
before = tcp_connections()


def check(what, got, want):
    global checks
    checks += 1
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0]) if got.shape == want.shape else -1
        raise SystemExit(f"rank {me}: {what}: wrong bytes (first at {bad})")


kinds = ["bytearray", "memoryview", "mmap", "array", "numpy"]
try:
    if "--no-torch" not in sys.argv[2:]:
        import torch  # noqa: F401

        kinds.append("torch")
except ImportError:
    pass

for kind in kinds:
    for m in SIZES:
        tag = f"{kind} {m} B"
        root = m % n
        # Bcast
        b, v = make(kind, m)
        if me == root:
            v[:m] = data(root, m, 1)
        comm.Bcast([b, m, MPI.BYTE], root=root)
        check(f"Bcast {tag}", v[:m], data(root, m, 1))
        check(f"Bcast {tag} pad", v[m:], np.zeros(PAD, np.uint8))
        # Gather / Allgather
        s, sv = make(kind, m)
        sv[:m] = data(me, m, 2)
        r, rv = make(kind, m * n)
        comm.Gather([s, m, MPI.BYTE], [r, m, MPI.BYTE] if me == root else None, root=root)
        if me == root:
            check(f"Gather {tag}", rv[: m * n], np.concatenate([data(i, m, 2) for i in range(n)]))
            check(f"Gather {tag} pad", rv[m * n :], np.zeros(PAD, np.uint8))
        r, rv = make(kind, m * n)
        comm.Allgather([s, m, MPI.BYTE], [r, m, MPI.BYTE])
        check(f"Allgather {tag}", rv[: m * n], np.concatenate([data(i, m, 2) for i in range(n)]))
        check(f"Allgather {tag} pad", rv[m * n :], np.zeros(PAD, np.uint8))
        # Scatter (the root also with IN_PLACE)
        s, sv = make(kind, m * n)
        sv[: m * n] = data(root, m * n, 3)
        for in_place in (False, True):
            r, rv = make(kind, m)
            if me == root and in_place:
                comm.Scatter([s, m, MPI.BYTE], MPI.IN_PLACE, root=root)
                check(f"Scatter in place {tag}", sv[: m * n], data(root, m * n, 3))
                continue
            comm.Scatter([s, m, MPI.BYTE] if me == root else None, [r, m, MPI.BYTE], root=root)
            check(f"Scatter {tag}", rv[:m], data(root, m * n, 3)[me * m : (me + 1) * m])
            check(f"Scatter {tag} pad", rv[m:], np.zeros(PAD, np.uint8))
        # Alltoall
        s, sv = make(kind, m * n)
        sv[: m * n] = data(me, m * n, 4)
        r, rv = make(kind, m * n)
        comm.Alltoall([s, m, MPI.BYTE], [r, m, MPI.BYTE])
        want = np.concatenate([data(i, m * n, 4)[me * m : (me + 1) * m] for i in range(n)])
        check(f"Alltoall {tag}", rv[: m * n], want)
        check(f"Alltoall {tag} pad", rv[m * n :], np.zeros(PAD, np.uint8))
        # v-variants: rank i's block holds m + i bytes
        counts = [m + i for i in range(n)]
        displs = [sum(counts[:i]) for i in range(n)]
        total = sum(counts)
        s, sv = make(kind, counts[me])
        sv[: counts[me]] = data(me, counts[me], 5)
        r, rv = make(kind, total)
        comm.Gatherv([s, counts[me], MPI.BYTE], [r, (counts, displs), MPI.BYTE] if me == root else None, root)
        every = np.concatenate([data(i, counts[i], 5) for i in range(n)])
        if me == root:
            check(f"Gatherv {tag}", rv[:total], every)
        r, rv = make(kind, total)
        comm.Allgatherv([s, counts[me], MPI.BYTE], [r, (counts, displs), MPI.BYTE])
        check(f"Allgatherv {tag}", rv[:total], every)
        s, sv = make(kind, total)
        sv[:total] = data(root, total, 6)
        r, rv = make(kind, counts[me])
        sendspec = [s, (counts, displs), MPI.BYTE] if me == root else None
        comm.Scatterv(sendspec, [r, counts[me], MPI.BYTE], root)
        check(f"Scatterv {tag}", rv[: counts[me]], data(root, total, 6)[displs[me] : displs[me] + counts[me]])
        # Alltoallv: rank i sends m + i + j bytes to rank j
        sc = [m + me + j for j in range(n)]
        rc = [m + i + me for i in range(n)]
        sd = [sum(sc[:j]) for j in range(n)]
        rd = [sum(rc[:i]) for i in range(n)]
        s, sv = make(kind, sum(sc))
        sv[: sum(sc)] = data(me, sum(sc), 7)
        r, rv = make(kind, sum(rc))
        comm.Alltoallv([s, (sc, sd), MPI.BYTE], [r, (rc, rd), MPI.BYTE])
        for i in range(n):
            i_sd = sum(m + i + j for j in range(me))
            want = data(i, sum(m + i + j for j in range(n)), 7)[i_sd : i_sd + rc[i]]
            check(f"Alltoallv {tag} from {i}", rv[rd[i] : rd[i] + rc[i]], want)
        comm.Barrier()
opened = tcp_connections() - before
if os.environ.get("COLL_EXPECT_NO_TCP") and opened:
    raise SystemExit(f"rank {me}: the collectives opened {opened} TCP connection(s); expected shared memory")
print(f"rank {me}: {checks} checks passed", flush=True)
