"""Failure paths of the distlaunch torch backend. ``failures.py MODE [INIT_METHOD RANK WORLD]``

- ``mismatch``: rank 0 calls all_reduce, the others broadcast: every rank raises.
- ``timeout``: init_process_group(timeout=3 s); rank 0 calls all_reduce at once, rank 1
  two seconds later, the last rank only after rank 0 gave up: rank 0 times out, its
  ABORT makes rank 1 raise about a second into its call (not after its own 3 s) and
  the last rank raise at its call (``seconds`` is measured from each rank's call).
- ``killed``: the last rank SIGKILLs itself instead of calling all_reduce: every
  surviving rank raises (long before the 60 s timeout).
- ``killed-mid``: every rank loops on 16 MiB all_reduces as DDP runs them (async_op=True,
  then wait: the chunked shared-memory algorithm on the backend's helper thread); the
  last rank SIGKILLs itself 0.3 s in: every surviving rank raises.
- ``killed-ddp``: every rank trains DDP with 4 MiB buckets; the last rank SIGKILLs itself 0.1 s after its
  third step: every surviving rank raises.

Each rank prints ``raised <class> <seconds> isDistBackendError=<bool>`` (or ``no error``)
and exits 0, so a launcher does not stop the job at the first rank's exit.
"""

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import distlaunch.torch  # noqa: F401  (registers the backend)

mode = sys.argv[1]
timeout = {"timeout": 3, "killed": 60, "killed-mid": 60, "killed-ddp": 60, "mismatch": 60}[mode]
if len(sys.argv) > 2:  # started by hand: init method, rank, world size
    dist.init_process_group(
        "distlaunch",
        init_method=sys.argv[2],
        rank=int(sys.argv[3]),
        world_size=int(sys.argv[4]),
        timeout=datetime.timedelta(seconds=timeout),
    )
else:
    if mode == "timeout":
        # init_process_group's timeout also bounds torch's own store: rank 0 binds MASTER_PORT
        # and waits for every rank, the others retry their connection. Under load one rank's
        # start (torch's import) can lag another's by more than 3 s, so the ranks meet on the
        # launcher's store first, with a long timeout: the 3 s are for the all_reduce.
        from distlaunch.store.client import StoreClient

        addr, port = os.environ["DISTLAUNCH_STORE_ADDR"], int(os.environ["DISTLAUNCH_STORE_PORT"])
        meet = StoreClient(addr, port, timeout=90)
        if meet.add("failures/started") == int(os.environ["WORLD_SIZE"]):
            meet.set("failures/go", b"1")
        meet.get("failures/go")
        meet.close()
    dist.init_process_group("distlaunch", timeout=datetime.timedelta(seconds=timeout))
rank, n = dist.get_rank(), dist.get_world_size()
dist.all_reduce(torch.ones(4))  # the group works (and has chosen its transport)
t = torch.ones(1 << 16)
start = time.monotonic()
try:
    if mode == "mismatch" and rank:
        dist.broadcast(t, src=0)
    elif mode == "killed" and rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "killed-mid":
        big = torch.ones(4 << 20)
        if rank == n - 1:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while time.monotonic() - start < 20:  # "no error" if the peer's death goes unseen
            dist.all_reduce(big, async_op=True).wait()
    elif mode == "killed-ddp":
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4)
        x = torch.randn(8, 1024)
        for i in range(100000):  # "no error" if the peer's death goes unseen
            if i == 3:  # timed from here: under load DDP's set-up and first steps took ~20 s
                start = time.monotonic()
                if rank == n - 1:
                    threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            ddp(x).sum().backward()
            if i >= 3 and time.monotonic() - start > 20:
                break
    else:
        if mode == "timeout" and rank:
            time.sleep(2 if rank < n - 1 else timeout + 3)
            start = time.monotonic()
        dist.all_reduce(t)
    print("no error", flush=True)
except Exception as e:
    took = time.monotonic() - start
    print(f"raised {type(e).__name__} {took:.2f} isDistBackendError={isinstance(e, dist.DistBackendError)}")
    print(f"message: {str(e).splitlines()[0][:300]}", flush=True)
os._exit(0)  # skip destroy: the group is broken by design
