"""Under `distlaunch run --max-restarts 1`: the first attempt does one all_reduce, then
rank 1 fails; the restarted group must initialise on fresh store keys and work.
destroy_process_group must unmap the group's shared-memory segment at once."""

import os
import sys

import numpy as np

import distlaunch.collectives as dist


def mapped_segments():
    prefix = "/dev/shm/" + os.environ["DISTLAUNCH_SHM_PREFIX"]
    with open("/proc/self/maps") as f:
        return [line for line in f if prefix in line]


dist.init_process_group(timeout=30)
rank, n = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.barrier()
for _ in range(2):  # the second call takes the cached small-call path (the last call
    # before destroy: its cached plan holds views of the segment)
    x = np.full(4, attempt + 1.0)
    dist.all_reduce(x)
    assert (x == n * (attempt + 1.0)).all(), x
assert mapped_segments(), "the small all_reduce ran on shared memory"
if attempt == 0:
    dist.destroy_process_group()
    if rank == 1:
        sys.exit(3)
    import time

    time.sleep(30)  # stopped by the launcher
dist.destroy_process_group()
assert not mapped_segments(), mapped_segments()
print(f"attempt {attempt} ok")
