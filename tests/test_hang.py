"""--hang-timeout and --stacks-on-failure with real workers: the watchdog stops a group
whose ranks make no progress and names the odd rank out with its file:line; output,
distlaunch.heartbeat() and completed operations count as progress."""

import json
import os
import re
import time

import pytest
from conftest import ROOT, dl, line_of
from sshd import sshd_hosts  # noqa: F401  (session fixture)

W = ROOT / "tests" / "hang_workers"


def test_torch_gloo_rank_asleep_before_all_reduce(tmp_path):
    pytest.importorskip("torch")
    prog = W / "torch_sleeper.py"
    t0 = time.monotonic()
    res = dl("run", "--nproc-per-node", "4", "--hang-timeout", "5", "--log-dir", tmp_path, prog, timeout=90)
    took = time.monotonic() - t0
    assert res.returncode != 0, res.stderr
    sleep = f"torch_sleeper.py:{line_of(prog, 'SLEEP-LINE')}"
    cause = next(ln for ln in res.stderr.splitlines() if "hang: " in ln)
    # the three waiting ranks in all_reduce, rank 2 at its sleep
    assert re.search(r"hang: 3 of 4 ranks in all_reduce \(torch_sleeper\.py:\d+\) for \d", cause), cause
    assert f"rank 2 in <module> at {sleep}" in cause, cause
    assert "rank 2 (local rank 2)" in res.stderr and "stopped by the hang watchdog" in res.stderr
    # the group is stopped within the timeout, start-up (torch import) and a few seconds
    assert took < 5 + 40, took
    # the dump went under --log-dir too
    dumps = list(tmp_path.rglob("stacks.txt"))
    assert dumps and sleep in dumps[0].read_text()


def test_plain_hang_names_rank_and_line_then_restarts(tmp_path):
    prog = W / "plain.py"
    res = dl("run", "--nproc-per-node", "4", "--hang-timeout", "2", "--max-restarts", "1", prog, "quiet")
    assert res.returncode == 1, res.stderr
    stuck = f"plain.py:{line_of(prog, 'STUCK-LINE')}"
    wait = f"plain.py:{line_of(prog, 'WAIT-LINE')}"
    causes = [ln for ln in res.stderr.splitlines() if "distlaunch: hang: " in ln]
    assert causes and all(f"3 of 4 ranks in wait_here ({wait})" in c for c in causes), res.stderr
    assert f"rank 2 in stuck_here at {stuck}" in causes[0]
    # --max-restarts applies: a hang is a failure, the group ran twice
    assert res.stdout.count("rank 2 up") == 2, res.stdout


def test_heartbeats_and_output_are_progress():
    prog = W / "plain.py"
    for mode in ("beats", "printer"):
        res = dl("run", "--nproc-per-node", "3", "--hang-timeout", "1", prog, mode, "4")
        assert res.returncode == 0, (mode, res.stderr)
        assert "hang:" not in res.stderr


def test_a_silent_start_up_is_no_hang():
    # before any rank shows progress (imports, the program's rendezvous) the watchdog
    # waits at least STARTUP_SECONDS
    res = dl("run", "--nproc-per-node", "2", "--hang-timeout", "1", W / "plain.py", "late", "2.5")
    assert res.returncode == 0 and "hang" not in res.stderr, res.stderr


def test_no_hang_timeout_no_watchdog():
    res = dl("run", "--nproc-per-node", "2", W / "plain.py", "beats", "1.5")
    assert res.returncode == 0 and "hang" not in res.stderr


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_bad_hang_timeout_is_a_usage_error(bad):
    res = dl("run", "--hang-timeout", bad, W / "plain.py", "beats")
    assert res.returncode == 2 and f"--hang-timeout {bad}" in res.stderr.replace("-1.0", "-1"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_stacks_on_failure_names_where_survivors_were():
    prog = W / "plain.py"
    res = dl("run", "--nproc-per-node", "3", prog, "crash")
    assert res.returncode == 3, res.stderr
    wait = f"plain.py:{line_of(prog, 'WAIT-LINE')}"
    assert "where the other ranks of its node were:" in res.stderr
    assert re.search(rf"ranks 0,2 \(2\): wait_here \({re.escape(wait)}\)", res.stderr), res.stderr
    off = dl("run", "--nproc-per-node", "3", "--no-stacks-on-failure", prog, "crash")
    assert off.returncode == 3 and "where the other ranks" not in off.stderr


def test_hang_over_two_ssh_hosts_names_the_rank_on_the_other_host(sshd_hosts):
    # each agent watches its own workers; node2 holds rank 2 (ranks 2-4), node1 only
    # ranks waiting alike, so node1 lets node2's cause (naming rank 2) stand first
    prog = W / "plain.py"
    res = dl(
        "run",
        "--ssh-config",
        sshd_hosts.ssh_config,
        "-H",
        "node1:2,node2:3",
        "--hang-timeout",
        "3",
        prog,
        "quiet",
        timeout=90,
    )
    assert res.returncode == 1, res.stderr
    stuck = f"plain.py:{line_of(prog, 'STUCK-LINE')}"
    assert "rank 2 (local rank 0) on node 1" in res.stderr, res.stderr
    root = res.stderr[res.stderr.index("root cause") :]
    wait = f"plain.py:{line_of(prog, 'WAIT-LINE')}"
    cause = rf"hang: 2 of 3 ranks in wait_here \({re.escape(wait)}\) for 3\.\d s; rank 2 in stuck_here at "
    assert re.search(cause + re.escape(stuck), root), root  # the idle time is measured: 3.0, 3.1 ...


def test_nccl_flight_recorder_environment(tmp_path, actor):
    # only the environment can be checked here (no GPU, no NCCL): NCCL's own dump on its
    # timeout goes into the log dir, unless the user chose otherwise
    logs, dump = tmp_path / "logs", tmp_path / "env"
    dump.mkdir()
    res = dl("run", "--hang-timeout", "60", "--log-dir", logs, "--run-id", "fr", actor, "--dump-env", dump)
    assert res.returncode == 0, res.stderr
    env = json.loads((dump / "0.json").read_text())
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(logs / "fr" / "nccl_trace_rank_")
    user = dict(os.environ, TORCH_NCCL_TRACE_BUFFER_SIZE="5", TORCH_FR_DUMP_TEMP_FILE="/x/t_")
    res = dl("run", "--hang-timeout", "60", actor, "--dump-env", dump, env=user)
    env = json.loads((dump / "0.json").read_text())
    assert "TORCH_FR_BUFFER_SIZE" not in env and env["TORCH_FR_DUMP_TEMP_FILE"] == "/x/t_"
    res = dl("run", actor, "--dump-env", dump)  # no --hang-timeout: nothing set
    env = json.loads((dump / "0.json").read_text())
    assert not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"} & env.keys()


@pytest.mark.parametrize("prog", ["mpi_pingpong.py", "p2p_pingpong.py"])
def test_point_to_point_is_progress(prog):
    """A silent ping-pong (distlaunch.mpi, distlaunch.collectives) is not a hang: its
    completed receives count."""
    res = dl("run", "--nproc-per-node", "2", "--hang-timeout", "2", W / prog, "5", timeout=60)
    assert res.returncode == 0 and "hang:" not in res.stderr, res.stderr
