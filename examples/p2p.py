"""Point-to-point: pass a token around the ring with blocking send/recv, then exchange
arrays with both neighbours at once using isend/irecv.

    distlaunch run --nproc-per-node 4 examples/p2p.py
"""

import numpy as np

import distlaunch.collectives as dist

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
right, left = (rank + 1) % world, (rank - 1) % world

# 1. a token travels 0 -> 1 -> ... -> 0, every rank adds its rank
token = np.zeros(1, np.int64)
if world > 1:
    if rank == 0:
        dist.send(token, dst=right)
        src = dist.recv(token, src=left)
    else:
        src = dist.recv(token, src=left)
        token += rank
        dist.send(token, dst=right)
    if rank == 0:
        assert src == left and token[0] == sum(range(world)), token
        print(f"token came back from rank {src} with {token[0]}")

# 2. non-blocking exchange with both neighbours (no deadlock: all four are in flight)
mine = np.full(1 << 16, rank, np.float32)
from_left, from_right = np.empty_like(mine), np.empty_like(mine)
if world > 1:
    works = [
        dist.irecv(from_left, src=left, tag=1),
        dist.irecv(from_right, src=right, tag=2),
        dist.isend(mine, dst=right, tag=1),
        dist.isend(mine, dst=left, tag=2),
    ]
    for w in works:
        w.wait()
    assert (from_left == left).all() and (from_right == right).all()
print(f"rank {rank}: p2p ok")
dist.destroy_process_group()
