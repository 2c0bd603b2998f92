"""Data-parallel training of a small MLP on scikit-learn's bundled digits data set with
torch DistributedDataParallel over gloo — an unmodified torch.distributed program — or,
with ``--backend distlaunch``, over distlaunch's collectives (the only other change is
``import distlaunch.torch``, which registers that backend with torch).

    distlaunch run --nproc-per-node 4 examples/torch_ddp_digits.py
    distlaunch run --nproc-per-node 4 examples/torch_ddp_digits.py --backend distlaunch

Each rank trains on its own shard of the training split; DDP averages gradients. At the
end every rank checks that all ranks hold bit-identical parameters, and rank 0 prints
``accuracy=<float>`` on the held-out split.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--backend", choices=["gloo", "distlaunch"], default="gloo")
    args = p.parse_args()

    if args.backend == "distlaunch":
        import distlaunch.torch  # noqa: F401  (registers the "distlaunch" backend)
    start = time.monotonic()
    dist.init_process_group(args.backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    x_train = torch.tensor((x_train - mean) / std, dtype=torch.float32)
    x_test = torch.tensor((x_test - mean) / std, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    shard = slice(rank, None, world)  # each rank its own shard
    xs, ys = x_train[shard], y_train[shard]

    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    # Every rank must run the same number of steps (DDP all-reduces in each backward).
    steps = -(-len(x_train) // world // args.batch_size)
    g = torch.Generator().manual_seed(rank)
    for _epoch in range(args.epochs):
        order = torch.randperm(len(xs), generator=g)
        for s in range(steps):
            idx = order[(s * args.batch_size) % len(xs) :][: args.batch_size]
            opt.zero_grad()
            loss = loss_fn(model(xs[idx]), ys[idx])
            loss.backward()
            opt.step()

    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(gathered[0], t) for t in gathered):
        raise SystemExit(f"rank {rank}: parameters differ between ranks")
    if rank == 0:
        with torch.no_grad():
            acc = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"loss={loss.item():.4f} ranks={world} identical_parameters=True")
        print(f"accuracy={acc:.4f}")
        print(f"backend={args.backend} seconds={time.monotonic() - start:.2f}")
    # gloo's worker thread releases a finished op (and its tensors, which needs the GIL)
    # just after waking us; if this process reached interpreter exit first, that thread
    # would abort it ("terminate called without an active exception"; torch 2.13, under
    # torchrun as well). Giving up the GIL for a moment lets it finish first.
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
