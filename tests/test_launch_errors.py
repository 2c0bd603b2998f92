"""Bad input: one clear line naming the value, exit code 2, and no process started."""

import os
import socket
import subprocess

import pytest
from conftest import ROOT, dl, dl_cmd


@pytest.fixture
def marker_script(tmp_path):
    """A script that leaves a file behind if it ever runs."""
    marker = tmp_path / "ran"
    script = tmp_path / "w.py"
    script.write_text(f"open({str(marker)!r}, 'a').close()\n")
    return script, marker


def check_usage_error(res, *needles):
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert res.stdout == ""


def test_script_not_found(tmp_path):
    check_usage_error(dl("run", tmp_path / "nope.py"), "nope.py", "not found")


@pytest.mark.parametrize("value, needle", [("0", "at least 1"), ("abc", "'abc'"), ("-3", "-3")])
def test_bad_nproc_per_node(marker_script, value, needle):
    script, marker = marker_script
    check_usage_error(dl("run", "--nproc-per-node", value, script), "--nproc-per-node", needle)
    assert not marker.exists()


def test_node_rank_out_of_range(marker_script):
    script, marker = marker_script
    check_usage_error(dl("run", "--nnodes", "2", "--node-rank", "2", script), "--node-rank 2", "0 to 1")
    assert not marker.exists()


def test_unknown_option(marker_script):
    script, marker = marker_script
    check_usage_error(dl("run", "--bogus-flag", script), "--bogus-flag", "--help")
    assert not marker.exists()


def test_bad_option_type(marker_script):
    script, marker = marker_script
    check_usage_error(dl("run", "--max-restarts", "many", script), "'many'")
    assert not marker.exists()


def test_unwritable_log_dir(marker_script, tmp_path):
    script, marker = marker_script
    afile = tmp_path / "a_file"
    afile.write_text("")
    check_usage_error(dl("run", "--log-dir", afile / "logs", script), "--log-dir", "writable")
    assert not marker.exists()


def test_master_port_in_use(marker_script):
    script, marker = marker_script
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        check_usage_error(dl("run", "--master-port", port, script), f"--master-port {port}", "in use")
    assert not marker.exists()


def test_bad_redirects(marker_script):
    script, marker = marker_script
    check_usage_error(dl("run", "--redirects", "7", script), "--redirects", "'7'")
    assert not marker.exists()


def test_module_and_no_python_conflict(marker_script):
    script, marker = marker_script
    check_usage_error(dl("run", "-m", "--no-python", script), "--module", "--no-python")


def test_no_python_program_missing():
    check_usage_error(dl("run", "--no-python", "surely-not-a-program-xyz"), "surely-not-a-program-xyz")


def test_every_run_option_has_help():
    res = dl("run", "--help")
    assert res.returncode == 0
    for flag in (
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--monitor-interval",
        "--module",
        "--no-python",
        "--role",
        "--run-id",
        "--log-dir",
        "--redirects",
        "--tee",
        "--local-ranks-filter",
        "--standalone",
        "--stop-timeout",
        "--bind-to",
        "--no-prefix",
        "--dry-run",
    ):
        assert flag in res.stdout, flag


