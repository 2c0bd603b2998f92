"""`distlaunch ps`, `top` and `stacks` against a running 4-worker job: the agent publishes
its ranks' records and answers stack requests through the job's store; the viewer finds
the job in the per-user registry (XDG_RUNTIME_DIR is a test directory here)."""

import json
import os
import socket
import stat
import time

from conftest import ROOT, dl, dl_popen, line_of

W = ROOT / "tests" / "hang_workers"


def start_job(env, run_id):
    p = dl_popen("run", "--nproc-per-node", "4", "--run-id", run_id, W / "plain.py", "one_exits", env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the first publish: one second after the workers start
        res = dl("top", run_id, "--json", env=env)
        if res.returncode == 0:
            recs = json.loads(res.stdout)
            # rank 3 exited, the others printed, and rank 1 marked its operation
            up = all(r["line"] == f"rank {r['rank']} up" for r in recs[:3])
            if len(recs) == 4 and recs[3]["state"] == "exited 0" and up and recs[1]["op"]:
                return p
        time.sleep(0.3)
    p.kill()
    raise AssertionError(f"job {run_id} did not publish its records: {res.stderr}")


def test_ps_top_stacks_of_a_running_job(tmp_path):
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    none = dl("top", "--once", env=env)
    assert none.returncode == 2 and "no distlaunch job of yours" in none.stderr
    assert len(none.stderr.strip().splitlines()) == 1
    p = start_job(env, "topjob")
    try:
        jobs = tmp_path / "distlaunch" / "jobs" / socket.gethostname()  # a home may be shared
        (entry,) = jobs.iterdir()
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600  # it holds the store's token
        assert stat.S_IMODE(jobs.stat().st_mode) == 0o700

        ps = dl("ps", env=env)
        assert ps.returncode == 0 and ps.stdout.startswith("topjob  started ") and "world size 4" in ps.stdout

        res = dl("top", "--once", "--json", env=env)  # one job: no run id needed
        assert res.returncode == 0, res.stderr
        recs = json.loads(res.stdout)
        assert [r["rank"] for r in recs] == [0, 1, 2, 3]
        assert [r["state"] for r in recs] == ["running"] * 3 + ["exited 0"]
        for r in recs[:3]:
            os.kill(r["pid"], 0)  # the pids are the live workers
            assert r["rss"] > 0 and r["line"] == f"rank {r['rank']} up"
        # rank 1's operation in flight (distlaunch.progress), the others have none
        assert recs[1]["op"] == "all_reduce #7, waiting for rank 2" and recs[1]["op_age"] >= 0
        assert recs[0]["op"] is None and recs[2]["op"] is None

        table = dl("top", "--once", env=env)
        assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == [
            "RANK",
            "NODE",
            "PID",
            "STATE",
        ]
        assert len(table.stdout.splitlines()) == 5

        st = dl("stacks", env=env)
        assert st.returncode == 0, st.stderr
        prog = W / "plain.py"
        wait = f"ranks 0-1 (2): wait_here (plain.py:{line_of(prog, 'WAIT-LINE')}) <- <module> (plain.py:"
        assert wait in st.stdout, st.stdout
        assert "[rank 1: all_reduce #7, " in st.stdout and "waiting for rank 2]" in st.stdout
        assert f"rank 2: stuck_here (plain.py:{line_of(prog, 'STUCK-LINE')})" in st.stdout
        assert "rank 3" not in st.stdout  # exited: nothing to read

        # a second job: the viewer wants a run id, and names both in one line
        p2 = start_job(env, "otherjob")
        try:
            two = dl("top", "--once", env=env)
            assert two.returncode == 2 and "topjob" in two.stderr and "otherjob" in two.stderr
            assert len(two.stderr.strip().splitlines()) == 1
            assert len(dl("ps", env=env).stdout.splitlines()) == 2
        finally:
            p2.terminate()
            p2.wait(30)
    finally:
        p.terminate()
        p.wait(30)
    # the agent removed its entry as it ended
    assert not any(jobs.iterdir())


def test_top_shows_the_runtimes_operation_in_flight(tmp_path):
    """Ranks waiting in distlaunch.collectives' all_reduce show it in `top` (the runtime
    marks each operation it runs), the rank that never called it shows none."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    # without --stacks-on-failure and --hang-timeout too: top reads the records anyway
    opts = ("--nproc-per-node", "3", "--run-id", "colljob", "--no-stacks-on-failure")
    p = dl_popen("run", *opts, W / "coll_wait.py", env=env)
    try:
        deadline, recs = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            res = dl("top", "colljob", "--json", env=env)
            recs = json.loads(res.stdout) if res.returncode == 0 else []
            if len(recs) == 3 and all(r["op"] for r in recs[:2]):
                break
            time.sleep(0.3)
        assert [r["rank"] for r in recs] == [0, 1, 2], recs
        for r in recs[:2]:
            assert r["op"].startswith("all_reduce #") and r["op_age"] >= 0, recs
        assert recs[2]["op"] is None and recs[2]["state"] == "running", recs
        # --native adds C frames: rank 2's time.sleep shows, and the others' own line stays
        py, native = dl("stacks", "colljob", env=env), dl("stacks", "colljob", "--native", env=env)
        assert "rank 2: <module> (coll_wait.py:" in py.stdout, py.stdout + py.stderr
        assert "rank 2: time_sleep <- <module> (coll_wait.py:" in native.stdout, native.stdout + native.stderr
        assert "ranks 0-1 (2): all_reduce <- <module> (coll_wait.py:" in native.stdout, native.stdout
    finally:
        p.terminate()
        p.wait(30)


def test_another_hosts_entries_in_a_shared_home_are_left_alone(tmp_path, monkeypatch):
    """A home directory shared by the nodes holds every host's entries: a reader on this
    host neither lists nor removes another host's (its pids mean nothing here)."""
    import socket as sock

    from distlaunch.observe import registry

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    here = sock.gethostname()
    registry.write_entry(registry.JobEntry("job", os.getpid(), time.time(), here, 1, "127.0.0.1", 1, "t"))
    monkeypatch.setattr(sock, "gethostname", lambda: "another-host")  # that host writes its entry
    gone = registry.JobEntry("job2", 4000000, time.time(), "x", 1, "127.0.0.1", 1, "t")
    theirs = registry.write_entry(gone)
    monkeypatch.setattr(sock, "gethostname", lambda: here)
    assert list(registry.running_jobs()) == ["job"]
    assert os.path.exists(theirs)  # its pid is not alive here, but it is not this host's


def test_an_mpi_recv_deadlock_is_shown_waiting_for_its_source(tmp_path):
    """A distlaunch.mpi rank blocked in Recv shows the receive (source, tag) in `top`
    and its Recv line in `stacks`."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    prog = W / "mpi_recv.py"
    p = dl_popen("run", "--nproc-per-node", "2", "--run-id", "mpijob", prog, env=env)
    try:
        deadline, recs = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            res = dl("top", "mpijob", "--json", env=env)
            recs = json.loads(res.stdout) if res.returncode == 0 else []
            if len(recs) == 2 and recs[0]["op"]:
                break
            time.sleep(0.3)
        assert recs and recs[0]["op"] == "MPI, receive from rank 1 (tag 5)", recs
        assert recs[1]["op"] is None, recs
        st = dl("stacks", "mpijob", env=env)
        assert f"rank 0: Comm.Recv <- <module> (mpi_recv.py:{line_of(prog, 'RECV-LINE')})" in st.stdout, (
            st.stdout
        )
    finally:
        p.terminate()
        p.wait(30)
