"""A worker for tests/test_gpu_real.py: what this rank sees of its GPUs, as CUDA sees them.

Writes DIR/<rank>.<attempt>.json with its launcher variables, CUDA_VISIBLE_DEVICES,
torch.cuda.device_count(), the UUIDs of the devices it may use (cuda:0, cuda:1 ...) and
its pid; in a later attempt, which of the previous attempt's processes NVML still lists
on a GPU. Optional steps: an NCCL all_reduce through torch.distributed, an allocation held
on the GPU, a failure in the first attempt, the distlaunch backend given a CUDA tensor.
"""

import argparse
import json
import os
import sys

import torch

p = argparse.ArgumentParser()
p.add_argument("out", help="directory for <rank>.<attempt>.json")
p.add_argument("--nccl", action="store_true", help="all_reduce a CUDA tensor through NCCL")
p.add_argument("--hold-mib", type=int, default=0, help="allocate this much on the GPU first")
p.add_argument("--fail-first", action="store_true", help="rank 0 exits 1 in attempt 0")
p.add_argument("--our-backend", action="store_true", help="all_reduce a CUDA tensor through distlaunch")
a = p.parse_args()

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
local = int(os.environ["LOCAL_RANK"])
info = {
    "pid": os.getpid(),
    "rank": rank,
    "local_rank": local,
    "world_size": int(os.environ["WORLD_SIZE"]),
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "count": torch.cuda.device_count(),
}
# as nvidia-smi names them: GPU-<uuid>
info["uuids"] = ["GPU-" + str(torch.cuda.get_device_properties(i).uuid) for i in range(info["count"])]
if attempt > 0:  # which of the previous attempt's processes NVML still lists on a GPU
    import glob

    import pynvml

    old = {json.load(open(f))["pid"] for f in glob.glob(os.path.join(a.out, f"*.{attempt - 1}.json"))}
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    on_gpu = {p.pid for h in handles for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    info["old_on_gpu"], info["old"] = sorted(on_gpu & old), sorted(old)
    pynvml.nvmlShutdown()
# torchrun's rule: local rank i drives cuda:i; a rank given one GPU (--gpus-per-rank) cuda:0
dev = f"cuda:{local if info['count'] > 1 else 0}"
held = None
if a.hold_mib:
    held = torch.empty(a.hold_mib << 20, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
if a.nccl or a.our_backend:
    import torch.distributed as dist

    if a.our_backend:
        import distlaunch.torch  # noqa: F401  (registers the backend)
    dist.init_process_group("distlaunch" if a.our_backend else "nccl", init_method="env://")
    x = torch.full((1024,), float(rank + 1), device=dev)
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        info["sum"] = float(x[0])
    except Exception as e:  # the distlaunch backend refuses CUDA tensors: record the text
        info["error"] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()
with open(os.path.join(a.out, f"{rank}.{attempt}.json"), "w") as f:
    json.dump(info, f)
if a.fail_first and rank == 0 and attempt == 0:
    sys.exit(1)
