"""The floor of a shared-memory ping-pong written in Python: two processes, one mmap,
a flag byte each, the payload copied in and out, nothing else (no tags, matching,
ordering, checks or wake-ups). Any Python MPI layer pays at least this per message;
compare it with osu_latency's MPICH figure (benchmarks/bench_p2p.py) to see how much
room a ratio target leaves. Usage: python benchmarks/bench_floor.py [bytes ...]"""

import mmap
import os
import sys
import time

ITERS = 200_000


def one_way(n: int) -> float:
    """Seconds one way for ``n`` bytes, mean over ITERS round trips (2 processes)."""
    m = mmap.mmap(-1, 4096 + 128)
    mv = memoryview(m)
    buf = bytearray(n)
    pid = os.fork()
    me = 0 if pid else 1
    mine, peer = 64 * me, 64 * (1 - me)

    def run(k: int, seq: int) -> int:
        for _ in range(k):
            seq = (seq + 1) & 255
            if me == 0:
                mv[256 : 256 + n] = buf
                m[peer] = seq
                while m[mine] != seq:
                    pass
            else:
                while m[mine] != seq:
                    pass
                buf[:] = mv[256 : 256 + n]
                m[peer] = seq
        return seq

    seq = run(1000, 0)
    t = time.perf_counter()
    run(ITERS, seq)
    dt = time.perf_counter() - t
    if me == 1:
        os._exit(0)
    os.waitpid(pid, 0)
    return dt / ITERS / 2


if __name__ == "__main__":
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for n in map(int, sys.argv[1:] or ["1", "1024"]):
        print(f"{n:6d} B  one way {one_way(n) * 1e6:.2f} us")
