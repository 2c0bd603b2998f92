"""Point-to-point under stress: sizes around the eager/ring boundaries, ANY_SOURCE and
ANY_TAG with Status, the non-overtaking order per (source, tag), many outstanding
Isends, and Sendrecv around a ring. Every rank prints checksums of what it received."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
right, left = (rank + 1) % size, (rank - 1) % size
SIZES = [0, 1, 63, 64, 65, 4031, 4032, 4033, 4096, 4097, 65535, 65536, 65537, (1 << 20) + 3, 3 << 20]


def payload(src, n, k=0):
    return ((np.arange(n, dtype=np.int64) * 31 + src * 7 + k) % 251).astype(np.uint8)


# 1. every size to the right neighbour, received from the left
for n in SIZES:
    r = np.empty(n, np.uint8)
    comm.Sendrecv([payload(rank, n), n, MPI.BYTE], right, 3, [r, n, MPI.BYTE], left, 3)
    print(rank, "size", n, "ok" if (r == payload(left, n)).all() else "BAD", flush=True)

# 2. ANY_SOURCE / ANY_TAG: rank 0 collects one message from every other rank
comm.Barrier()
if rank == 0:
    got = []
    for _ in range(size - 1):
        st = MPI.Status()
        buf = np.empty(5000, np.uint8)
        comm.Recv([buf, MPI.BYTE], MPI.ANY_SOURCE, MPI.ANY_TAG, st)
        n = st.Get_count(MPI.BYTE)
        got.append((st.Get_source(), st.Get_tag(), n, bool((buf[:n] == payload(st.Get_source(), n)).all())))
    for item in sorted(got):
        print("any", item, flush=True)
else:
    n = 1000 * rank
    comm.Send([payload(rank, n), n, MPI.BYTE], 0, 10 + rank)

# 3. order per (source, tag): 3 tags interleaved, received tag by tag (non-overtaking)
comm.Barrier()
tags, count = (5, 6, 7), 40
if rank == 1 % size:
    reqs = []
    for k in range(count):
        for t in tags:
            n = 70000 if k % 13 == 0 else 8
            reqs.append(comm.Isend(payload(k, n, t), 0, t))
    MPI.Request.Waitall(reqs)
if rank == 0:
    for t in reversed(tags):
        seen = []
        for k in range(count):
            n = 70000 if k % 13 == 0 else 8
            buf = np.empty(n, np.uint8)
            comm.Recv(buf, 1 % size, t)
            seen.append(bool((buf == payload(k, n, t)).all()))
        print("order tag", t, all(seen), flush=True)

# 4. many outstanding Isends of mixed sizes, received with Irecv + Waitall
comm.Barrier()
m = 200
outs = [payload(rank, 1 + (k * 977) % 9000, k) for k in range(m)]
ins = [np.empty(1 + (k * 977) % 9000, np.uint8) for k in range(m)]
reqs = [comm.Irecv(ins[k], left, k) for k in range(m)] + [comm.Isend(outs[k], right, k) for k in range(m)]
MPI.Request.Waitall(reqs)
print(rank, "outstanding", all((ins[k] == payload(left, len(ins[k]), k)).all() for k in range(m)), flush=True)

# 5. Python objects both ways at once
obj = comm.sendrecv({"from": rank, "blob": bytes(100000)}, dest=right, source=left)
print(rank, "object from", obj["from"], len(obj["blob"]), flush=True)
