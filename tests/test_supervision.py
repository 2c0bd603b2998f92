"""Supervision with real workers: failures, root cause, restarts, signals, orphans."""

import os
import signal
import time

import psutil
import pytest
from conftest import WORKERS, dl, dl_popen


def wait_for(pred, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def started(d, n, attempt=0):
    return lambda: all((d / f"started.{r}.{attempt}").exists() for r in range(n))


def test_failure_stops_group_and_reports_root_cause():
    t0 = time.monotonic()
    res = dl(
        "run",
        "--nproc-per-node",
        "3",
        WORKERS / "actor.py",
        "--fail-rank",
        "2",
        "--fail-code",
        "3",
        "--fail-delay",
        "0.3",
        "--sleep",
        "60",
    )
    elapsed = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    assert elapsed < 20, "the others were not stopped"
    err = res.stderr
    assert "root cause" in err and "rank 2 (local rank 2) on node 0" in err and "exit code 3" in err
    assert "rank 2 failing on purpose" in err.split("root cause")[1]


def test_traceback_in_summary_without_decorator():
    res = dl("run", "--nproc-per-node", "2", WORKERS / "raises_in_train_step.py")
    assert res.returncode == 1
    summary = res.stderr.split("root cause")[1]
    assert "ValueError: loss is nan at step 7" in summary
    assert "in train_step" in summary


def test_death_by_signal_gives_128_plus_n():
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        WORKERS / "actor.py",
        "--fail-rank",
        "0",
        "--fail-code",
        "-9",
        "--sleep",
        "60",
    )
    assert res.returncode == 128 + 9, res.stderr
    assert "SIGKILL" in res.stderr


def test_first_failure_is_the_root_cause():
    # rank 1 fails at once; rank 0 would fail later with another code, but is stopped first.
    res = dl("run", "--nproc-per-node", "2", WORKERS / "actor.py", "--fail-rank", "1", "--fail-code", "5")
    assert res.returncode == 5
    assert "rank 1 (local rank 1)" in res.stderr


def test_stop_timeout_escalates_to_sigkill(tmp_path):
    # The survivor ignores SIGTERM: it must be killed after --stop-timeout, not waited for.
    t0 = time.monotonic()
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--stop-timeout",
        "1",
        WORKERS / "actor.py",
        "--fail-rank",
        "1",
        "--fail-code",
        "4",
        "--fail-delay",
        "0.5",
        "--ignore",
        "SIGTERM",
        "--sleep",
        "60",
    )
    assert res.returncode == 4
    assert 1.0 <= time.monotonic() - t0 < 15


def test_restart_then_success(tmp_path):
    res = dl(
        "run",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "2",
        WORKERS / "actor.py",
        "--fail-rank",
        "1",
        "--fail-attempts",
        "2",
        "--mark-dir",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    # The failing rank ran in every attempt; the last attempt ran every rank to the end.
    assert all((tmp_path / f"started.1.{attempt}").exists() for attempt in (0, 1, 2))
    assert all((tmp_path / f"started.{r}.2").exists() for r in range(3))
    assert not (tmp_path / "started.1.3").exists()
    assert "restart 1 of 2" in res.stderr and "restart 2 of 2" in res.stderr
    assert "succeeded after 2 restart(s)" in res.stderr


def test_restarts_exhausted(tmp_path):
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        WORKERS / "actor.py",
        "--fail-rank",
        "0",
        "--fail-code",
        "7",
        "--mark-dir",
        tmp_path,
    )
    assert res.returncode == 7
    assert (tmp_path / "started.0.1").exists() and not (tmp_path / "started.0.2").exists()


def test_program_that_cannot_run_is_a_usage_error(tmp_path):
    script = tmp_path / "noexec"
    script.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\n")  # not executable
    res = dl("run", "--no-python", "--nproc-per-node", "2", str(script))
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "noexec" in res.stderr and "not executable" in res.stderr
    assert not (tmp_path / "ran").exists()


def test_spawn_failure_after_validation_is_reported(tmp_path):
    # The program passes validation (executable) but its interpreter line names a missing
    # program, so exec fails: a SpawnError, exit code 1, naming the rank and the program.
    script = tmp_path / "badinterp"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    res = dl("run", "--no-python", "--nproc-per-node", "2", str(script))
    assert res.returncode == 1, res.stderr
    assert "cannot start rank 0" in res.stderr and "badinterp" in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signal_forwarded(tmp_path, sig):
    p = dl_popen(
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--sleep",
        "60",
    )
    assert wait_for(started(tmp_path, 2))
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + sig
    assert all((tmp_path / f"{sig.name}.{r}").exists() for r in range(2))
    assert not (tmp_path / "started.0.1").exists(), "a stop signal must not restart"


def test_usr1_forwarded_and_job_continues(tmp_path):
    p = dl_popen(
        "run", "--nproc-per-node", "2", WORKERS / "actor.py", "--mark-dir", tmp_path, "--sleep", "1.5"
    )
    assert wait_for(started(tmp_path, 2))
    p.send_signal(signal.SIGUSR1)
    p.communicate(timeout=20)
    assert p.returncode == 0
    assert all((tmp_path / f"SIGUSR1.{r}").exists() for r in range(2))


