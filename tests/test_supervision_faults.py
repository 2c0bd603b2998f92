"""Supervision faults never kill the job or leave orphans: unwritable worker logs, no
pidfd, descendants that leave the worker's session, and the store's raised fd limit."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, WORKERS, dl, dl_cmd, dl_popen
from test_supervision import survivors as alive
from test_supervision import wait_for

FAULTS = WORKERS / "faults.py"


def pids_in(d, prefix):
    return [int(p.read_text()) for p in d.iterdir() if p.name.startswith(prefix + ".")]


@pytest.fixture
def marks(tmp_path):
    """A mark directory; whatever faults.py processes it names are killed at the end (so a
    failing test leaves nothing behind)."""
    d = tmp_path / "marks"
    d.mkdir()
    yield d
    for pid in alive(pids_in(d, "pid") + pids_in(d, "escaped")):
        try:
            if any("faults.py" in a for a in psutil.Process(pid).cmdline()):
                os.kill(pid, signal.SIGKILL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass


# --- a log file that cannot be written -------------------------------------------------


@pytest.fixture
def full_dir(tmp_path):
    """A 64 KiB tmpfs: worker logs fill it, then every write fails with ENOSPC."""
    d = tmp_path / "tiny"
    d.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line]


def test_full_log_dir_warns_once_and_the_job_goes_on(full_dir):
    # 2 workers x 2000 lines x 100 bytes: 400 KB for a 64 KiB filesystem
    res = dl("run", "--nproc-per-node", "2", "--log-dir", full_dir, FAULTS, "--lines", "2000")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    for rank in (0, 1):
        got = [line for line in res.stdout.splitlines() if line.startswith(f"[{rank}]: line ")]
        assert got == [f"[{rank}]: line {i:06d} " + "x" * 88 for i in range(2000)]
    assert len(warnings(res.stderr)) == 1, res.stderr[-3000:]
    assert "No space left on device" in warnings(res.stderr)[0]
    assert str(full_dir) in warnings(res.stderr)[0]


def test_full_redirect_target_warns_once_and_the_job_goes_on(full_dir):
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--log-dir",
        full_dir,
        "--redirects",
        "1",
        FAULTS,
        "--lines",
        "2000",
        "--fail-rank",
        "1",
    )
    # rank 1's failure still reaches the summary: stderr was not redirected
    assert res.returncode == 3, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "rank 1 failing on purpose" in res.stderr.split("root cause")[1]
    assert len(warnings(res.stderr)) == 1, res.stderr[-3000:]


# --- no pidfd ----------------------------------------------------------------------------


def no_pidfd(err: str, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKERS / "no_pidfd.py"), err, *dl_cmd(*args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        **kw,
    )


def finish(p: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{err[-3000:]}") from None
    if p.returncode == 77:
        pytest.skip("cannot install a seccomp filter here")
    return out, err


@pytest.mark.parametrize("err", ["ENOSYS", "EMFILE"])
def test_workers_supervised_without_pidfd(err, marks):
    p = no_pidfd(err, "run", "--nproc-per-node", "2", FAULTS, "--lines", "20", "--mark-dir", marks)
    out, stderr = finish(p)
    assert p.returncode == 0, stderr[-3000:]
    assert sum(" line " in line for line in out.splitlines()) == 40
    assert not alive(pids_in(marks, "pid"))


@pytest.mark.parametrize("err", ["ENOSYS", "EMFILE"])
def test_failure_seen_and_group_stopped_without_pidfd(err, marks):
    t0 = time.monotonic()
    p = no_pidfd(
        err,
        "run",
        "--nproc-per-node",
        "3",
        FAULTS,
        "--mark-dir",
        marks,
        "--fail-rank",
        "1",
        "--ranks",
        "3",
        "--sleep",
        "60",
    )
    _, stderr = finish(p)
    assert p.returncode == 3, stderr[-3000:]
    assert time.monotonic() - t0 < 30, "the others were not stopped"
    assert "rank 1 failing on purpose" in stderr
    assert len(pids_in(marks, "pid")) == 3 and not alive(pids_in(marks, "pid"))


# --- descendants that call setsid --------------------------------------------------------


@pytest.mark.parametrize("how", ["setsid", "daemon"])
def test_setsid_descendants_killed_when_the_job_stops(how, marks):
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        FAULTS,
        "--escape",
        how,
        "--mark-dir",
        marks,
        "--fail-rank",
        "1",
        "--ranks",
        "2",
        "--sleep",
        "60",
    )
    assert res.returncode == 3, res.stderr[-3000:]
    escaped = pids_in(marks, "escaped")
    assert len(escaped) == 2
    assert wait_for(lambda: not alive(escaped), 2), alive(escaped)


@pytest.mark.parametrize("how", ["setsid", "daemon"])
def test_setsid_descendants_killed_when_the_launcher_is_sigkilled(how, marks):
    p = dl_popen(
        "run", "--nproc-per-node", "2", FAULTS, "--escape", how, "--mark-dir", marks, "--sleep", "60"
    )
    try:
        assert wait_for(lambda: len(pids_in(marks, "escaped")) == 2), p.stderr
        escaped = pids_in(marks, "escaped")
        workers = pids_in(marks, "pid")
        # an orphan reparented to the agent is found by the guard's next look at it
        time.sleep(1.5)
    finally:
        p.kill()
        p.communicate()
    assert wait_for(lambda: not alive(escaped + workers), 5), alive(escaped + workers)


# --- the store's raised RLIMIT_NOFILE ----------------------------------------------------


def test_workers_get_the_users_nofile_limit():
    import resource
    import shlex

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("the hard RLIMIT_NOFILE leaves no room to tell a raised limit apart")
    cmd = shlex.join(dl_cmd("run", "--nproc-per-node", "2", FAULTS, "--nofile"))
    res = subprocess.run(
        ["bash", "-c", f"ulimit -Sn 1024 && exec {cmd}"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line for line in res.stdout.splitlines() if "nofile" in line) == [
        "[0]: nofile 1024",
        "[1]: nofile 1024",
    ]


def test_unwritable_events_file_warns_once_and_the_job_goes_on(tmp_path):
    # events.jsonl cannot be opened (a directory stands in its place): one warning line
    (tmp_path / "ev" / "events.jsonl").mkdir(parents=True)
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path,
        "--run-id",
        "ev",
        "--max-restarts",
        "1",
        WORKERS / "actor.py",
        "--fail-rank",
        "0",
        "--fail-attempts",
        "1",
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("events are no longer recorded") == 1, res.stderr
    assert "Traceback" not in res.stderr


def test_uncreatable_attempt_dir_warns_once_and_the_job_goes_on(tmp_path):
    # attempt_0 exists as a file, so no worker's log directory can be made under it
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "attempt_0").write_text("")
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--log-dir",
        tmp_path,
        "--run-id",
        "ad",
        WORKERS / "actor.py",
        "--lines",
        "3",
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("worker logs there are dropped") == 1, res.stderr
    assert "Traceback" not in res.stderr


# --- the orphan guard killed ------------------------------------------------------------


def guard_of(launcher: int) -> list[int]:
    """Pids of the processes titled as the guard of ``launcher`` (what ``pgrep -f`` finds)."""
    title = f"distlaunch guard for pid {launcher}"
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if title in " ".join(p.info["cmdline"] or ()):
            found.append(p.pid)
    return found


def kill_the_guard(p: subprocess.Popen, marks) -> int:
    """Wait for both workers and the guard (found by its title), SIGKILL the guard, and
    return the pid of the one that replaces it."""
    assert wait_for(lambda: len(pids_in(marks, "pid")) == 2), p.stderr
    assert wait_for(lambda: len(guard_of(p.pid)) == 1), "no process titled as the guard"
    (old,) = guard_of(p.pid)
    os.kill(old, signal.SIGKILL)
    assert wait_for(lambda: guard_of(p.pid) not in ([], [old]), 5), "the guard was not restarted"
    (new,) = guard_of(p.pid)
    return new


def test_killed_guard_is_restarted_and_the_job_succeeds(marks):
    """The guard SIGKILLed while the workers run, then the guard that replaced it: the
    launcher says so in one line each time, starts a new guard (titled as the old one,
    holding none of the launcher's stdio), and exits 0 when the workers succeed (it
    exited 1 with no message)."""
    p = dl_popen("run", "--nproc-per-node", "2", FAULTS, "--mark-dir", marks, "--sleep", "4")
    try:
        kill_the_guard(p, marks)
        new = kill_the_guard(p, marks)
        # none of the launcher's output: a reader sees its end when the launcher ends
        assert [os.readlink(f"/proc/{new}/fd/{fd}") for fd in (1, 2)] == [os.devnull] * 2
    finally:
        _, stderr = finish(p)
    assert p.returncode == 0, stderr
    lines = [line for line in stderr.splitlines() if "guard" in line]
    assert len(lines) == 2, stderr
    assert all("killed by SIGKILL" in line and "restarting it" in line for line in lines), stderr


def test_restarted_guard_still_kills_the_workers_of_a_killed_launcher(marks):
    """After its guard was SIGKILLed and restarted, a SIGKILLed launcher still leaves no
    worker behind: the new guard took over every registered worker group."""
    p = dl_popen("run", "--nproc-per-node", "2", FAULTS, "--mark-dir", marks, "--sleep", "60")
    try:
        new = kill_the_guard(p, marks)
        workers = pids_in(marks, "pid")
        assert alive(workers) == workers
    finally:
        p.kill()
        p.communicate()
    assert wait_for(lambda: not alive(workers + [new]), 5), alive(workers + [new])


# An OrphanGuard where no thread can start (1 GiB thread stacks, the address space capped
# 256 MiB above what the process uses: pthread_create fails, the guard's fork does not),
# then closed: how long that took, and whether the guard was reaped.
NO_THREAD = """
import _thread, os, resource, time
from distlaunch.agent.guard import OrphanGuard
_thread.stack_size(1 << 30)
vm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
try:
    _thread.start_new_thread(lambda: None, ())
    print("a thread started")
