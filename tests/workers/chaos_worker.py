"""The chaos suite's worker: all-reduces for about ``seconds`` with a short collective
timeout, so a stopped or dead peer turns into an error (and a restart), not a hang."""

import os
import sys
import time

import numpy as np

import distlaunch.collectives as dist

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 2.5
dist.init_process_group(timeout=3.0)
rank, world = dist.get_rank(), dist.get_world_size()
end = time.monotonic() + seconds
steps = 0
while True:
    x = np.full(1024, rank + 1, dtype=np.float32)
    dist.all_reduce(x)
    assert x[0] == world * (world + 1) / 2
    steps += 1
    done = np.array([time.monotonic() >= end], dtype=np.int32)
    dist.all_reduce(done, op=dist.ReduceOp.MAX)  # everyone stops at the same step
    if done[0]:
        break
    time.sleep(0.02)
dist.destroy_process_group()
print(f"rank {rank} done after {steps} steps, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
