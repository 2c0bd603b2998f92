"""distlaunch only: the last call on a communicator is a small Bcast whose root the
ranks disagree on (each is its own root: nobody reads, so the call itself cannot tell),
then the communicator is freed (Dup, then Split) and, last, the same on COMM_WORLD then
Finalize: every rank must get CollectiveMismatchError (from Free / Finalize), naming
both calls. Prints one line per rank and case."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me = comm.Get_rank()


def last_call(c, how, end):
    c.Bcast(np.zeros(2, np.uint8), 0)  # an agreed first call
    where = "call"
    try:
        c.Bcast(np.zeros(2, np.uint8), me % 2)
        where = end
        c.Free() if end == "Free" else MPI.Finalize()
        print(f"{me} {how}: no error", flush=True)
    except Exception as e:
        print(f"{me} {how}: {type(e).__name__} in {where}: {e}", flush=True)


last_call(comm.Dup(), "dup", "Free")
last_call(comm.Split(0, me), "split", "Free")
last_call(comm, "world", "Finalize")
