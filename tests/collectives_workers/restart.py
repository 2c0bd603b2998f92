"""Under `distlaunch run --max-restarts 1`: the first attempt does one all_reduce, then
rank 1 fails; the restarted group must initialise on fresh store keys and work."""
import os
import sys

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group(timeout=30)
rank, n = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
x = np.full(4, attempt + 1.0)
dist.all_reduce(x)
assert (x == n * (attempt + 1.0)).all(), x
dist.barrier()
if attempt == 0:
    dist.destroy_process_group()
    if rank == 1:
        sys.exit(3)
    import time
    time.sleep(30)  # stopped by the launcher
print(f"attempt {attempt} ok")
dist.destroy_process_group()
