"""Target for multiprocessing-started ranks (no launcher, no environment variables)."""

import numpy as np

import distlaunch.collectives as dist


def run(rank, world, init_method, queue):
    try:
        dist.init_process_group(init_method=init_method, rank=rank, world_size=world, timeout=30)
        x = np.full(3, rank + 1.0)
        dist.all_reduce(x)
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank})
        dist.destroy_process_group()
        queue.put((rank, x.tolist(), [o["rank"] for o in objs]))
    except BaseException as e:  # report instead of dying silently
        queue.put((rank, repr(e), None))
