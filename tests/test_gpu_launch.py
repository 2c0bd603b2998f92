"""GPUs and NUMA through `distlaunch run`: real launched workers on synthetic machines
(tests/gpu_trees.py) that DISTLAUNCH_SYSFS_ROOT puts in place of / for device and NUMA
discovery. Each worker records its environment and its CPU affinity
(os.sched_getaffinity inside the worker); expected CPU sets are the tree's cpulists
within this test's own affinity (the launcher's allowed CPUs). No GPU is used: these
tests do not tell whether CUDA honours what they check.

Also torchrun's --signals-to-handle, --duplicate-*-filters and
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import WORKERS, dl, dl_popen
from gpu_trees import NODE_CPULISTS, UUIDS, intel_render_nodes, launch_machine

from distlaunch.numa import parse_cpulist

ACTOR = str(WORKERS / "actor.py")
ALLOWED = frozenset(os.sched_getaffinity(0))
NEAR = [parse_cpulist(t) & ALLOWED for t in NODE_CPULISTS]  # each NUMA node's CPUs here


@pytest.fixture
def tree(tmp_path):
    return launch_machine(tmp_path / "machine")


def env_for(root, **extra):
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    return dict(env, DISTLAUNCH_SYSFS_ROOT=str(root), **extra)


def launch(tmp_path, env, *options, n=None):
    """Run the actor under ``options``; every rank's (environment, cpus)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    res = dl("run", *options, ACTOR, "--dump-env", out, env=env)
    assert res.returncode == 0, res.stderr
    files = sorted(out.iterdir(), key=lambda p: int(p.stem))
    assert n is None or len(files) == n
    envs = [json.loads(p.read_text()) for p in files]
    return [(e, frozenset(e["_cpus"])) for e in envs]


def one_line_error(res) -> str:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    return lines[0]


# --- counting -----------------------------------------------------------------------------


def test_nproc_gpu_counts_the_visible_subset(tree, tmp_path):
    ranks = launch(tmp_path, env_for(tree, CUDA_VISIBLE_DEVICES="5,2,7"), "--nproc-per-node", "gpu", n=3)
    # without placement every worker inherits the user's list, as torchrun
    assert {e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks} == {"5,2,7"}
    res = dl("run", "--nproc-per-node", "gpu", "--dry-run", ACTOR, env=env_for(tree))
    assert res.returncode == 0, res.stderr
    assert "8 workers" in res.stdout.splitlines()[0]


@pytest.mark.parametrize("value", ["", "-1"])
def test_no_visible_gpu_is_one_line_exit_2(tree, value):
    res = dl("run", "--nproc-per-node", "gpu", ACTOR, env=env_for(tree, CUDA_VISIBLE_DEVICES=value))
    assert "--nproc-per-node gpu: no GPU visible" in one_line_error(res)


def test_no_gpu_on_the_node_is_one_line_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    res = dl("run", "--nproc-per-node", "gpu", ACTOR, env=env_for(tmp_path / "empty"))
    assert "no GPU found on this node" in one_line_error(res)
    # auto: the GPUs when there are some, else the CPUs
    res = dl("run", "--nproc-per-node", "auto", "--dry-run", ACTOR, env=env_for(tmp_path / "empty"))
    assert f"{os.cpu_count()} workers" in res.stdout.splitlines()[0], res.stderr
    root = launch_machine(tmp_path / "machine")
    res = dl(
        "run", "--nproc-per-node", "auto", "--dry-run", ACTOR, env=env_for(root, CUDA_VISIBLE_DEVICES="3,4")
    )
    assert "2 workers" in res.stdout.splitlines()[0], res.stderr


def test_nproc_xpu(tmp_path):
    root = intel_render_nodes(tmp_path / "m", 2)
    for env, n in ((env_for(root), 2), (env_for(root, ZE_AFFINITY_MASK="0.0,0.1,1"), 3)):
        res = dl("run", "--nproc-per-node", "xpu", "--dry-run", ACTOR, env=env)
        assert res.returncode == 0, res.stderr
        assert f"{n} workers" in res.stdout.splitlines()[0]
    (tmp_path / "none").mkdir()
    res = dl("run", "--nproc-per-node", "xpu", ACTOR, env=env_for(tmp_path / "none"))
    assert "--nproc-per-node xpu: no Intel GPU found" in one_line_error(res)


# --- placement and binding ----------------------------------------------------------------


def test_virtual_local_rank_one_device_each_near_its_cpus(tree, tmp_path):
    env = env_for(tree, CUDA_VISIBLE_DEVICES="6,1,3")
    ranks = launch(tmp_path, env, "--nproc-per-node", "3", "--virtual-local-rank", n=3)
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks] == ["6", "1", "3"]
    assert [e["LOCAL_RANK"] for e, _ in ranks] == ["0", "0", "0"]
    assert [e["RANK"] for e, _ in ranks] == ["0", "1", "2"]
    # GPU-aware --bind-to auto: GPU 6 is on node 1; GPUs 1 and 3 share node 0's CPUs
    assert ranks[0][1] == NEAR[1]
    a, b = ranks[1][1], ranks[2][1]
    assert a | b == NEAR[0] and a and b
    if len(NEAR[0]) > 1:
        assert not a & b


