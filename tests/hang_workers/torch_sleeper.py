"""Rank SLOW_RANK sleeps before an all_reduce on gloo; the others wait in it."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
slow = int(sys.argv[1]) if len(sys.argv) > 1 else 2
if rank == slow:
    time.sleep(600)  # SLEEP-LINE
t = torch.ones(4)
dist.all_reduce(t)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
os._exit(0)
