"""The PyTorch distributed tutorial's operations with gloo, each checked; prints one
result line per operation so two launchers' outputs can be compared."""

import os
import sys

import torch
import torch.distributed as dist

init = sys.argv[1] if len(sys.argv) > 1 else "env://"
dist.init_process_group(
    "gloo", init_method=init, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
)
rank, world = dist.get_rank(), dist.get_world_size()
results = []


def check(name, got, want):
    assert torch.equal(got, want), (name, got, want)
    results.append(f"{name} ok {got.tolist()}")


# point to point: a ring of send/recv, then isend/irecv
t = torch.tensor([float(rank)])
if rank % 2 == 0:
    dist.send(t, (rank + 1) % world)
    dist.recv(t, (rank - 1) % world)
else:
    buf = torch.zeros(1)
    dist.recv(buf, (rank - 1) % world)
    dist.send(t, (rank + 1) % world)
    t = buf
check("send_recv", t, torch.tensor([float((rank - 1) % world)]))
out, inp = torch.tensor([float(rank)]), torch.zeros(1)
reqs = [dist.isend(out, (rank + 1) % world), dist.irecv(inp, (rank - 1) % world)]
for r in reqs:
    r.wait()
check("isend_irecv", inp, torch.tensor([float((rank - 1) % world)]))

b = torch.arange(4.0) if rank == 0 else torch.zeros(4)
dist.broadcast(b, src=0)
check("broadcast", b, torch.arange(4.0))

s = torch.zeros(2)
dist.scatter(s, [torch.full((2,), float(i)) for i in range(world)] if rank == 0 else None, src=0)
check("scatter", s, torch.full((2,), float(rank)))

g = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
dist.gather(torch.tensor([rank * 10.0]), g, dst=0)
if rank == 0:
    check("gather", torch.cat(g), torch.arange(world) * 10.0)

ag = [torch.zeros(1) for _ in range(world)]
dist.all_gather(ag, torch.tensor([rank + 0.5]))
check("all_gather", torch.cat(ag), torch.arange(world) + 0.5)

r = torch.tensor([rank + 1.0])
dist.reduce(r, dst=0, op=dist.ReduceOp.SUM)
if rank == 0:
    check("reduce", r, torch.tensor([world * (world + 1) / 2]))

a = torch.tensor([rank + 1.0, 2.0])
dist.all_reduce(a, op=dist.ReduceOp.PRODUCT)
fact = 1.0
for i in range(1, world + 1):
    fact *= i
check("all_reduce", a, torch.tensor([fact, 2.0**world]))

dist.barrier()
results.append("barrier ok")
# One write per line: under torchrun all ranks share one pipe, and print() writes the
# text and the newline separately, which lets other ranks' lines land in between.
sys.stdout.write("".join(f"{line}\n" for line in results))
sys.stdout.flush()
dist.destroy_process_group()
