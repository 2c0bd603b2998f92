"""gather: every rank sends a small array to rank 0, which receives them in rank order.

distlaunch run --nproc-per-node 4 examples/gather.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()

mine = np.array([rank, rank**2], np.int32)
out = [np.empty(2, np.int32) for _ in range(world)] if rank == 0 else None
dist.gather(mine, out, dst=0)
if rank == 0:
    for i, a in enumerate(out):
        assert a.tolist() == [i, i * i], (i, a)
    print("rank 0 gathered", [a.tolist() for a in out])
dist.destroy_process_group()
