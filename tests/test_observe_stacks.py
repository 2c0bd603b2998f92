"""distlaunch.observe.stacks and .group on real processes: py-spy reads four sleeping
Python processes, the grouping names the right function, file and line for each rank, and
an unreadable rank (exited, not Python, refused attach) becomes one line saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from distlaunch.observe import group as G
from distlaunch.observe import stacks as S

PROGRAM = textwrap.dedent(
    """\
    import sys, threading, time

    def helper():
        time.sleep(1000)  # HELPER

    def step():
        threading.Event().wait()  # STEP

    def load_batch():
        time.sleep(1000)  # LOAD

    def main(odd):
        threading.Thread(target=helper, name="helper", daemon=True).start()
        print("ready", flush=True)
        if odd:
            load_batch()  # MAIN_ODD
        else:
            step()  # MAIN_EVEN

    main(sys.argv[1] == "odd")  # ENTRY
    """
)


def line_of(tag: str) -> int:
    return next(i for i, ln in enumerate(PROGRAM.splitlines(), 1) if f"# {tag}" in ln)


@pytest.fixture
def ranks(tmp_path):
    """Four processes: ranks 0, 1, 3 wait in step(), rank 2 sleeps in load_batch()."""
    path = tmp_path / "train.py"
    path.write_text(PROGRAM)
    procs = {
        r: subprocess.Popen([sys.executable, str(path), "odd" if r == 2 else "even"], stdout=subprocess.PIPE)
        for r in range(4)
    }
    try:
        for p in procs.values():
            assert p.stdout.readline() == b"ready\n"
        yield {r: p.pid for r, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_dump_reads_every_thread_of_every_rank(ranks):
    got = S.dump_stacks(ranks, timeout=20)
    assert sorted(got) == [0, 1, 2, 3]
    for r, st in got.items():
        assert isinstance(st, S.RankStack), st
        assert st.pid == ranks[r]
        assert [t.main for t in st.threads] == [True, False], "main thread first, then the helper"
        assert st.threads[1].name == "helper"
        inner = st.threads[0].frames[0]
        if r == 2:
            assert (inner.file, inner.line) == ("train.py", line_of("LOAD"))
        else:  # in Event.wait's Condition.wait
            assert inner.file == "threading.py" and inner.name.endswith("wait"), inner


def test_groups_name_the_odd_rank_and_its_line(ranks):
    groups = G.group_stacks(S.dump_stacks(ranks, timeout=20))
    text = G.format_groups(
        groups,
        ops={0: "all_reduce #7, 3.2 s, waiting for rank 2", 1: "all_reduce #7, 3.2 s, waiting for rank 2"},
    )
    lines = text.splitlines()
    assert lines[0] == (
        f"ranks 0-1,3 (3): Event.wait <- step (train.py:{line_of('STEP')}) "
        f"<- main (train.py:{line_of('MAIN_EVEN')})"
        f" <- <module> (train.py:{line_of('ENTRY')})  "
        "[ranks 0-1 (2): all_reduce #7, 3.2 s, waiting for rank 2]"
    ), text
    assert lines[1].startswith(
        f"rank 2: load_batch (train.py:{line_of('LOAD')}) <- main (train.py:{line_of('MAIN_ODD')})"
    )
    assert lines[2].startswith(f'ranks 0-3 (4), thread "helper": helper (train.py:{line_of("HELPER")})')
    assert len(lines) == 3
    cause = G.hang_cause(groups, 300)
    assert cause == (
        f"hang: 3 of 4 ranks in Event.wait (train.py:{line_of('STEP')}) for 300 s; "
        f"rank 2 in load_batch at train.py:{line_of('LOAD')}"
    )


def test_full_stacks_and_native_frames(ranks):
    got = S.dump_stacks({2: ranks[2]}, native=True, timeout=20)
    frames = got[2].threads[0].frames
    assert any(f.native for f in frames), "--native adds C frames"
    text = G.format_groups(G.group_stacks(got, full=True), full=True)
    assert text.splitlines()[0] == "rank 2:"
    assert f"    load_batch (train.py:{line_of('LOAD')})" in text.splitlines()


def test_unreadable_ranks_say_why(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    shell = subprocess.Popen(["sleep", "30"])
    try:
        got = S.dump_stacks({0: gone.pid, 1: shell.pid}, timeout=20)
    finally:
        shell.kill()
        shell.wait()
    assert str(got[0]) == f"rank 0 (pid {gone.pid}): the process has exited"
    assert isinstance(got[1], S.StackError) and "not a Python process" in got[1].message
    cause = G.hang_cause(G.group_stacks(got), 5)
    assert cause.startswith("hang: no progress for 5.0 s; no rank's stack could be read; rank 0: the process")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_refused_attach_names_the_way_out():
    """A sampler without CAP_SYS_PTRACE is refused by the kernel on a non-dumpable target
    (as under YAMA scope 1 for a non-ancestor): the message says how to allow it."""
    target = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ctypes, time; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0); print(flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        target.stdout.readline()
        code = "from distlaunch.observe import stacks as S; "
        code += f"print(S.dump_stacks({{5: {target.pid}}}, timeout=20)[5])"
        drop = ["setpriv", "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace", "--"]
        out = subprocess.run(drop + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        target.kill()
        target.wait()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"rank 5 (pid {target.pid}): {S.REFUSED_HINT}"
    assert "ptrace_scope=0" in S.REFUSED_HINT and "CAP_SYS_PTRACE" in S.REFUSED_HINT


def test_allow_tracing_by_sets_the_yama_ptracer_where_there_is_yama():
    code = "import os; from distlaunch.observe import stacks as S; print(S.allow_tracing_by(os.getppid()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == str(S.ptrace_scope() is not None), out.stderr


def test_parse_dump_rejects_other_text():
    with pytest.raises(ValueError, match="not its JSON dump"):
        S.parse_dump(0, 1, b"Error: something")
    assert S.parse_dump(0, 1, b"[]").threads == ()


def test_a_sampler_past_its_timeout_is_killed_and_the_rank_goes_on(ranks):
    got = S.dump_stacks({1: ranks[1]}, timeout=0.001)
    assert str(got[1]) == f"rank 1 (pid {ranks[1]}): py-spy did not answer within 0.001 s"
    with open(f"/proc/{ranks[1]}/status") as f:  # running or sleeping, not (trace-)stopped
        state = next(ln.split()[1] for ln in f if ln.startswith("State:"))
    assert state not in ("T", "t"), f"the target is left stopped (state {state})"
    assert isinstance(S.dump_stacks({1: ranks[1]}, timeout=20)[1], S.RankStack)
