"""all_gather / all_gather_into_tensor / all_gather_object: every rank gets everyone's data.

distlaunch run --nproc-per-node 4 examples/all_gather.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()

mine = np.full(4, rank, np.float64)
parts = [np.empty(4) for _ in range(world)]
dist.all_gather(parts, mine)
assert all((p == i).all() for i, p in enumerate(parts))

flat = np.empty(4 * world)
dist.all_gather_into_tensor(flat, mine)
assert (flat.reshape(world, 4) == np.arange(world)[:, None]).all()

infos = [None] * world
dist.all_gather_object(infos, {"rank": rank, "pid_is_int": True})
assert [d["rank"] for d in infos] == list(range(world))
print(f"rank {rank}: all_gather ok")
dist.destroy_process_group()
