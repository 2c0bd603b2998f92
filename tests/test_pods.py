"""Kubernetes pods and SkyPilot nodes (engine/pods.py, engine/skypilot.py): two per-node
launchers on this machine, each started with exactly the variables its operator sets
in a pod (kubeflow training-operator's PyTorchJob, kubeflow trainer's TrainJob, a JobSet
manifest, SkyPilot) and no flags; master addresses are loopback aliases (127.0.0.2,
127.0.0.3) or names that resolve here."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import WORKERS, dl, dl_popen
from ports import free_port, free_ports
from test_pernode import finish

from distlaunch.env import POD_VARS

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

# Every worker writes its identity and the sum over ranks of (rank + 1), reduced by
# torch on gloo or by distlaunch.collectives.
PROBE = """\
import json, os, sys

out, how = sys.argv[1], sys.argv[2]
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID")
seen = {k: os.environ.get(k) for k in names}
if how == "torch":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([int(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    total = int(t.item())
    dist.destroy_process_group()
else:
    import numpy as np
    import distlaunch.collectives as dist

    dist.init_process_group()
    x = np.array([int(os.environ["RANK"]) + 1])
    dist.all_reduce(x)
    total = int(x[0])
    dist.destroy_process_group()
with open(os.path.join(out, seen["RANK"] + ".json"), "w") as f:
    json.dump({**seen, "sum": total}, f)
"""

# Variables of other schedulers or of this test's own launcher: none may leak in.
_FOREIGN = ("PET_", "SLURM_", "SKYPILOT_", "OMPI_", "PMI_", "TORCHELASTIC_", "DISTLAUNCH_")
_WORKER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def pod_env(k8s=True, **variables):
    """This environment less any scheduler's variables, plus ``variables`` (a pod's);
    the store secret as a manifest gives it from a Kubernetes Secret."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_FOREIGN) and k not in POD_VARS and k not in _WORKER
    }
    env["DISTLAUNCH_STORE_TOKEN"] = "a-secret-from-a-kubernetes-secret-0123456789"
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    if k8s:
        env["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"  # never contacted
    env.update({k: str(v) for k, v in variables.items()})
    return env


def master_port() -> int:
    """A port free on every address a case's master may have."""
    return free_ports(1, ("127.0.0.1", "127.0.0.2", "127.0.0.3"))[0]


def pytorchjob(port, node, nproc=2, master="127.0.0.2", pet=True):
    """kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go + master.go, a job with
    one Master and one Worker replica, nprocPerNode ``nproc``: since v1.7 both MASTER_* and
    PET_MASTER_*, RANK = PET_NODE_RANK = the pod's rank, WORLD_SIZE = pods x nproc; before
    (``pet=False``) only MASTER_ADDR/MASTER_PORT/RANK and WORLD_SIZE = pods."""
    env = {"PYTHONUNBUFFERED": "1", "MASTER_ADDR": master, "MASTER_PORT": port, "RANK": node}
    if pet:
        env.update(
            PET_MASTER_ADDR=master,
            PET_MASTER_PORT=port,
            WORLD_SIZE=2 * nproc,
            PET_NODE_RANK=node,
            PET_NPROC_PER_NODE=nproc,
            PET_NNODES=2,
        )
    else:
        env["WORLD_SIZE"] = 2
    return env


def trainjob(port, node, nproc=1, master="127.0.0.3"):
    """kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go: PET_* only, the node
    rank from the Indexed Job's completion index."""
    return {
        "PET_NNODES": 2,
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": node,
        "JOB_COMPLETION_INDEX": node,
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": port,
    }


def jobset(port, node, attempt=1, master="127.0.0.2"):
    """A JobSet manifest as JobSet's pytorch example writes it (MASTER_ADDR = pod 0's
    headless-service name, RANK = the completion index), plus the node count and the
    restart-attempt label through the downward API; Kubernetes sets JOB_COMPLETION_INDEX."""
    return {
        "MASTER_ADDR": master,
        "MASTER_PORT": port,
        "RANK": node,
        "JOB_COMPLETION_INDEX": node,
        "PET_NNODES": 2,
        "JOBSET_RESTART_ATTEMPT": attempt,
        "HOSTNAME": f"train-workers-0-{node}",
    }


def skypilot(port, node, gpus=2):
    """sky/skylet/constants.py: rank, the nodes' IPs one a line (head first), counts."""
    return {
        "SKYPILOT_NODE_RANK": node,
        "SKYPILOT_NODE_IPS": "127.0.0.3\n127.0.0.2\n",
        "SKYPILOT_NUM_NODES": 2,
        "SKYPILOT_NUM_GPUS_PER_NODE": gpus,
        "SKYPILOT_TASK_ID": "sky-2026-11-25-12-00-00-000000_mycluster_1",
        "MASTER_PORT": port,
    }


CASES = {
    # name: (variables of pod k, workers per pod, master seen by workers, program, k8s)
    "pytorchjob": (pytorchjob, 2, "127.0.0.2", "torch", True),
    "pytorchjob-before-1.7": (
        lambda p, k: pytorchjob(p, k, master="localhost", pet=False),
        1,
        "localhost",
        "coll",
        True,
    ),
    "trainjob": (trainjob, 1, "127.0.0.3", "torch", True),
    "jobset": (jobset, 1, "127.0.0.2", "coll", True),
    "skypilot": (skypilot, 2, "127.0.0.3", "coll", False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pods_start_with_no_flags(tmp_path, case):
    """`distlaunch run probe.py` in each pod, nothing else: every worker has its global
    rank, the job's world size, its local rank and the operator's master, and a
    collective over all of them adds up (the pod's own RANK/WORLD_SIZE do not leak)."""
    variables, nproc, master, how, k8s = CASES[case]
    if how == "torch" and not HAVE_TORCH:
        pytest.skip("torch is not installed")
    prog = tmp_path / "probe.py"
    prog.write_text(PROBE)
    port = master_port()
    procs = [dl_popen("run", prog, tmp_path, how, env=pod_env(k8s, **variables(port, k))) for k in (0, 1)]
    results = finish(procs, timeout=120)
    assert [r[2] for r in results] == [0, 0], results
    world = 2 * nproc
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    run_ids = {s.pop("TORCHELASTIC_RUN_ID") for s in seen}
    assert len(run_ids) == 1, run_ids
    for r, s in enumerate(seen):
        assert s == {
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(r % nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": str(r // nproc),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "sum": world * (world + 1) // 2,
        }, (r, s)
    if case == "jobset":
        assert run_ids.pop().endswith("attempt1")


def dry(env, *flags):
    """`distlaunch run --dry-run` in a pod: (exit status, plan, the launcher's lines)."""
    out = dl("run", *flags, "--dry-run", WORKERS / "actor.py", env=env, timeout=60)
    return out.returncode, out.stdout, out.stderr.strip().splitlines()


def test_a_restarted_jobset_gets_another_run_id():
    """The restart attempt is part of the run id: the attempt after a restart never
    reads the keys of the one before, whatever stays of it."""
    port = master_port()
    ids = []
    for attempt in (0, 1):
        rc, plan, _ = dry(pod_env(**jobset(port, 1, attempt=attempt)))
        assert rc == 0, plan
        ids.append(plan.split()[2].rstrip(":"))
    assert ids[0] != ids[1] and ids[1].endswith("attempt1"), ids


@pytest.mark.parametrize("node", [0, 1])
def test_multi_node_without_a_master_is_one_line(node):
    """A 2-node job whose pod names no master: one line, exit 2, nothing started; node 0
    too (it would have hosted on 127.0.0.1 and waited for a node that never comes)."""
    env = pod_env(PET_NNODES=2, PET_NODE_RANK=node, HOSTNAME=f"train-workers-0-{node}")
    rc, plan, lines = dry(env)
    assert (rc, plan) == (2, ""), lines
    assert len(lines) == 1 and "no variable names the master" in lines[0], lines
    assert "train-workers-0-0.<subdomain>" in lines[0], lines


def test_node_rank_without_node_count_is_one_line():
    rc, _, lines = dry(pod_env(MASTER_ADDR="127.0.0.2", RANK=1))
    assert rc == 2 and len(lines) == 1 and "RANK=1 but no variable gives the node count" in lines[0], lines


UNRESOLVABLE = "train-node-0-0.distlaunch-test.invalid"  # .invalid never resolves (RFC 2606)


@pytest.mark.parametrize("elastic", [False, True])
def test_waits_for_the_masters_name_then_fails_in_one_line(elastic):
    """A worker pod whose master's name does not resolve (yet) waits, saying so, for the
    join timeout, then stops with one line naming the name and where it came from; an
    elastic PyTorchJob's pods wait for the rendezvous endpoint's host alike."""
    if elastic:  # elastic.go: PET_RDZV_ENDPOINT = <job>-worker-0:<port>, PET_NNODES = MIN:MAX
        env = pod_env(PET_RDZV_ENDPOINT=f"{UNRESOLVABLE}:29400", PET_RDZV_BACKEND="c10d", PET_NNODES="1:2")
        source = "the rendezvous endpoint's host"
    else:
        env = pod_env(**trainjob(29500, 1, master=UNRESOLVABLE))
        source = "the master's address, from PET_MASTER_ADDR"
    env["PET_RDZV_CONF"] = "join_timeout=2"
    start = time.monotonic()
    rc, plan, lines = dry(env)
    assert rc == 2 and plan == "", lines
    assert time.monotonic() - start >= 2  # it waited: the name never resolved
    assert (
        lines[0]
        == f"distlaunch: waiting up to 2 s for {UNRESOLVABLE} ({source}) to resolve: its pod may be starting"
    )
    assert len(lines) == 2 and f"{UNRESOLVABLE} ({source}) did not resolve within 2 s" in lines[1], lines


def test_disagreeing_sources_say_which_won():
    """PET_* win over the plain names, a flag over both; one line each."""
    port = master_port()
    # MASTER_ADDR differs from PET_MASTER_ADDR, PET_NNODES from the flag
    env = pod_env(**{**pytorchjob(port, 1, nproc=1), "PET_NNODES": 3, "MASTER_ADDR": "127.0.0.3"})
    rc, plan, lines = dry(env, "--nnodes", "2")
    assert rc == 0, lines
    said = "distlaunch: PET_MASTER_ADDR=127.0.0.2 wins over MASTER_ADDR=127.0.0.3 (both give --master-addr)"
    assert said in lines
    assert "distlaunch: --nnodes 2 wins over PET_NNODES=3" in lines
    assert "1 workers on node 1 of 2" in plan and f"store: 127.0.0.2:{port}" in plan, plan
    # WORLD_SIZE is pods x nprocPerNode (pods before v1.7): anything else is said
    env = pod_env(**{**pytorchjob(port, 1, nproc=1), "WORLD_SIZE": 7})
    rc, plan, lines = dry(env)
    assert rc == 0 and any("PET_NNODES=2 wins over WORLD_SIZE=7" in ln for ln in lines), lines
    assert not any("wins" in ln for ln in dry(pod_env(**pytorchjob(port, 1)))[2])  # all agree


def test_skypilot_node_count_disagreement_and_cpu_nodes():
    port = master_port()
    env = pod_env(False, **{**skypilot(port, 0, gpus=0), "SKYPILOT_NUM_NODES": 3})
    rc, plan, lines = dry(env)
    assert rc == 0 and "distlaunch: SKYPILOT_NUM_NODES=3 wins over SKYPILOT_NODE_IPS' lines=2" in lines[0]
    assert "1 workers on node 0 of 3" in plan, plan  # no GPU: --nproc-per-node's default


def test_a_plain_pod_is_a_single_node_launch():
    """In a pod without an operator's variables (or an Indexed Job's pod 0 alone) the
    pods engine does not apply; with a master but one node, the launcher keeps its own
    store on loopback (MASTER_PORT, here taken, is not bound)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for env in (
            pod_env(),
            pod_env(JOB_COMPLETION_INDEX=0),
            pod_env(MASTER_ADDR="127.0.0.2", MASTER_PORT=port),
        ):
            rc, plan, lines = dry(env)
            assert rc == 0 and "on node 0 of 1" in plan and not lines, (plan, lines)
            assert "store: 127.0.0.1:<port chosen at start>" in plan, plan


def test_launcher_pods_with_a_host_list_is_one_line():
    env = pod_env(MASTER_ADDR="127.0.0.2")  # a pod; no PET_* (they clash with -H first)
    out = dl("run", "--launcher", "pods", "-H", "localhost:1", "--dry-run", WORKERS / "actor.py", env=env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "starts no agents" in out.stderr


def test_the_engines_are_registered():
    code = "from distlaunch import engine; print(engine.detect('auto', dict(__import__('os').environ)))"
    env = pod_env(**trainjob(29500, 0))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('pods', 'node')"
    env = pod_env(**skypilot(29500, 0))  # SkyPilot on Kubernetes: SkyPilot's variables say more
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('skypilot', 'node')"


def test_a_launch_inside_a_worker_is_not_the_pods(tmp_path):
    """A program that runs `distlaunch run` from a worker in a pod (its environment holds
    the outer job's MASTER_ADDR, RANK, WORLD_SIZE and TORCHELASTIC_RUN_ID) starts a job
    of its own on this node, not a node of the outer job's store."""
    env = pod_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=1, WORLD_SIZE=4)
    rc, plan, lines = dry(dict(env, TORCHELASTIC_RUN_ID="outer"))
    assert rc == 0 and "on node 0 of 1" in plan and not lines, (plan, lines)


def test_a_jobsets_pod_0_without_a_master_is_one_line():
    """A JobSet sets only JOB_COMPLETION_INDEX: pod 0 of a 2-node job must not host on
    127.0.0.1 while the others look for it by name."""
    rc, plan, lines = dry(pod_env(JOB_COMPLETION_INDEX=0, HOSTNAME="train-workers-0-0"), "--nnodes", "2")
    assert (rc, plan) == (2, ""), lines
    assert len(lines) == 1 and "no variable names the master" in lines[0], lines