except RuntimeError:
    pass
guard = OrphanGuard()
began = time.monotonic()
guard.close(wait=1.0)
took = time.monotonic() - began
try:
    os.waitpid(guard.pid, os.WNOHANG)
    print("not reaped")
except ChildProcessError:
    print(f"closed in {took:.3f} s")
"""


def test_a_guard_without_its_watcher_thread_works_and_closes_at_once():
    """No thread to be had for the guard's watcher (pthread_create fails): the guard
    starts anyway (a death then noticed at the next message, as without a pidfd), and
    its close does not wait a second for a watcher that never ran."""
    res = subprocess.run(
        [sys.executable, "-c", NO_THREAD], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert res.returncode == 0, res.stderr
    (line,) = res.stdout.splitlines()
    assert line.startswith("closed in "), res.stdout
    assert float(line.split()[2]) < 0.9, line  # (not the watcher's full second: ms when quiet)


def test_killed_guard_without_pidfd_is_noticed_at_the_next_message(marks):
    """Without a pidfd to watch, the guard's death is noticed when the launcher next
    tells it something (the group's end): the same one line, and the job succeeds."""
    p = no_pidfd("ENOSYS", "run", "--nproc-per-node", "2", FAULTS, "--mark-dir", marks, "--sleep", "2")
    try:
        assert wait_for(lambda: len(pids_in(marks, "pid")) == 2), p.stderr
        assert wait_for(lambda: len(guard_of(p.pid)) == 1)
        os.kill(guard_of(p.pid)[0], signal.SIGKILL)
    finally:
        _, stderr = finish(p)
    assert p.returncode == 0, stderr
    lines = [line for line in stderr.splitlines() if "guard" in line]
    assert len(lines) == 1 and "killed by SIGKILL" in lines[0], stderr


REAPER = """
import ctypes, subprocess, sys, time
import psutil
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come here
cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "1", sys.argv[1]]
for _ in range(3):
    subprocess.run(cmd, check=True)
time.sleep(0.5)
print("LEFT", [(c.pid, c.name(), c.status()) for c in psutil.Process().children()])
"""


def test_the_launcher_reaps_its_guard(tmp_path):
    """A launch leaves no process behind for its adopter to reap: the launcher waits
    (briefly) for its guard's exit, so where pid 1 reaps nothing (a container's own
    program; this machine's init) no zombie guard piles up per launch. The test
    process adopts orphans (a child subreaper), so a guard left behind shows up as its
    child."""
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    res = subprocess.run(
        [sys.executable, "-c", REAPER, str(script)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    assert "LEFT []" in res.stdout, res.stdout


def test_stopped_guard_does_not_hold_the_launchers_exit(marks):
    """A guard that cannot run when the job ends (SIGSTOPped: a debugger, a frozen
    cgroup) keeps neither the launcher from exiting nor its output open: it is told to
    quit and not waited for (the launcher waited for its exit, forever here), and holds
    none of the launcher's stdio; once it runs again it quits, killing nothing."""
    p = dl_popen("run", "--nproc-per-node", "1", FAULTS, "--mark-dir", marks, "--sleep", "1")
    guard = None
    try:
        assert wait_for(lambda: len(guard_of(p.pid)) == 1), "no process titled as the guard"
        (guard,) = guard_of(p.pid)
        os.kill(guard, signal.SIGSTOP)
        p.wait(timeout=20)  # raises TimeoutExpired where the launcher waits for the guard
        out = p.stderr.read()  # its end: only the launcher held it
    finally:
        if guard is not None:
            os.kill(guard, signal.SIGCONT)
        if p.poll() is None:
            p.kill()
        p.communicate()
    assert p.returncode == 0, out
    assert "guard" not in out, out
    assert wait_for(lambda: not alive([guard]), 5), "the guard did not quit once continued"
