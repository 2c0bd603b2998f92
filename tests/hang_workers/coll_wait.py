"""Ranks of distlaunch's runtime: every rank but the last calls all_reduce; the last
sleeps, so the others wait in it (their operation in flight is the runtime's own mark)."""

import time

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group(timeout=600)
rank, n = dist.get_rank(), dist.get_world_size()
print(f"rank {rank} up", flush=True)
if rank == n - 1:
    time.sleep(600)
dist.all_reduce(np.ones(4, np.float32))
