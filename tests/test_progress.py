"""distlaunch.progress: a worker's writes into its mapped record, read by another
process (the agent's Reader); a no-op outside distlaunch; importing distlaunch stays light."""

import os
import subprocess
import sys

from conftest import ROOT

from distlaunch import progress

WRITER = """
import sys, time
import distlaunch
from distlaunch import progress
for _ in range(5):
    distlaunch.heartbeat()
progress.begin("all_reduce", 1834, peers=[5, 7, 8])
print("in flight", flush=True)
sys.stdin.readline()
progress.waiting([7])
progress.end()
progress.begin("broadcast_with_a_name_longer_than_the_field_allows", 2)
print("second", flush=True)
sys.stdin.readline()
"""


def test_writer_and_reader_in_two_processes(tmp_path):
    path = str(tmp_path / "rec")
    progress.create(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    r = progress.Reader(path)
    assert r.read() == progress.Progress(0)
    env = dict(os.environ, **{progress.ENV: path}, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert p.stdout.readline() == "in flight\n"
        got = r.read()
        assert (got.count, got.op, got.seq, got.waiting) == (5, "all_reduce", 1834, "waiting for ranks 5,7-8")
        assert got.op_age is not None and 0 <= got.op_age < 30
        assert got.describe().startswith("all_reduce #1834, ")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "second\n"
        got = r.read()
        assert got.count == 6  # end() counts as progress
        assert got.op == "broadcast_with_a_name_longer_th" and got.seq == 2 and got.waiting == ""
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(30) == 0
    finally:
        p.kill()
        r.close()


def test_no_op_outside_distlaunch_and_light_import():
    code = (
        "import sys, distlaunch; distlaunch.heartbeat(); from distlaunch import progress; "
        "progress.begin('x', 1); progress.end(); "
        "print(sorted(m for m in sys.modules if m.startswith('distlaunch')))"
    )
    env = {k: v for k, v in os.environ.items() if k != progress.ENV}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    # (workerenv: the record's size and magic, shared with the launcher's fast lane)
    assert out.stdout.strip() == "['distlaunch', 'distlaunch.progress', 'distlaunch.workerenv']"
    # a file that is not a record (too short) leaves the calls no-ops too
    env[progress.ENV] = os.devnull
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
