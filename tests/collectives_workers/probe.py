"""Trivial worker: proves `distlaunch run` starts workers with the collectives runtime."""

import distlaunch.collectives as dist

dist.init_process_group(timeout=30)
dist.barrier()
print("probe ok", dist.get_rank())
dist.destroy_process_group()
