"""scatter: rank 0 hands out one row of a matrix to each rank.

distlaunch run --nproc-per-node 4 examples/scatter.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()

row = np.empty(3, np.int64)
rows = [np.full(3, 10 * i, np.int64) for i in range(world)] if rank == 0 else None
dist.scatter(row, rows, src=0)
assert (row == 10 * rank).all(), row
print(f"rank {rank}: got row {row}")
dist.destroy_process_group()
