"""A distlaunch.collectives send/recv ping-pong for SECONDS, silent after one line (which
ends the start-up grace of --hang-timeout): its receives are its only progress."""

import sys
import time

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank = dist.get_rank()
peer = 1 - rank
buf = np.zeros(1, np.int64)
print(f"rank {rank} up", flush=True)
end = time.monotonic() + float(sys.argv[1])
while True:
    if rank == 0:
        buf[0] = time.monotonic() > end
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)
    if buf[0]:
        break
    time.sleep(0.01)
