"""Issue 17 audit: the peers' spellings that tests/test_compat.py left out, and the
refusals of bad values of the new options (one line naming the value, exit 2, nothing
started)."""

import json
import os

import pytest
from conftest import WORKERS, dl
from test_pernode import free_port


def envs_of(tmp_path, n):
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]


def without_cuda_env():
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


@pytest.mark.parametrize("selection", [["--include", "localhost:0,2"], ["--exclude", "localhost:1"]])
def test_deepspeed_selection_without_hostfile_picks_local_slots(tmp_path, selection):
    """`deepspeed --include localhost:0,2 train.py` (no hostfile: DeepSpeed's pool is this
    machine, runner.py): the chosen slots only, every worker of the node with
    CUDA_VISIBLE_DEVICES=0,2 (launch.py joins the node's slot ids)."""
    args = ["run", "--nproc-per-node", "3", *selection]
    res = dl(*args, WORKERS / "actor.py", "--dump-env", tmp_path, env=without_cuda_env())
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "2.json").exists()
    assert [(e["RANK"], e["WORLD_SIZE"], e["CUDA_VISIBLE_DEVICES"]) for e in envs_of(tmp_path, 2)] == [
        ("0", "2", "0,2"),
        ("1", "2", "0,2"),
    ]
    plan = dl(*args, "--dry-run", WORKERS / "actor.py")
    assert plan.returncode == 0 and "CUDA_VISIBLE_DEVICES=0,2" in plan.stdout, plan.stderr


def test_deepspeed_selection_is_refused_in_per_node_launches():
    res = dl("run", "--nnodes", "2", "--include", "localhost:0", WORKERS / "actor.py")
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert "--include" in line and "CUDA_VISIBLE_DEVICES" in line


def test_static_backend_endpoint_port_zero_on_one_node(tmp_path):
    """torchrun --rdzv-backend static --rdzv-endpoint 127.0.0.1:0 --nnodes 1: torch's
    TCPStore binds a free port there; with more nodes it is refused like c10d's."""
    args = ["run", "--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "2"]
    res = dl(*args, WORKERS / "actor.py", "--dump-env", tmp_path)
    assert res.returncode == 0, res.stderr
    [port] = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs_of(tmp_path, 2)}
    assert port[0] == "127.0.0.1" and int(port[1]) > 0
    res = dl(*args, "--nnodes", "2", WORKERS / "actor.py")
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert "127.0.0.1:0 picks a free port" in line and "127.0.0.1:29400" in line


HARD_CODED_PORT = """\
import os, torch, torch.distributed as dist
os.environ["MASTER_ADDR"] = "127.0.0.1"  # as the PyTorch tutorial (dist_tuto) hard-codes them
os.environ["MASTER_PORT"] = "{port}"
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(int(t.item()))
dist.destroy_process_group()
"""


def test_single_node_program_with_its_own_master_port(tmp_path):
    """Single-node jobs leave MASTER_PORT to the program (issue 17 keeps this): the
    tutorial's hard-coded port is free for its rank 0, which hosts torch's store there."""
    pytest.importorskip("torch")
    script = tmp_path / "tutorial.py"
    script.write_text(HARD_CODED_PORT.format(port=free_port()))
    res = dl("run", "--nproc-per-node", "2", "--no-prefix", script, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["3", "3"]  # 1 + 2


@pytest.mark.parametrize(
    "args, bad",
    [
        (["--rdzv-conf", "timeout=120,bogus=1"], "'bogus'"),
        (["--rdzv-conf", "keep_alive_interval=-1"], "keep_alive_interval='-1'"),
        (["--rdzv-conf", "is_host=maybe"], "'maybe'"),
        (["--stdin", "2"], "'2'"),
        (["-H", "localhost:2", "--include", "localhost:5"], "not 5"),
        (["-H", "localhost:2", "--include", "localhost:x"], "'x'"),
        (["--env-file", "/nonexistent/job.env"], "/nonexistent/job.env"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "localhost:2379"], "etcd"),
        (["--rdzv-backend", "etcd-v2"], "etcd-v2"),
        (["-H", "node[5-2]:2"], "'5-2'"),
        (["--signals-to-handle", "SIGKILL"], "'SIGKILL'"),
        (["--run-path", "--no-python"], "--run-path"),
    ],
)
def test_bad_values_of_the_new_options_are_one_line_and_exit_2(tmp_path, args, bad):
    assert bad in refused(tmp_path, *args)


