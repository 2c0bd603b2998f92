"""GPUs for real: device counting, placement, an NCCL program and a restart with GPU
memory held, through `distlaunch run` on a machine with an NVIDIA GPU and a CUDA build of
torch. What the launcher decides is checked against what CUDA and nvidia-smi say, not
against the launcher's own view. The development machine and CI have no GPU: every test
here skips there (tests/test_gpu_launch.py covers the same paths on synthetic machines).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import WORKERS, dl

WORKER = str(WORKERS / "gpu_worker.py")


def _smi_gpus() -> list[tuple[int, str]]:
    """(index, uuid) of every GPU, from nvidia-smi (independent of distlaunch and torch)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [(int(i), u.strip()) for i, u in (ln.split(",") for ln in out.splitlines() if "," in ln)]


def _cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


GPUS = _smi_gpus()
pytestmark = pytest.mark.skipif(not GPUS or not _cuda_torch(), reason="needs an NVIDIA GPU and CUDA torch")


def gpu_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    env.pop("DISTLAUNCH_SYSFS_ROOT", None)
    return dict(env, **extra)


def launch(tmp_path, *options, env=None, worker_args=()):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    res = dl("run", *options, WORKER, out, *worker_args, env=env or gpu_env(), timeout=240)
    records = {}
    for p in out.iterdir():
        rank, attempt = map(int, p.stem.split("."))
        records[rank, attempt] = json.loads(p.read_text())
    return res, records


def test_nproc_per_node_gpu_counts_what_nvidia_smi_lists(tmp_path):
    res, recs = launch(tmp_path, "--nproc-per-node", "gpu")
    assert res.returncode == 0, res.stderr
    assert sorted(r for r, _ in recs) == list(range(len(GPUS)))
    # torchrun's rule without placement: every rank sees every GPU, local rank i uses cuda:i
    for rec in recs.values():
        assert rec["world_size"] == len(GPUS)
        assert rec["count"] == len(GPUS)


def test_counting_without_nvml_reads_the_driver_files(tmp_path):
    # nvidia-ml-py made unimportable: the count falls back to /proc/driver/nvidia/gpus
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['pynvml'] = None\n")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    res, recs = launch(tmp_path, "--nproc-per-node", "gpu", env=gpu_env(PYTHONPATH=path))
    assert res.returncode == 0, res.stderr
    assert len(recs) == len(GPUS)


def test_gpus_per_rank_gives_each_rank_its_own_gpu(tmp_path):
    res, recs = launch(tmp_path, "--nproc-per-node", "gpu", "--gpus-per-rank", "1")
    assert res.returncode == 0, res.stderr
    assert len(recs) == len(GPUS)
    by_index = dict(GPUS)
    for rec in recs.values():
        assert rec["count"] == 1, rec  # CUDA sees this rank's GPU alone
        # local rank i gets GPU i in nvidia-smi's (PCI bus) order
        assert rec["uuids"] == [by_index[rec["local_rank"]]], rec


def test_cuda_visible_devices_subset_is_honoured(tmp_path):
    last, uuid = GPUS[-1]
    res, recs = launch(
        tmp_path, "--nproc-per-node", "gpu", "--gpus-per-rank", "1", env=gpu_env(CUDA_VISIBLE_DEVICES=uuid)
    )
    assert res.returncode == 0, res.stderr
    assert [rec["uuids"] for rec in recs.values()] == [[uuid]]


def test_nccl_all_reduce_across_the_gpus(tmp_path):
    res, recs = launch(tmp_path, "--nproc-per-node", "gpu", worker_args=["--nccl"])
    assert res.returncode == 0, res.stderr
    n = len(GPUS)
    assert [rec.get("sum") for rec in recs.values()] == [n * (n + 1) / 2] * n, recs


def test_restart_meets_no_gpu_memory_of_the_failed_attempt(tmp_path):
    # rank 0 holds 2 GiB and fails; the launcher waits until NVML lists none of that
    # attempt's processes before starting the next one (nvidia-resiliency-ext's rule)
    res, recs = launch(
        tmp_path,
        "--nproc-per-node",
        "gpu",
        "--gpus-per-rank",
        "1",
        "--max-restarts",
        "1",
        worker_args=["--hold-mib", "2048", "--fail-first"],
    )
    assert res.returncode == 0, res.stderr
    again = [rec for (_, attempt), rec in recs.items() if attempt == 1]
    assert len(again) == len(GPUS)
    for rec in again:
        assert len(rec["old"]) == len(GPUS) and rec["old_on_gpu"] == [], rec


def test_the_distlaunch_backend_refuses_cuda_tensors_in_one_line(tmp_path):
    res, recs = launch(tmp_path, "--nproc-per-node", "1", worker_args=["--our-backend"])
    assert res.returncode == 0, res.stderr
    err = recs[0, 0]["error"]
    assert "cuda:0" in err and "CPU tensors" in err and "\n" not in err, err
