"""Drop-in compatibility: the peers' own spellings (torchrun, mpirun, DeepSpeed) work, with
the peer's behaviour, or are refused with one line saying why."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import WORKERS, dl, dl_cmd, dl_popen
from sshd import sshd_hosts  # noqa: F401  (session fixture)
from test_pernode import finish, free_port

from distlaunch.config import LaunchConfig
from distlaunch.errors import ConfigError


def envs_of(tmp_path, n):
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(n)]


# --- torchrun: argparse's abbreviations ---------------------------------------------------


def test_unambiguous_prefixes_of_long_options_work_as_under_torchrun(tmp_path):
    # torchrun parses with argparse (allow_abbrev): `--max-restart 1` is --max-restarts,
    # `--nproc_per 2` is --nproc-per-node; what follows the script stays the script's
    res = dl(
        "run", "--nproc_per", "2", "--max-restart", "1", "--run-i=abbr",
        WORKERS / "actor.py", "--dump", tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    for e in envs_of(tmp_path, 2):
        got = (e["WORLD_SIZE"], e["TORCHELASTIC_MAX_RESTARTS"], e["TORCHELASTIC_RUN_ID"])
        assert got == ("2", "1", "abbr")
        assert e["_argv"] == ["--dump", str(tmp_path)]


def test_a_prefix_never_names_a_hidden_internal_option(tmp_path):
    # --ro is --role alone: the hidden --root-cause-file (launch()'s) is no candidate
    res = dl("run", "--ro", "trainer", WORKERS / "actor.py", "--dump-env", tmp_path)
    assert res.returncode == 0, res.stderr
    assert envs_of(tmp_path, 1)[0]["ROLE_NAME"] == "trainer"


def test_an_ambiguous_prefix_names_the_candidates_and_starts_nothing():
    res = dl("run", "--m", "2", WORKERS / "actor.py", "--sleep", "30", timeout=30)
    assert res.returncode == 2 and res.stdout == ""
    [line] = res.stderr.strip().splitlines()
    assert "option --m is ambiguous" in line and "--max-restarts" in line and "--master-port" in line


# --- torchrun's newer flags ---------------------------------------------------------------


def _merged(*args, env=None):
    res = dl("run", *args, "--print-config", WORKERS / "actor.py", env=env)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def test_shutdown_timeout_is_the_stop_timeout():
    # torchrun: --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}
    assert _merged("--shutdown-timeout", "7")["stop_timeout"] == 7.0
    assert _merged(env=env)["stop_timeout"] == 9.0
    assert _merged("--shutdown_timeout", "4", env=env)["stop_timeout"] == 4.0  # the command line wins
    assert _merged()["stop_timeout"] == 30.0


def test_start_method_and_event_log_handler_are_accepted():
    merged = _merged("--start-method", "forkserver", "--event-log-handler", "console")
    assert merged["start_method"] == "forkserver" and merged["event_log_handler"] == "console"
    res = dl("run", "--start-method", "thread", WORKERS / "actor.py")
    assert res.returncode == 2 and "'thread' is not one of 'spawn', 'fork', 'forkserver'" in res.stderr


def test_python_exec_chooses_the_workers_interpreter(tmp_path):
    # torchrun's PYTHON_EXEC: the interpreter that runs the script on each node
    python = tmp_path / "python-for-workers"
    python.symlink_to(sys.executable)
    script = tmp_path / "which.py"
    script.write_text("import sys; print('interpreter', sys.executable)\n")
    res = dl("run", "--nproc-per-node", "2", script, env={**os.environ, "PYTHON_EXEC": str(python)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.count(f"interpreter {python}") == 2, res.stdout


# --- torchrun: rendezvous options ---------------------------------------------------------


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_etcd_backend_is_refused_with_the_reason(backend):
    res = dl("run", "--rdzv-backend", backend, "--rdzv-endpoint", "localhost:2379", WORKERS / "actor.py")
    assert res.returncode == 2
    [line] = res.stderr.strip().splitlines()
    assert f"--rdzv-backend {backend} is not supported" in line and "c10d" in line


def test_endpoint_port_zero_picks_a_free_port(tmp_path):
    """torchrun --nnodes 1 --rdzv-endpoint localhost:0: this launcher hosts the store on
    a free port."""
    res = dl(
        "run", "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
        "--nproc-per-node", "2", WORKERS / "actor.py", "--dump-env", tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert [e["RANK"] for e in envs_of(tmp_path, 2)] == ["0", "1"]


def test_endpoint_port_zero_needs_one_node():
    res = dl("run", "--nnodes", "1:2", "--rdzv-endpoint", "localhost:0", WORKERS / "actor.py")
    assert res.returncode == 2
    assert "localhost:0 picks a free port" in res.stderr and "localhost:29400" in res.stderr


def test_static_backend_with_endpoint_is_node_zeros_address(tmp_path):
    """torchrun --rdzv-backend static --rdzv-endpoint H:P --nnodes 2 --node-rank K: ranks
    from --node-rank, MASTER_ADDR/MASTER_PORT from the endpoint."""
    port = free_port()
    procs = [
        dl_popen(
            "run", "--rdzv-backend", "static", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "2",
            "--node-rank", k, WORKERS / "actor.py", "--dump-env", tmp_path,
        )
        for k in (1, 0)
    ]  # fmt: skip
    assert [r[2] for r in finish(procs)] == [0, 0]
    envs = envs_of(tmp_path, 2)
    assert [(e["RANK"], e["GROUP_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {("127.0.0.1", str(port))}


def test_torchrun_rdzv_conf_keys_map_to_ours():
    def options(conf):
        return LaunchConfig("x.py", rdzv_conf=tuple(kv.split("=") for kv in conf.split(","))).rdzv_options()

    assert options("timeout=120") == {"join_timeout": 120.0}
    assert options("join_timeout=7,last_call_timeout=2") == {"join_timeout": 7.0, "last_call_timeout": 2.0}
    assert options("keep_alive_interval=2,keep_alive_max_attempt=3") == {
        "heartbeat_interval": 2.0,
        "heartbeat_timeout": 6.0,
    }
    assert options("keep_alive_max_attempt=4") == {"heartbeat_timeout": 4.0}  # interval 1 s
    assert options("read_timeout=60,close_timeout=30,is_host=true") == {}
    assert LaunchConfig("x.py", rdzv_conf=(("is_host", "False"),)).rdzv_is_host() is False
    with pytest.raises(ConfigError, match="is_host='maybe' is invalid"):
        LaunchConfig("x.py", rdzv_conf=(("is_host", "maybe"),)).rdzv_options()
    with pytest.raises(ConfigError, match="key 'bogus' is unknown"):
        options("bogus=1")


def test_rdzv_conf_timeout_is_accepted_end_to_end(tmp_path):
    res = dl(
        "run", "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--rdzv-conf", "timeout=120,read_timeout=60", WORKERS / "actor.py",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr


def test_is_host_false_does_not_host(tmp_path):
    """is_host=false: the launcher only connects; with nobody hosting, the join times
    out (here after 2 s) instead of this launcher binding the endpoint."""
    port = free_port()
    res = dl(
        "run", "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-conf", "is_host=false,join_timeout=2", WORKERS / "actor.py", timeout=60,
    )  # fmt: skip
    assert res.returncode != 0
    assert f"could not connect to the store at 127.0.0.1:{port} within 2 s" in res.stderr


def test_is_host_true_must_host():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = dl(
            "run", "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", "is_host=true", WORKERS / "actor.py",
        )  # fmt: skip
    assert res.returncode == 2
    assert f"cannot host the rendezvous store at 127.0.0.1:{port}" in res.stderr


def test_local_addr_is_announced_as_master_addr(tmp_path):
    res = dl(
        "run", "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.5",
        WORKERS / "actor.py", "--dump-env", tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert envs_of(tmp_path, 1)[0]["MASTER_ADDR"] == "127.0.0.5"


def test_run_path_runs_the_script_as_main(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nprint(__name__, sys.argv[0].endswith('show.py'), sys.argv[1:])\n")
    res = dl("run", "--run-path", "--no-prefix", script, "a", "--b")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "__main__ True ['a', '--b']"
    res = dl("run", "--run-path", "-m", "json.tool")
    assert res.returncode == 2 and "--module and --run-path cannot be combined" in res.stderr


def test_signals_to_handle(tmp_path):
    ok = dl("run", "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", WORKERS / "actor.py")
    assert ok.returncode == 0, ok.stderr
    # any signal the launcher can catch, as torchrun (test_gpu_launch.py: what it does)
    bad = dl("run", "--signals-to-handle", "SIGTERM,SIGSTOP", WORKERS / "actor.py")
    assert bad.returncode == 2
    assert "--signals-to-handle 'SIGSTOP'" in bad.stderr


def test_logs_specs_is_accepted():
    res = dl("run", "--logs-specs", "default", WORKERS / "actor.py")
    assert res.returncode == 0, res.stderr


# --- DeepSpeed and mpirun: host lists -------------------------------------------------------


def test_deepspeed_include_slots_become_cuda_visible_devices(sshd_hosts, tmp_path):
    """DeepSpeed's --include 'node1:0,2@node2': two workers on node1 with
    CUDA_VISIBLE_DEVICES=0,2 (the chosen slots, as DeepSpeed's launcher sets per node),
    node2 whole and untouched; --dry-run shows the same."""
    args = ["run", "--ssh-config", sshd_hosts.ssh_config, "-H", "node[1-2]:3", "--include", "node1:0,2@node2"]
    plan = dl(*args, "--dry-run", WORKERS / "actor.py")
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("CUDA_VISIBLE_DEVICES=") == 1 and "CUDA_VISIBLE_DEVICES=0,2" in plan.stdout
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    res = dl(*args, WORKERS / "actor.py", "--dump-env", tmp_path, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    envs = envs_of(tmp_path, 5)
    assert [(e["GROUP_RANK"], e.get("CUDA_VISIBLE_DEVICES")) for e in envs] == [
        ("0", "0,2"), ("0", "0,2"), ("1", None), ("1", None), ("1", None)
    ]  # fmt: skip


def test_x_globs_and_env_files(sshd_hosts, tmp_path):
    """mpirun's -x with a glob ('NCCL_*'), and --env-file in dotenv syntax (quotes,
    export, comments), shipped to a remote host's workers; -x wins over the file."""
    envfile = tmp_path / "job.env"
    envfile.write_text(
        "# DeepSpeed-style .deepspeed_env\n"
        'export FROM_FILE="a b"\n'
        "QUOTED='x $y'  # trailing comment\n"
        "NCCL_DEBUG=WARN\n"
    )
    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_IB_DISABLE="1", NCCLX="no")
    res = dl(
        "run", "-x", "NCCL_*", "--env-file", envfile, WORKERS / "actor.py", "--dump-env", tmp_path, env=env
    )
    assert res.returncode == 0, res.stderr
    [e] = envs_of(tmp_path, 1)
    assert (e["FROM_FILE"], e["QUOTED"], e["NCCL_DEBUG"], e["NCCL_IB_DISABLE"]) == (
        "a b",
        "x $y",
        "INFO",
        "1",
    )
    bad = tmp_path / "bad.env"
    bad.write_text("OK=1\nthis is not an assignment\n")
    res = dl("run", "--env-file", bad, WORKERS / "actor.py")
    assert res.returncode == 2 and f"--env-file {bad}:2: cannot read" in res.stderr
    secret = tmp_path / "secret.env"
    secret.write_text("DISTLAUNCH_STORE_TOKEN=abc\n")
    res = dl("run", "--env-file", secret, WORKERS / "actor.py")
    assert res.returncode == 2 and "store token is never shipped" in res.stderr