def test_gpus_per_rank_takes_blocks_of_the_users_uuid_list(tree, tmp_path):
    order = [UUIDS[4], UUIDS[5], UUIDS[0], UUIDS[1]]
    env = env_for(tree, CUDA_VISIBLE_DEVICES=",".join(order))
    ranks = launch(tmp_path, env, "--nproc-per-node", "2", "--gpus-per-rank", "2", n=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks] == [",".join(order[:2]), ",".join(order[2:])]
    assert [e["LOCAL_RANK"] for e, _ in ranks] == ["0", "1"]
    assert [c for _, c in ranks] == [NEAR[1], NEAR[0]]


def test_gpu_aware_auto_never_gives_ranks_overlapping_cpus(tree, tmp_path):
    """Rank 0's GPUs span both NUMA nodes, rank 1's are on node 0: blocks cut from the
    two (overlapping) sets would overlap, so both get plain auto blocks, disjoint."""
    env = env_for(tree, CUDA_VISIBLE_DEVICES="0,4,1,2")
    ranks = launch(tmp_path, env, "--nproc-per-node", "2", "--gpus-per-rank", "2", n=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks] == ["0,4", "1,2"]
    (_, a), (_, b) = ranks
    assert a and b and not a & b, ranks


def test_numa_binding_node_without_placement_follows_torchrun(tree, tmp_path):
    env = env_for(tree, CUDA_VISIBLE_DEVICES="4,0")
    ranks = launch(tmp_path, env, "--nproc-per-node", "2", "--numa-binding", "node", n=2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks] == ["4,0", "4,0"]  # left alone
    assert [c for _, c in ranks] == [NEAR[1], NEAR[0]]  # local rank i drives device i


def test_mig_devices_one_per_rank_unbound(tree, tmp_path):
    migs = "MIG-11111111-aaaa-bbbb-cccc-dddddddddddd,MIG-22222222-aaaa-bbbb-cccc-dddddddddddd"
    env = env_for(tree, CUDA_VISIBLE_DEVICES=migs)
    ranks = launch(tmp_path, env, "--nproc-per-node", "2", "--virtual-local-rank", "--numa-binding", "node")
    assert [e["CUDA_VISIBLE_DEVICES"] for e, _ in ranks] == migs.split(",")
    assert [c for _, c in ranks] == [ALLOWED, ALLOWED]  # no bus id, no NUMA node: not bound
    res = dl("run", "--nproc-per-node", "1", "--gpus-per-rank", "2", ACTOR, env=env)
    assert "CUDA shows a process only one MIG device" in one_line_error(res)


def test_placement_holds_across_a_restart(tree, tmp_path):
    # the restart passes the GPU release wait (no NVML here: nothing to wait on)
    env = env_for(tree, CUDA_VISIBLE_DEVICES="7,0")
    out = tmp_path / "out"
    out.mkdir()
    res = dl(
        "run", "--nproc-per-node", "2", "--virtual-local-rank", "--max-restarts", "1", ACTOR,
        "--dump-env", out, "--fail-rank", "1", "--fail-attempts", "1",
        env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    envs = [json.loads((out / f"{r}.json").read_text()) for r in (0, 1)]  # the second attempt's
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in envs] == ["1", "1"]
    assert [(e["CUDA_VISIBLE_DEVICES"], e["LOCAL_RANK"]) for e in envs] == [("7", "0"), ("0", "0")]
    assert [frozenset(e["_cpus"]) for e in envs] == [NEAR[1], NEAR[0]]


def test_new_fields_travel_to_remote_agents():
    from distlaunch.config import LaunchConfig

    c = LaunchConfig(
        ACTOR,
        gpus_per_rank=2,
        virtual_local_rank=True,
        numa_binding="socket",
        signals_to_handle="SIGALRM",
        duplicate_stdout_filters=("a", "b"),
        duplicate_stderr_filters=("c",),
        log_dir="/tmp",
    )
    assert LaunchConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_too_few_gpus_for_the_placement_is_one_line_exit_2(tree):
    env = env_for(tree, CUDA_VISIBLE_DEVICES="0,1")
    res = dl("run", "--nproc-per-node", "3", "--virtual-local-rank", ACTOR, env=env)
    line = one_line_error(res)
    assert "3 workers x 1 GPU need 3 GPUs but 2 are visible" in line and "--nproc-per-node 2" in line


def test_numa_binding_and_bind_to_conflict(tree):
    res = dl("run", "--numa-binding", "node", "--bind-to", "core", ACTOR, env=env_for(tree))
    assert "--numa-binding node and --bind-to core" in one_line_error(res)


