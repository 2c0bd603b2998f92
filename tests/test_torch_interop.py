"""Unmodified torch.distributed programs behave the same under distlaunch run as under
torchrun (skipped when torch is not installed)."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS, dl

torch = pytest.importorskip("torch")

# Random by nature (ports, ids, temp paths), or different on purpose (see distlaunch/env.py).
VARYING = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"}


def torchrun(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def added_env(d, n):
    """What the launcher added to or changed in each worker's environment."""
    base = dict(os.environ)
    out = []
    for r in range(n):
        e = json.loads((d / f"{r}.json").read_text())
        out.append({k: v for k, v in e.items() if not k.startswith("_") and base.get(k) != v})
    return out


def test_environment_matches_torchrun(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    res = dl("run", "--nproc-per-node", "2", "--max-restarts", "1", WORKERS / "actor.py", "--dump-env", ours)
    assert res.returncode == 0, res.stderr
    res = torchrun("--nproc-per-node", "2", "--max-restarts", "1", WORKERS / "actor.py", "--dump-env", theirs)
    assert res.returncode == 0, res.stderr
    for o, t in zip(added_env(ours, 2), added_env(theirs, 2)):
        missing = set(t) - set(o)
        assert not missing, f"torchrun sets {missing}, distlaunch does not"
        assert {k: o[k] for k in t if k not in VARYING} == {k: t[k] for k in t if k not in VARYING}
        assert o["TORCHELASTIC_USE_AGENT_STORE"] == "False"


@pytest.mark.slow
def test_tutorial_program_same_as_torchrun():
    # (one world size: what is compared is the launchers' environment and output; the
    # backend's world-size cases are tests/test_torch_backend.py's)
    world = 3
    ours = dl("run", "--nproc-per-node", world, WORKERS / "torch_tutorial.py", timeout=180)
    assert ours.returncode == 0, ours.stderr
    theirs = torchrun("--nproc-per-node", world, WORKERS / "torch_tutorial.py", timeout=180)
    assert theirs.returncode == 0, theirs.stderr
    strip = sorted(re.sub(r"^\[\d+\]: ", "", ln) for ln in ours.stdout.splitlines())
    assert strip == sorted(theirs.stdout.splitlines())
    assert strip.count("barrier ok") == world


def test_file_init(tmp_path):
    res = dl(
        "run", "--nproc-per-node", "2", WORKERS / "torch_tutorial.py", f"file://{tmp_path}/rdzv", timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()).count("[1]: barrier ok") == 1


@pytest.mark.slow
def test_ddp_digits_example():
    pytest.importorskip("sklearn")
    res = dl(
        "run",
        "--nproc-per-node",
        "4",
        ROOT / "examples" / "torch_ddp_digits.py",
        "--epochs",
        "25",
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    acc = float(re.search(r"^\[0\]: accuracy=([\d.]+)$", res.stdout, re.M).group(1))
    assert acc >= 0.95
    assert "identical_parameters=True" in res.stdout
