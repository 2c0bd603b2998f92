"""Rank 0 sends one message to every other rank, then ends at once; every other rank
must receive it (MPI and torch.distributed deliver a completed send's data even if the
sender then finalizes and exits).

    send_then_exit.py API STYLE [SECONDS]

API: ``collectives`` (numpy arrays), ``torch`` (torch.distributed with the "distlaunch"
backend) or ``mpi`` (distlaunch.mpi, rank 0's process exits without Finalize, as mpi4py
programs do). STYLE: ``tutorial`` (the end of the torch.distributed tutorial: every
collective once, then isend / irecv with waits and destroy_process_group on both sides)
or ``late`` (the receivers' receive is posted, then they sleep SECONDS (default 0.5)
while rank 0 sends and exits, and only then wait: whatever noticed rank 0's end first
must not fail a receive whose data already arrived)."""

import sys
import time

import numpy as np

api, style = sys.argv[1], sys.argv[2]
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5

if api == "mpi":
    from distlaunch import mpi as MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    x = np.zeros(3, np.float32)
    if rank == 0:
        x += 7
        if style == "late":
            comm.Barrier()  # every other rank has posted its receive
            for r in range(1, world):
                comm.Send(x, dest=r)
        else:
            MPI.Request.Waitall([comm.Isend(x, dest=r) for r in range(1, world)])
        print("rank 0 sent", flush=True)
        sys.exit(0)
    req = comm.Irecv(x, source=0)
    if style == "late":
        comm.Barrier()
        time.sleep(pause)
    req.Wait()
    assert (x == 7).all(), x
    print(f"rank {rank} got {x.tolist()}", flush=True)
    sys.exit(0)

if api == "torch":
    import torch
    import torch.distributed as dist

    import distlaunch.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("distlaunch")
    zeros, full = torch.zeros, torch.full
else:
    import distlaunch.collectives as dist

    dist.init_process_group()
    zeros = lambda n: np.zeros(n, np.float32)
    full = lambda n, v: np.full(n, v, np.float32)

rank, world = dist.get_rank(), dist.get_world_size()
t = full((4,), float(rank))
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.reduce(t, 0)
dist.all_gather([zeros(4) for _ in range(world)], t)
dist.gather(t, [zeros(4) for _ in range(world)] if rank == 0 else None, dst=0)
dist.scatter(t, [full((4,), float(i)) for i in range(world)] if rank == 0 else None, src=0)
dist.barrier()
x = zeros(3)
if rank == 0:
    if style == "late":
        dist.barrier()  # every other rank has posted its receive
    x += 7
    for w in [dist.isend(x, dst=r) for r in range(1, world)]:
        w.wait()
    print("rank 0 sent", flush=True)
    dist.destroy_process_group()
    sys.exit(0)
w = dist.irecv(x, src=0)
if style == "late":
    # a receive from any rank after it posts it on the transport (no shortcut from the ring)
    dist.irecv(zeros(1), tag=99)
    dist.barrier()
    time.sleep(pause)  # rank 0 has sent, destroyed its group and exited by now
w.wait()
assert (x == 7).all(), x
print(f"rank {rank} got {x.tolist()}", flush=True)
if style != "late":  # the late style's any-source receive is still pending
    dist.destroy_process_group()
