"""reduce: the element-wise SUM / MAX of every rank's array ends up on rank 0 only.

distlaunch run --nproc-per-node 4 examples/reduce.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()

x = np.arange(5, dtype=np.int64) * (rank + 1)
original = x.copy()
dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
if rank == 0:
    assert (x == np.arange(5) * world * (world + 1) // 2).all(), x
    print("rank 0 sum:", x)
else:
    assert (x == original).all()  # non-destination ranks keep their input

m = np.array([rank, -rank], np.float32)
dist.reduce(m, dst=world - 1, op=dist.ReduceOp.MAX)
if rank == world - 1:
    assert m.tolist() == [world - 1, 0], m
    print(f"rank {rank} max:", m)
dist.destroy_process_group()