def test_second_sigint_kills_at_once(tmp_path):
    p = dl_popen(
        "run",
        "--nproc-per-node",
        "2",
        "--stop-timeout",
        "60",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--ignore",
        "SIGINT",
        "--sleep",
        "60",
    )
    assert wait_for(started(tmp_path, 2))
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert p.poll() is None  # workers ignore SIGINT; the launcher waits its grace period
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=20)
    assert time.monotonic() - t0 < 5
    assert p.returncode == 128 + signal.SIGINT


def survivors(pids):
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_launcher_sigkill_leaves_no_orphans(tmp_path):
    p = dl_popen(
        "run",
        "--nproc-per-node",
        "3",
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--spawn-child",
        tmp_path,
        "--sleep",
        "120",
    )
    assert wait_for(started(tmp_path, 3))
    assert wait_for(lambda: all((tmp_path / f"child.{r}").exists() for r in range(3)))
    launcher = psutil.Process(p.pid)
    workers = [c.pid for c in launcher.children(recursive=True)]
    grandchildren = [int((tmp_path / f"child.{r}").read_text()) for r in range(3)]
    assert len(survivors(workers)) >= 3 and len(survivors(grandchildren)) == 3
    p.kill()
    p.wait()
    assert wait_for(lambda: not survivors(workers + grandchildren), timeout=10), survivors(
        workers + grandchildren
    )


def test_launcher_sigkill_leaves_no_temp_files(tmp_path):
    import glob
    import tempfile

    run_id = f"tmpcheck{os.getpid()}"
    pattern = os.path.join(tempfile.gettempdir(), f"distlaunch_{run_id}_*")
    p = dl_popen(
        "run",
        "--nproc-per-node",
        "2",
        "--run-id",
        run_id,
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--sleep",
        "60",
    )
    assert wait_for(started(tmp_path, 2))
    assert glob.glob(pattern), "the agent keeps a scratch directory while it runs"
    p.kill()
    p.wait()
    assert wait_for(lambda: not glob.glob(pattern), 10), glob.glob(pattern)


def test_grandchildren_stopped_with_group(tmp_path):
    res = dl("run", "--nproc-per-node", "2", WORKERS / "actor.py", "--spawn-child", tmp_path)
    assert res.returncode == 0
    kids = [int((tmp_path / f"child.{r}").read_text()) for r in range(2)]
    assert wait_for(lambda: not survivors(kids), timeout=5)


def shm_script(tmp_path, then):
    script = tmp_path / "shm_user.py"
    script.write_text(
        "import os, time\n"
        "name = os.environ['DISTLAUNCH_SHM_PREFIX'] + 'seg' + os.environ['RANK']\n"
        "with open('/dev/shm/' + name, 'wb') as f:\n"
        "    f.write(b'x' * 4096)\n"
        f"open({str(tmp_path)!r} + '/' + name, 'w').close()\n" + then
    )
    return script


def test_shared_memory_segments_removed_after_the_round(tmp_path):
    import glob

    # both ranks create their segment; then rank 0 dies by SIGKILL
    both = (
        f"while len([n for n in os.listdir({str(tmp_path)!r}) if n.startswith('distlaunch_')]) < 2:\n"
        "    time.sleep(0.01)\n"
        "if os.environ['RANK'] == '0':\n    os.kill(os.getpid(), 9)\ntime.sleep(60)\n"
    )
    res = dl("run", "--nproc-per-node", "2", "--run-id", f"shm{os.getpid()}", shm_script(tmp_path, both))
    assert res.returncode == 137
    names = [p.name for p in tmp_path.iterdir() if p.name.startswith("distlaunch_")]
    assert len(names) == 2 and all(n.startswith(f"distlaunch_shm{os.getpid()}_") for n in names)
    assert not [n for n in names if os.path.exists("/dev/shm/" + n)]
    assert not glob.glob(f"/dev/shm/distlaunch_shm{os.getpid()}_*")


def test_shared_memory_segments_removed_after_launcher_sigkill(tmp_path):
    import glob

    run_id = f"shmk{os.getpid()}"
    p = dl_popen("run", "--nproc-per-node", "2", "--run-id", run_id, shm_script(tmp_path, "time.sleep(60)\n"))
    assert wait_for(lambda: len([q for q in tmp_path.iterdir() if q.name.startswith("distlaunch_")]) == 2)
    assert len(glob.glob(f"/dev/shm/distlaunch_{run_id}_*")) == 2
    p.kill()
    p.wait()
    assert wait_for(lambda: not glob.glob(f"/dev/shm/distlaunch_{run_id}_*"), 10)


def test_killing_the_launchers_process_group_leaves_no_orphans(tmp_path):
    import subprocess

    from conftest import dl_cmd

    p = subprocess.Popen(
        dl_cmd(
            "run", "--nproc-per-node", "2", WORKERS / "actor.py", "--mark-dir", tmp_path, "--sleep", "120"
        ),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert wait_for(started(tmp_path, 2))
    workers = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and everything in its group
    p.wait()
    assert wait_for(lambda: not survivors(workers), 10), survivors(workers)
