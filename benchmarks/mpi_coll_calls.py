"""The worker of bench_mpi_calls.py: ``calls`` repetitions of one mpi4py buffer
collective on the same buffers (a planned call after the first), driven by
``operator.countOf(itertools.starmap(...), 1)`` in ``chunks`` runs, so that callgrind's
``--toggle-collect=_operator_countOf`` counts them alone (``--dump-after=_operator_countOf``: one
count per run), each call followed by a ``time.sleep`` of PAUSE_US microseconds (set on the
measured rank only; ``--toggle-collect=time_sleep`` leaves it out) so that the other
rank is ahead at the next one: the call then does not wait; or, with ``profile``, under
cProfile on rank ``PROFILE_RANK`` (its top functions by own time printed). Buffers:
``mmap`` as ``[buf, count, MPI.BYTE]`` (mpi4py's OSU demos; the scatter root receives
IN_PLACE, as there) or numpy uint8 arrays passed bare.
Usage: mpi_coll_calls.py op mmap|numpy bytes calls chunks [profile]"""

import cProfile
import io
import itertools
import mmap
import operator
import os
import pstats
import sys
import time

import numpy as np

from distlaunch import mpi as MPI


def _specs(op: str, kind: str, size: int, me: int, n: int) -> tuple:
    """(send, receive) buffer specifications of ``op`` on this rank."""
    if kind == "mmap":
        sbuf, rbuf = mmap.mmap(-1, size * n), mmap.mmap(-1, size * n)
        s, r = [sbuf, size, MPI.BYTE], [rbuf, size, MPI.BYTE]
        if op == "scatter":
            return (s, MPI.IN_PLACE) if me == 0 else (None, r)
        if op == "gather" and me != 0:
            return s, [None, size, MPI.BYTE]
        return s, r
    one, all_ = np.arange(size, dtype=np.uint8), np.zeros(size * n, dtype=np.uint8)
    if op == "scatter":
        return (np.arange(size * n, dtype=np.uint8), one) if me == 0 else (None, one)
    if op == "gather":
        return one, (all_ if me == 0 else None)
    if op == "alltoall":
        return np.arange(size * n, dtype=np.uint8), all_
    return one, all_


def main(op: str, kind: str, size: int, calls: int, chunks: int, profile: bool = False) -> None:
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    s, r = _specs(op, kind, size, me, n)
    call = {
        "bcast": lambda: comm.Bcast(s, 0),
        "allgather": lambda: comm.Allgather(s, r),
        "gather": lambda: comm.Gather(s, r, 0),
        "scatter": lambda: comm.Scatter(s, r, 0),
        "alltoall": lambda: comm.Alltoall(s, r),
        "none": lambda: None,  # (the loop's own cost)
    }[op]
    sleep, pause = time.sleep, int(os.environ.get("PAUSE_US", "0")) * 1e-6

    def step() -> None:
        call()
        sleep(pause)

    for _ in range(3):  # every rank maps the channel: the plan sees their pids (waits)
        comm.Allgather(np.zeros(1, np.uint8), np.zeros(n, np.uint8))
    comm.Barrier()
    for _ in range(50):  # the plan is made, every code path warm
        step()
    comm.Barrier()
    prof = cProfile.Profile() if profile and me == int(os.environ.get("PROFILE_RANK", "0")) else None
    if prof is not None:
        prof.enable()
    for _ in range(chunks):  # (each call returns None: none is counted)
        operator.countOf(itertools.starmap(step if pause else call, itertools.repeat((), calls)), 1)
    if prof is not None:
        prof.disable()
    comm.Barrier()
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(int, sys.argv[3:6]), len(sys.argv) > 6)  # type: ignore[call-arg]
