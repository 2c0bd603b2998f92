"""OSU-style ping-pong latency per buffer type (2 ranks): for each type, each size, the
message is passed as mpi4py's ``[buf, count, MPI.BYTE]`` spec over a buffer of the
largest size (as mpi4py's demo/osu_latency.py does with ``mmap``), except ``memoryview``
(a slice ``memoryview(mmap)[:size]`` of that buffer) and ``bytes`` (a ``bytes`` object
of the size sent, received into a bytearray). Prints ``type size latency_us`` on rank 0
and checks the received bytes.
Usage: osu_latency_types.py [types] [sizes] [iterations]
(types comma-separated: numpy,bytearray,bytes,memoryview,mmap,array,torch)"""

import array
import mmap
import sys

import numpy as np
from mpi4py import MPI

TYPES = "numpy,bytearray,bytes,memoryview,mmap,array,torch"


def buffers(kind, n):
    """(send buffer maker, receive buffer maker): each takes the size, returns a spec."""
    if kind == "numpy":
        s, r = np.full(n, 97, np.uint8), np.zeros(n, np.uint8)
    elif kind in ("bytearray", "bytes"):
        s, r = bytearray(b"a" * n), bytearray(n)
    elif kind in ("mmap", "memoryview"):
        s, r = mmap.mmap(-1, max(n, 1)), mmap.mmap(-1, max(n, 1))
        s.write(b"a" * n)
    elif kind == "array":
        s, r = array.array("B", b"a" * n), array.array("B", bytes(n))
    elif kind == "torch":
        import torch

        s, r = torch.full((n,), 97, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    else:
        raise SystemExit(f"unknown buffer type {kind!r} (one of {TYPES})")
    if kind == "bytes":
        return (lambda size: bytes(s[:size])), (lambda size: [r, size, MPI.BYTE]), r
    if kind == "memoryview":
        sv, rv = memoryview(s), memoryview(r)
        return (lambda size: sv[:size]), (lambda size: rv[:size]), r
    return (lambda size: [s, size, MPI.BYTE]), (lambda size: [r, size, MPI.BYTE]), r


def main(types=TYPES, sizes="0,8,1024,65536", iters=2000, skip=200):
    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    sizes = [int(x) for x in sizes.split(",")]
    for kind in types.split(","):
        make_s, make_r, rbuf = buffers(kind, max(sizes))
        for size in sizes:
            s_msg, r_msg = make_s(size), make_r(size)
            loops = iters if size <= 8192 else max(10, iters // 10)
            comm.Barrier()
            for i in range(loops + skip):
                if i == skip:
                    t0 = MPI.Wtime()
                if me == 0:
                    comm.Send(s_msg, 1, 1)
                    comm.Recv(r_msg, 1, 1)
                else:
                    comm.Recv(r_msg, 0, 1)
                    comm.Send(s_msg, 0, 1)
            t1 = MPI.Wtime()
            if bytes(memoryview(rbuf.numpy() if kind == "torch" else rbuf).cast("B")[:size]) != b"a" * size:
                raise SystemExit(f"rank {me}: {kind} {size} B: wrong bytes received")
            if me == 0:
                print(f"{kind} {size} {(t1 - t0) * 1e6 / (2 * loops):.2f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2], *sys.argv[2:3], *map(int, sys.argv[3:4]))