# --- mpiexec habits ------------------------------------------------------------------------

STDIN_PROBE = """\
import os, sys
data = sys.stdin.read() if os.environ["RANK"] == "0" else ""
print(os.environ["RANK"], os.readlink("/proc/self/fd/0") == os.devnull, repr(data))
"""


@pytest.mark.parametrize(
    "mode, expect",
    [
        (None, ["0 False 'hello\\n'", "1 True ''"]),  # default: mpiexec's, rank 0 reads it
        ("0", ["0 False 'hello\\n'", "1 True ''"]),
        ("all", ["0 False 'hello\\n'", "1 False ''"]),
        ("none", ["0 True ''", "1 True ''"]),
    ],
)
def test_stdin_goes_to_rank_zero_like_mpiexec(tmp_path, mode, expect):
    script = tmp_path / "probe.py"
    script.write_text(STDIN_PROBE)
    args = ["run", "--nproc-per-node", "2", "--no-prefix", *(["--stdin", mode] if mode else []), script]
    res = subprocess.run(dl_cmd(*args), input="hello\n", capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == expect


# --- Kubernetes (PyTorchJob): PET_* defaults -------------------------------------------------


def test_pet_variables_are_defaults_like_torchrun(tmp_path):
    """The training operator sets PET_<OPTION> for torchrun; distlaunch reads the same
    names, the command line wins, and --print-config names each value's source."""
    env = dict(os.environ, PET_NPROC_PER_NODE="2", PET_MAX_RESTARTS="1", PET_RDZV_BACKEND="static")
    res = dl("run", WORKERS / "actor.py", "--dump-env", tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert [e["TORCHELASTIC_MAX_RESTARTS"] for e in envs_of(tmp_path, 2)] == ["1", "1"]
    shown = dl("run", "--nproc-per-node", "3", "--print-config", "train.py", env=env).stdout.splitlines()
    assert "nproc_per_node: '3'  # from the command line" in shown
    assert "max_restarts: 1  # from PET_MAX_RESTARTS" in shown
    assert "stop_timeout: 30.0  # default" in shown
    bad = dl("run", WORKERS / "actor.py", env=dict(env, PET_MAX_RESTARTS="lots"))
    assert bad.returncode == 2 and "lots" in bad.stderr


TORCH_ENV_INIT = """\
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env://: a TCPStore client at MASTER_ADDR:MASTER_PORT
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(os.environ["TORCHELASTIC_USE_AGENT_STORE"], os.environ["MASTER_PORT"], int(t.item()))
dist.destroy_process_group()
"""


def test_one_port_per_job_torch_env_init_per_node(tmp_path):
    """torchrun's per-node launch: workers get MASTER_PORT = --master-port, the agents'
    store, and torch's init_process_group(env://) finds a TCPStore there."""
    pytest.importorskip("torch")
    script = tmp_path / "env_init.py"
    script.write_text(TORCH_ENV_INIT)
    port = free_port()
    procs = [
        dl_popen(
            "run", "--nnodes", "2", "--node-rank", k, "--master-addr", "127.0.0.1", "--master-port", port,
            "--nproc-per-node", "2", "--no-prefix", script,
        )
        for k in (0, 1)
    ]  # fmt: skip
    results = finish(procs, timeout=120)
    assert [r[2] for r in results] == [0, 0], results
    lines = sorted(line for out, _, _ in results for line in out.splitlines())
    assert lines == [f"True {port} 10"] * 4