def test_dry_run_starts_nothing(marker_script):
    script, marker = marker_script
    cpus = sorted(os.sched_getaffinity(0))[:2]  # 3 workers on at most 2 CPUs: round robin
    res = subprocess.run(
        dl_cmd("run", "--nproc-per-node", "3", "--dry-run", script, "--lr", "0.1"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    assert res.returncode == 0, res.stderr
    assert not marker.exists()
    for r in range(3):
        assert f"rank {r} (local rank {r}, cpus {cpus[r % len(cpus)]}):" in res.stdout, res.stdout
        assert f"RANK={r}" in res.stdout
    assert "--lr 0.1" in res.stdout
    assert "WORLD_SIZE=3" in res.stdout


@pytest.mark.parametrize(
    "args, master",
    [
        ([], ["MASTER_ADDR=localhost", "MASTER_PORT=<a free port on this node, chosen at start>"]),
        (["--master-port", "29517"], ["MASTER_ADDR=localhost", "MASTER_PORT=29517"]),
        (  # node 0's store is MASTER_PORT (torchrun's one port per job)
            ["--nnodes", "2", "--node-rank", "1"],
            ["MASTER_ADDR=127.0.0.1", "MASTER_PORT=29500", "TORCHELASTIC_USE_AGENT_STORE=True"],
        ),
        (
            ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400"],
            [
                "MASTER_ADDR=<node 0's address, announced at start>",
                "MASTER_PORT=<a free port on node 0, chosen at start>",
            ],
        ),
    ],
)
def test_dry_run_shows_shared_variables_once_and_the_port_as_chosen(marker_script, args, master):
    """What every worker gets alike is listed once; each rank's line holds only its own
    values; MASTER_PORT is never the placeholder 0."""
    script, marker = marker_script
    res = dl("run", "--nproc-per-node", "4", "-x", "SHARED_X=v", *args, "--dry-run", script, timeout=30)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    shared = [ln.strip() for ln in lines if ln.startswith("    ")]
    for want in [*master, "SHARED_X=****", "LOCAL_WORLD_SIZE=4", "TORCHELASTIC_RESTART_COUNT=0"]:
        assert shared.count(want) == 1 and res.stdout.count(want) == 1, (want, res.stdout)
    ranks = [ln for ln in lines if ln.startswith("rank ")]
    first = int(ranks[0].split()[1])
    for k, line in enumerate(ranks):
        own = line.split("): ", 1)[1].split()
        assert f"RANK={first + k}" in own and f"LOCAL_RANK={k}" in own and len(own) < 10, line
    assert "MASTER_PORT=0" not in res.stdout
    assert len(lines) < 40  # was 4 x 29 lines
    assert not marker.exists()


def test_head_mode_dry_run_per_host(marker_script):
    import os

    script, marker = marker_script
    env = dict(os.environ, DISTLAUNCH_STORE_TOKEN="must-not-show", MY_SETTING="abc")
    res = subprocess.run(
        dl_cmd("run", "-H", "nodeA:2,nodeB:3", "-x", "MY_SETTING", "--env-all", "--dry-run", script),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert not marker.exists()
    assert "node 0 nodeA: ranks 0..1" in res.stdout and "node 1 nodeB: ranks 2..4" in res.stdout
    assert "-m distlaunch agent" in res.stdout and "MY_SETTING" in res.stdout
    assert "abc" not in res.stdout  # names only: values may be secrets
    assert "must-not-show" not in res.stdout + res.stderr
    # shipping the secret by name is refused before anything starts
    res = subprocess.run(
        dl_cmd("run", "-H", "nodeA:2", "-x", "DISTLAUNCH_STORE_TOKEN", "--dry-run", script),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    check_usage_error(res, "DISTLAUNCH_STORE_TOKEN")


# Issue 12, item 6: hostile numbers and names are refused at once (they used to spin
# forever, hang, eat gigabytes, or write outside --log-dir).
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--stop-timeout", "nan"], "--stop-timeout nan"),
        (["--stop-timeout", "inf"], "--stop-timeout inf"),
        (["--monitor-interval", "nan"], "--monitor-interval nan"),
        (["--rdzv-conf", "join_timeout=inf"], "join_timeout='inf'"),
        (["--nproc-per-node", "99999999999999999999"], "99999999999999999999"),
        (["--nproc-per-node", "9" * 5000], "--nproc-per-node"),
        (["-H", "node1:10000000"], "10000000"),
        (["--nnodes", "99999999999", "--master-port", "29500"], "99999999999"),
        (["--max-restarts", str(10**12)], str(10**12)),
        (["--run-id", ".."], "'..'"),
        (["--run-id", "."], "'.'"),
        (["--run-id", "-rf"], "'-rf'"),
        (["--run-id", "a/b"], "'a/b'"),
        (["--run-id", "x" * 200], "--run-id"),
        (["--rdzv-endpoint", "::1:29400", "--nnodes", "1:2"], "'::1:29400'"),
        (["-H", "localhost:2,127.0.0.1:2"], "localhost, 127.0.0.1"),
        (
            ["--nproc-per-node", "4", "--local-ranks-filter", "1,5"],
            "--local-ranks-filter 1,5: no node runs local rank 5 (4 worker(s) per node at most); "
            "give local ranks from 0 to 3",
        ),
        (["-H", "localhost:2", "--local-ranks-filter", "2"], "give local ranks from 0 to 1"),
        (["-H", "127.0.0.2:1", "--ssh-port", "-1"], "'--ssh-port': -1 is not in the range 1<=x<=65535"),
        (["-H", "127.0.0.2:1", "--ssh-port", "65536"], "'--ssh-port': 65536 is not in the range"),
    ],
)
def test_hostile_values_exit_2_at_once(marker_script, tmp_path, args, needle):
    script, marker = marker_script
    res = dl("run", "--log-dir", tmp_path / "logs", *args, script, timeout=30)
    check_usage_error(res, needle)
    assert not marker.exists()
    assert {p.name for p in tmp_path.iterdir()} <= {"w.py", "logs"}  # nothing written beside
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())


def test_hostfile_slot_limit(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=10000000\n")
    check_usage_error(
        dl("run", "--hostfile", hostfile, ROOT / "tests" / "workers" / "actor.py", timeout=30),
        "10000000",
        "4096",
    )


def test_ipv6_endpoint_is_accepted(tmp_path):
    res = dl(
        "run",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        "[::1]:29400",
        "--dry-run",
        ROOT / "tests" / "workers" / "actor.py",
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert "store: [::1]:29400" in res.stdout


@pytest.mark.parametrize(
    "args, store",
    [
        (["--nnodes", "2", "--master-addr", "10.1.2.3", "--master-port", "29511"], "10.1.2.3:29511"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "node7:29400"], "node7:29400"),
        ([], "127.0.0.1:<port"),
    ],
)
def test_dry_run_names_the_real_store(args, store):
    res = dl("run", *args, "--dry-run", ROOT / "tests" / "workers" / "actor.py", timeout=30)
    assert res.returncode == 0, res.stderr
    assert f"store: {store}" in res.stdout, res.stdout