def refused(tmp_path, *args):
    """`distlaunch run ARGS script`'s one error line, after checking it exits 2 before
    anything starts: the script (which would leave a file) never runs."""
    marker = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    res = dl("run", *args, script)
    assert res.returncode == 2, res.stderr
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("distlaunch: error: ")
    assert not marker.exists()
    return line


def test_help_names_the_peer_spellings():
    """`distlaunch run --help` shows each peer spelling next to its option's kin."""
    res = dl("run", "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())  # click wraps lines
    spellings = ["node[01-16]:8", "host1:0,2@host2", "host1:1@host2", "HOST:0", "'NCCL_*'", "one port per"]
    assert [s for s in spellings if s not in text] == []


@pytest.mark.parametrize(
    "selection, merged",
    [
        (["--include", "localhost:0@localhost:1"], "localhost:0,1"),
        (["--include", "localhost@localhost:1"], "localhost"),
        (["--exclude", "localhost:2@localhost:0"], "localhost:0,2"),
        (["--include", "localhost:1@localhost,127.0.0.2"], "localhost"),
    ],
)
def test_deepspeed_selection_naming_a_host_twice_is_refused(tmp_path, selection, merged):
    """DeepSpeed's runner.py reads `--include 'node1:0@node1:1'` as slot 1 only (before
    parse_node_config_list: the last entry wins) or as slots 0,1 (after it; and then
    `node1@node1:1` loses the whole host): the same line means different slots in
    different versions, so it is refused, with the one-entry spelling of the union."""
    line = refused(tmp_path, "-H", "localhost:3,127.0.0.2:1", *selection)
    assert line.endswith(f"{selection[0]}: localhost is named twice; write {merged}")


@pytest.mark.parametrize("listing", ["-H", "--hostfile"])
@pytest.mark.parametrize(
    "per_node",
    [
        ["--rdzv-endpoint", "127.0.0.1:29400"],
        ["--rdzv-endpoint", "127.0.0.1:0"],
        ["--rdzv-backend", "static"],
        ["--node-rank", "1"],
        ["--nnodes", "2"],
        ["--nnodes", "1:2"],
        ["--standalone", "--nnodes", "2"],
        ["--local-addr", "127.0.0.1"],
    ],
)
def test_per_node_options_with_a_host_list_are_refused(tmp_path, listing, per_node):
    """torchrun's per-node options name a store, node count or rank that head mode sets
    itself (the head hosts the store, the host list gives the nodes in rank order): with
    -H/--hostfile they were ignored or refused for another reason; now one line says so."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    hosts = "localhost:1" if listing == "-H" else hostfile
    line = refused(tmp_path, listing, hosts, *per_node)
    assert f"{' '.join(per_node[-2:])} is for per-node launches; with -H/--hostfile " in line


def test_head_mode_keeps_its_run_id_and_one_node_count(tmp_path):
    """--rdzv-id is the run id (torchrun's job id) in head mode too: it names the log
    directory; --nnodes 1 (torchrun's default) is accepted."""
    res = dl(
        "run",
        "-H",
        "localhost:1",
        "--nnodes",
        "1",
        "--rdzv-id",
        "job7",
        "--log-dir",
        tmp_path,
        WORKERS / "actor.py",
    )
    assert res.returncode == 0, res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["job7"]
