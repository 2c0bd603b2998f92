"""A rank whose worker thread fails: the thread raises, then the main thread dies with
it (it needed the thread's result) while rank 0 waits for a message the thread should
have sent. Usage: thread_failure.py [dies|survives]: with "survives" the main thread
only reports the failure and exits normally (Python's exit code stays 0)."""

import sys
import threading

from mpi4py import MPI

comm = MPI.COMM_WORLD
mode = sys.argv[1] if len(sys.argv) > 1 else "dies"
result = {}


def work():
    if comm.rank == 1:
        raise RuntimeError("worker thread failed")
    result["value"] = comm.rank


t = threading.Thread(target=work)
t.start()
t.join()
if comm.rank == 0:
    if mode == "dies":
        print("rank 0 waits for rank 1", flush=True)
        comm.recv(source=1, tag=7)
    print("rank 0 done", flush=True)
elif mode == "dies":
    comm.send(result["value"], dest=0, tag=7)  # KeyError: the main thread dies too
else:
    print("rank 1 thread failed:", "value" not in result, flush=True)
