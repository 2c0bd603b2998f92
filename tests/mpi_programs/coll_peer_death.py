"""A rank dies in the middle of repeated small collectives (the facade's planned path,
on shared memory): every call of the survivor after that raises (PeerLostError)
within seconds instead of hanging, whether it waits for the dead rank's data (a
reader) or for it to have read the previous call (a broadcast root). Usage:
coll_peer_death.py op dying_rank; prints one line on the survivor. With op "roots"
nobody dies: after planned Bcasts from root 0, each rank calls Bcast as its own root
(nobody reads anybody's): both ranks' next calls raise CollectiveMismatchError."""

import mmap
import os
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
me = comm.Get_rank()
op, dying = sys.argv[1], int(sys.argv[2])
sbuf, rbuf = mmap.mmap(-1, 64), mmap.mmap(-1, 64)
s, r = [sbuf, 8, MPI.BYTE], [rbuf, 8, MPI.BYTE]
call = {
    "roots": None,
    "bcast": lambda: comm.Bcast(s, 0),
    "gather": lambda: comm.Gather(s, r if me == 0 else [None, 8, MPI.BYTE], 0),
    "scatter": lambda: comm.Scatter(s if me == 0 else None, r, 0),
    "allgather": lambda: comm.Allgather(s, r),
    "alltoall": lambda: comm.Alltoall(s, r),
}[op] or (lambda: None)
for _ in range(200):  # (the plan is made by the first call: these run it)
    call() if op != "roots" else comm.Bcast(s, 0)
if op == "roots":
    errors = []
    for root in (me, 0, 0):
        try:
            comm.Bcast(s, root)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    print(f"{me} roots: {errors}", flush=True)
    sys.exit(0)
if me == dying:
    sys.stdout.flush()
    os._exit(0)
t0 = time.monotonic()
errors = []
while len(errors) < 2 and time.monotonic() - t0 < 30:
    try:
        call()
    except Exception as e:
        errors.append(type(e).__name__)
print(f"{me} {op} after the death of rank {dying}: {errors} in {time.monotonic() - t0:.0f} s", flush=True)
