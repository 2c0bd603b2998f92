"""Two "nodes" on this machine: two `distlaunch run --nnodes 2 --node-rank K` launchers
with 2 workers each. Ranks of one launcher share memory, the two launchers' ranks talk
TCP (different DISTLAUNCH_NODE_ID), so the world group runs the hierarchical
collectives (hierarchy.py) and every subgroup picks shm, hierarchy or flat TCP."""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402


def _two_nodes(script, *args, timeout=240):
    port = launch.free_port()
    env = launch._base_env({"DISTLAUNCH_SHM": "1"})
    cmds = [
        [
            sys.executable,
            "-m",
            "distlaunch",
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            str(k),
            "--master-port",
            str(port),
            "--nproc-per-node",
            "2",
            os.path.join(launch.WORKERS, script),
            *args,
        ]
        for k in (1, 0)
    ]
    procs = [
        subprocess.Popen(
            c, env=env, cwd=launch.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for c in cmds
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "".join(outs)


@pytest.mark.parametrize(
    "script,args",
    [
        ("matrix.py", []),
        ("features.py", ["subgroups"]),
        ("features.py", ["large"]),
        ("random_ops.py", ["7", "300"]),
    ],
)
def test_two_nodes_hierarchical(script, args):
    codes, out = _two_nodes(script, *args)
    assert codes == [0, 0], out[-6000:]
    assert sum("checks passed" in line for line in out.splitlines()) == 4, out[-6000:]


@pytest.mark.parametrize("mode", ["skip", "mismatch-root", "mismatch-kind"])
def test_two_nodes_failures(mode):
    codes, out = _two_nodes("failures.py", mode, timeout=90)
    results = re.findall(r"RESULT (\w+) rank (\d+)", out)
    assert sorted(r for _, r in results) == ["0", "1", "2", "3"] and all(ok == "ok" for ok, _ in results), out
    if mode == "skip":
        assert "ranks [3] did not arrive" in out