def test_dry_run_8_gpus_2_sockets_virtual_local_rank_numa_node(tree):
    args = ("--nproc-per-node", "gpu", "--virtual-local-rank", "--numa-binding", "node", "--dry-run", ACTOR)
    res = dl("run", *args, env=env_for(tree))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "    LOCAL_RANK=0" in lines  # the same for every worker
    ranks = [ln for ln in lines if ln.startswith("rank ")]
    assert len(ranks) == 8
    from distlaunch.topology import format_cpus

    for i, line in enumerate(ranks):
        cpus = format_cpus(NEAR[i // 4])
        assert line.startswith(f"rank {i} (local rank {i}, cpus {cpus}, devices {i}): "), line
        assert f" CUDA_VISIBLE_DEVICES={i} " in line + " "


# --- torchrun's output and signal flags ---------------------------------------------------


def test_log_line_prefix_template(tmp_path):
    env = dict(os.environ, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="<${role_name}|${rank}|${local_rank}> ")
    res = dl("run", "--nproc-per-node", "2", "--role", "trainer", ACTOR, "--lines", "2", env=env)
    assert res.returncode == 0, res.stderr
    out = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert out and all(ln.startswith(("<trainer|0|0> ", "<trainer|1|1> ")) for ln in out), out
    assert {ln[:14] for ln in out} == {"<trainer|0|0> ", "<trainer|1|1> "}


SPEAKER = """
import os, sys
r = os.environ["RANK"]
for word in ("apple", "pear", "orange"):
    print(f"{word} {r}", flush=True)
print(f"apple-err {r}", file=sys.stderr, flush=True)
sys.stdout.write(f"orange tail {r}")  # a last line without a newline
"""


def test_duplicate_filters(tmp_path):
    script = tmp_path / "speaker.py"
    script.write_text(SPEAKER)
    logs = tmp_path / "logs"
    res = dl(
        "run", "--nproc-per-node", "2", "--log-dir", logs, "--run-id", "dup",
        "--duplicate-stdout-filters", "apple,orange", "--duplicate-stderr-filters", "err",
        script,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    attempt = logs / "dup" / "attempt_0"
    out = (attempt / "filtered_stdout.log").read_text().splitlines()
    want = {f"[{r}]: {w} {r}" for r in (0, 1) for w in ("apple", "orange", "orange tail")}
    assert sorted(out) == sorted(want)
    assert sorted((attempt / "filtered_stderr.log").read_text().splitlines()) == [
        "[0]: apple-err 0",
        "[1]: apple-err 1",
    ]
    # the console and the per-rank logs are unchanged
    assert "[0]: pear 0" in res.stdout
    assert (attempt / "0" / "stdout.log").read_text().startswith("apple 0\npear 0\n")


def test_duplicate_filters_need_a_log_dir(tmp_path):
    res = dl("run", "--duplicate-stdout-filters", "x", ACTOR)
    assert "give --log-dir" in one_line_error(res)


SLEEPER = """
import os, sys, time
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").write(os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"])
time.sleep(60)
"""


def test_signals_to_handle_any_signal_stops_the_job_and_reaches_the_workers(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    ready = tmp_path / "ready"
    ready.mkdir()
    p = dl_popen("run", "--nproc-per-node", "2", "--signals-to-handle", "SIGALRM,SIGTERM", script, ready)
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(ready)) == 2
        p.send_signal(signal.SIGALRM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGALRM, err
    assert "stopped by signal 14" in err
    assert (ready / "0").read_text() == "SIGALRM,SIGTERM"


@pytest.mark.parametrize("name", ["SIGFOO", "SIGKILL"])
def test_signals_to_handle_refuses_only_what_cannot_be_caught(name):
    res = dl("run", "--signals-to-handle", name, ACTOR)
    assert f"--signals-to-handle {name!r}" in one_line_error(res)
    res = dl("run", "--signals-to-handle", "SIGWINCH,usr1,SIGCONT", "--dry-run", ACTOR)
    assert res.returncode == 0, res.stderr


def test_top_shows_each_ranks_devices(tree, tmp_path):
    """`distlaunch top --json` gives each rank the devices it was placed on."""
    env = env_for(tree, CUDA_VISIBLE_DEVICES="6,1,3", XDG_RUNTIME_DIR=str(tmp_path))
    prog = WORKERS.parent / "hang_workers" / "plain.py"
    placed = ("--nproc-per-node", "3", "--gpus-per-rank", "1", "--run-id", "gputop")
    p = dl_popen("run", *placed, prog, "quiet", env=env)
    try:
        deadline, recs = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(recs) != 3:
            res = dl("top", "gputop", "--json", env=env)
            recs = json.loads(res.stdout) if res.returncode == 0 else []
            time.sleep(0.3)
        assert [r["devices"] for r in recs] == [f"CUDA_VISIBLE_DEVICES={d}" for d in (6, 1, 3)], recs
        table = dl("top", "gputop", "--once", env=env).stdout.splitlines()
        assert table[0].split()[:4] == ["RANK", "NODE", "PID", "DEVICES"], table
    finally:
        p.terminate()
        p.wait(30)
