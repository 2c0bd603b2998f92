"""Initialise the distlaunch torch backend one way and compare an all_reduce and an
all_gather with gloo's in the same processes. ``init_methods.py METHOD [URL RANK WORLD]``

METHOD: ``env`` (torchrun / distlaunch run: everything from the environment), ``url``
(tcp:// or file:// given as URL), ``store`` (an explicit torch TCPStore on the URL's
host:port; the runtime's transport secret must not be readable from it). Prints
``init ok METHOD transport=<shm|tcp>``.
"""

import sys
import time
from urllib.parse import urlparse

import torch
import torch.distributed as dist

import distlaunch.torch  # noqa: F401  (registers the backend)

method = sys.argv[1]
if method == "env":
    dist.init_process_group("distlaunch")
else:
    url, rank, world = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if method == "url":
        dist.init_process_group("distlaunch", init_method=url, rank=rank, world_size=world)
    else:
        u = urlparse(url)
        store = dist.TCPStore(u.hostname, u.port, world, is_master=rank == 0)
        dist.init_process_group("distlaunch", store=store, rank=rank, world_size=world)
rank, n = dist.get_rank(), dist.get_world_size()
if method == "store":  # torch's store is not authenticated: the transport secret stays out
    rt = distlaunch.torch._STATE["runtime"]
    # the store torch gave the backend: the group's prefix store, then the device's
    backend_store = dist.PrefixStore("cpu/", dist.distributed_c10d._world.pg_map[dist.group.WORLD][1])
    key = f"{rt.prefix}nonce"  # the public value the key is derived from
    assert backend_store.check([key]), f"{key} is not in the backend's store"
    published = bytes(backend_store.get(key))
    assert rt.secret and bytes.fromhex(rt.secret) not in published, "the transport key is in torch's store"
    assert rt.secret.encode() not in published, "the transport key is in torch's store"
gloo = dist.new_group(backend="gloo")
results = []
for group in (None, gloo):
    t = torch.arange(10, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t, group=group)
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(outs, torch.full((3,), rank), group=group)
    results.append([t, *outs])
for a, b in zip(*results):
    assert torch.equal(a, b), (a, b)
# gloo's worker thread may still release the last op's tensors (needs the GIL): exiting
# before it did aborts the process (torch 2.13, see examples/torch_ddp_digits.py)
time.sleep(0.2)
pg = dist.distributed_c10d._get_default_group()
print(f"init ok {method} transport={pg.transport}", flush=True)
dist.destroy_process_group()
