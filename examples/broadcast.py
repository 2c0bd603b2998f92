"""broadcast: rank 0's array is copied into every rank's array (in place).

distlaunch run --nproc-per-node 4 examples/broadcast.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank = dist.get_rank()

weights = np.arange(10, dtype=np.float32) if rank == 0 else np.zeros(10, np.float32)
dist.broadcast(weights, src=0)
assert (weights == np.arange(10)).all(), weights

# also from the last rank, for a large array (pipelined chain algorithm)
last = dist.get_world_size() - 1
big = np.full(1 << 20, float(rank))
dist.broadcast(big, src=last)
assert (big == last).all()
print(f"rank {rank}: broadcast ok {weights[:4]}")
dist.destroy_process_group()
