"""A worker started by srun or mpiexec, not by distlaunch: init_process_group() with no
arguments, then an all_reduce and a broadcast; prints one JSON line with what it saw
(the test recomputes the expected values)."""

import json
import os

import numpy as np

import distlaunch.collectives as dist
from distlaunch.collectives.runtime import current_runtime

dist.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
x = np.arange(1000, dtype=np.float64) * (rank + 1)
dist.all_reduce(x)
b = np.full(8, rank * 10 + 3, dtype=np.int64)
dist.broadcast(b, src=size - 1)
rt = current_runtime()
line = (
    json.dumps(
        {
            "rank": rank,
            "size": size,
            "sum": x.tolist()[:5] + [float(x.sum())],
            "bcast": b.tolist(),
            "node": os.environ.get("SLURMD_NODENAME") or os.environ.get("PMI_HOSTNAME"),
            "node_keys": rt.node_ids(),
            "token_env": "DISTLAUNCH_STORE_TOKEN" in os.environ,
        }
    )
    + "\n"
)
os.write(1, line.encode())  # one write: lines of several ranks on one pipe stay whole
dist.destroy_process_group()
