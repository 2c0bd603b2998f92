"""Environment functions: init state, threads, versions, timers, processor name."""

import threading

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
print(rank, "initialized", MPI.Is_initialized(), MPI.Is_finalized(), flush=True)
print(rank, "thread", MPI.Query_thread() == MPI.THREAD_MULTIPLE, MPI.Is_thread_main(), flush=True)
out = []
t = threading.Thread(target=lambda: out.append(MPI.Is_thread_main()))
t.start()
t.join()
print(rank, "other thread main", out[0], flush=True)
v = MPI.Get_version()
print(
    rank,
    "version",
    isinstance(v, tuple) and v >= (3, 0),
    isinstance(MPI.Get_library_version(), str),
    flush=True,
)
name = MPI.Get_processor_name()
print(
    rank,
    "processor",
    len(comm.allgather(name)) == comm.size and isinstance(name, str) and bool(name),
    flush=True,
)
t0 = MPI.Wtime()
t1 = MPI.Wtime()
print(rank, "wtime", t1 >= t0, 0 < MPI.Wtick() < 0.01, flush=True)
print(rank, "constants", MPI.SUCCESS, MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.PROC_NULL, MPI.UNDEFINED, flush=True)
comm.Barrier()
MPI.Finalize()
print(rank, "finalized", MPI.Is_finalized(), flush=True)
