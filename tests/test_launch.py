"""distlaunch run on one node: environment, arguments and output, with real workers."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, dl

from distlaunch import quick

TORCHRUN_NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
]


# Variable families that send the command line to click (PET_*, TORCH*, DISTLAUNCH_*) or
# the fast lane to the full path (SLURM_*)
NOT_NARROW = ("PET_", "TORCH", "DISTLAUNCH_", "SLURM_")


def narrow_env() -> dict[str, str]:
    """This environment without NOT_NARROW's families: the narrow form takes a command
    line there, and its fast lane the job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(NOT_NARROW)}


def load_envs(d, n):
    return [json.loads((d / f"{r}.json").read_text()) for r in range(n)]


def test_environment_contract(actor, tmp_path):
    env = dict(os.environ, SLURM_PROCID="7", RANK="99", PMIX_RANK="3")
    env.pop("OMP_NUM_THREADS", None)
    res = dl(
        "run",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "2",
        "--run-id",
        "job42",
        actor,
        "--dump-env",
        tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    envs = load_envs(tmp_path, 3)
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1
    for r, e in enumerate(envs):
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
            str(r),
            str(r),
            "3",
            "3",
        )
        assert (e["GROUP_RANK"], e["GROUP_WORLD_SIZE"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == (
            "0",
            "1",
            str(r),
            "3",
        )
        assert e["ROLE_NAME"] == "default"
        assert e["TORCHELASTIC_RUN_ID"] == e["DISTLAUNCH_RUN_ID"] == "job42"
        assert (e["TORCHELASTIC_RESTART_COUNT"], e["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "2")
        assert e["MASTER_ADDR"] == "localhost"
        # MPI-style names mirror the torchrun ones; PMIX_* and stale SLURM_* are removed.
        assert (e["OMPI_COMM_WORLD_RANK"], e["PMI_RANK"], e["OMPI_COMM_WORLD_SIZE"], e["PMI_SIZE"]) == (
            str(r),
            str(r),
            "3",
            "3",
        )
        assert (e["OMPI_COMM_WORLD_LOCAL_RANK"], e["MPI_LOCALRANKID"], e["MPI_LOCALNRANKS"]) == (
            str(r),
            str(r),
            "3",
        )
        assert "SLURM_PROCID" not in e and "PMIX_RANK" not in e and "PMI_FD" not in e
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["DISTLAUNCH_STORE_PORT"].isdigit() and len(e["DISTLAUNCH_STORE_TOKEN"]) >= 16
        # Each worker leads its own session (so its process group is its own).
        assert e["_sid"] == e["_pid"]
    # The announced MASTER_PORT is free for the program: rank 0 can bind it.
    assert "OMP_NUM_THREADS=1" in res.stderr


def test_omp_num_threads_kept_when_set(actor, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="3")
    res = dl("run", "--nproc-per-node", "2", actor, "--dump-env", tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert {e["OMP_NUM_THREADS"] for e in load_envs(tmp_path, 2)} == {"3"}
    assert "OMP_NUM_THREADS" not in res.stderr


def _run_with_cpus(cpus, *args):
    """distlaunch under a restricted CPU affinity (like taskset -c CPUS)."""
    return subprocess.run(
        [sys.executable, "-m", "distlaunch", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )


def test_cpu_binding(actor, tmp_path):
    # at most 4 CPUs for the launcher, so the oversubscribed case stays small anywhere
    allowed = sorted(os.sched_getaffinity(0))[:4]
    for d in ("auto", "over", "none"):
        (tmp_path / d).mkdir()
    # auto: one block of CPUs per worker, disjoint, covering what the launcher may use
    res = _run_with_cpus(allowed, "run", "--nproc-per-node", 2, actor, "--dump-env", tmp_path / "auto")
    assert res.returncode == 0, res.stderr
    sets = [e["_cpus"] for e in load_envs(tmp_path / "auto", 2)]
    if len(allowed) > 1:
        assert not set(sets[0]) & set(sets[1]) and sorted(sets[0] + sets[1]) == allowed
        assert abs(len(sets[0]) - len(sets[1])) <= 1
    # more workers than CPUs: one CPU each, round robin (every CPU carries workers)
    n = len(allowed) + 2
    res = _run_with_cpus(allowed, "run", "--nproc-per-node", n, actor, "--dump-env", tmp_path / "over")
    assert res.returncode == 0, res.stderr
    sets = [e["_cpus"] for e in load_envs(tmp_path / "over", n)]
    assert all(len(c) == 1 for c in sets) and sorted({c[0] for c in sets}) == allowed
    # none: the launcher's own affinity, untouched
    res = _run_with_cpus(
        allowed, "run", "--nproc-per-node", 2, "--bind-to", "none", actor, "--dump-env", tmp_path / "none"
    )
    assert res.returncode == 0, res.stderr
    assert [e["_cpus"] for e in load_envs(tmp_path / "none", 2)] == [allowed, allowed]


def test_cpu_binding_honours_the_launchers_affinity(actor, tmp_path):
    last = max(os.sched_getaffinity(0))
    res = _run_with_cpus(
        {last}, "run", "--nproc-per-node", 2, "--bind-to", "core", actor, "--dump-env", tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert [e["_cpus"] for e in load_envs(tmp_path, 2)] == [[last], [last]]


def test_script_arguments_pass_untouched(actor, tmp_path):
    args = ["--dump-env", str(tmp_path), "--lr", "0.1", "--help", "-m", "x", "--nproc-per-node", "9"]
    # argparse in the actor would choke on unknown options: parse_known_args is not used, so
    # use a script that only records argv.
    script = tmp_path / "argv.py"
    script.write_text(
        "import sys, json, os\n"
        f"open(os.path.join({str(tmp_path)!r}, 'argv' + os.environ['RANK']), 'w')"
        ".write(json.dumps(sys.argv[1:]))\n"
    )
    res = dl("run", "--nproc-per-node", "2", script, *args)
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert json.loads((tmp_path / f"argv{r}").read_text()) == args


def test_output_whole_lines_prefixed(actor):
    res = dl("run", "--nproc-per-node", "4", actor, "--lines", "200")
    assert res.returncode == 0, res.stderr
    out_re = re.compile(r"\[(\d)\]: line (\d+) of rank (\d) x* end (\d+)")
    seen = {r: [] for r in range(4)}
    for line in res.stdout.splitlines():
        m = out_re.fullmatch(line)
        assert m, f"mixed or broken line: {line!r}"
        assert m.group(1) == m.group(3) and m.group(2) == m.group(4)
        seen[int(m.group(1))].append(int(m.group(2)))
    # Every line of every rank, in order per rank.
    assert all(v == list(range(200)) for v in seen.values()), {k: len(v) for k, v in seen.items()}
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("[")]
    assert len(err) == 800 and all(re.fullmatch(r"\[(\d)\]: err \d+ of rank \1", ln) for ln in err)


def test_no_prefix(actor):
    res = dl("run", "--nproc-per-node", "2", "--no-prefix", actor, "--lines", "3")
    assert res.returncode == 0
    assert sorted(res.stdout.splitlines())[0].startswith("line 0 of rank")
    assert not any(ln.startswith("[") for ln in res.stdout.splitlines())


def test_last_line_without_newline_is_kept(tmp_path):
    script = tmp_path / "nonl.py"
    script.write_text("import sys, os; sys.stdout.write('tail-' + os.environ['RANK'])\n")
    res = dl("run", "--nproc-per-node", "2", script)
    assert sorted(res.stdout.splitlines()) == ["[0]: tail-0", "[1]: tail-1"]


def test_local_ranks_filter(actor):
    res = dl("run", "--nproc-per-node", "3", "--local-ranks-filter", "1", actor, "--lines", "5")
    assert res.returncode == 0
    assert {ln[:4] for ln in res.stdout.splitlines()} == {"[1]:"}
    assert len(res.stdout.splitlines()) == 5


def test_log_dir_per_attempt_and_rank(actor, tmp_path):
    logs = tmp_path / "logs"
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--run-id",
        "r1",
        "--log-dir",
        logs,
        actor,
        "--lines",
        "3",
        "--fail-rank",
        "1",
        "--fail-attempts",
        "1",
    )
    assert res.returncode == 0, res.stderr
    # Every rank of every attempt has its files; rank 1 prints before failing, and in the
    # last attempt every rank runs to the end (in attempt 0, rank 0 may be stopped first).
    for attempt, rank in ((0, 1), (1, 0), (1, 1)):
        d = logs / "r1" / f"attempt_{attempt}" / str(rank)
        out = (d / "stdout.log").read_text().splitlines()
        assert out == [f"line {i} of rank {rank} {'x' * (i % 50)} end {i}" for i in range(3)]
    assert all(
        (logs / "r1" / f"attempt_{a}" / str(r) / f).exists()
        for a in (0, 1)
        for r in (0, 1)
        for f in ("stdout.log", "stderr.log")
    )
    assert "failing on purpose" in (logs / "r1" / "attempt_0" / "1" / "stderr.log").read_text()
    assert "failing on purpose" not in (logs / "r1" / "attempt_1" / "1" / "stderr.log").read_text()


def test_redirects_keep_console_clean(actor, tmp_path):
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--redirects",
        "3",
        "--log-dir",
        tmp_path,
        "--run-id",
        "q",
        actor,
        "--lines",
        "2",
    )
    assert res.returncode == 0
    assert res.stdout == "" and "[0]" not in res.stderr
    assert "line 1 of rank 1" in (tmp_path / "q" / "attempt_0" / "1" / "stdout.log").read_text()


def test_module_and_no_python(tmp_path):
    pkg = tmp_path / "mymod.py"
    pkg.write_text("import os; print('module rank', os.environ['RANK'])\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    res = dl("run", "--nproc-per-node", "2", "-m", "mymod", env=env)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0]: module rank 0", "[1]: module rank 1"]
    res = dl("run", "--nproc-per-node", "2", "--no-python", "sh", "-c", "echo sh $RANK/$WORLD_SIZE")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0]: sh 0/2", "[1]: sh 1/2"]


def test_underscore_spellings(actor, tmp_path):
    res = dl("run", "--nproc_per_node", "2", "--max_restarts", "0", actor, "--dump-env", tmp_path)
    assert res.returncode == 0, res.stderr
    assert load_envs(tmp_path, 2)[1]["WORLD_SIZE"] == "2"


def test_nproc_per_node_cpu(actor, tmp_path):
    res = dl("run", "--nproc-per-node", "cpu", actor, "--dump-env", tmp_path)
    assert res.returncode == 0, res.stderr
    n = os.cpu_count()
    assert load_envs(tmp_path, n)[0]["WORLD_SIZE"] == str(n)


def test_store_announced_to_workers(tmp_path):
    script = tmp_path / "store_user.py"
    script.write_text(
        "import os\n"
        "from distlaunch.store import StoreClient\n"
        "c = StoreClient(os.environ['DISTLAUNCH_STORE_ADDR'], int(os.environ['DISTLAUNCH_STORE_PORT']),\n"
        "                token=os.environ['DISTLAUNCH_STORE_TOKEN'], timeout=20)\n"
        "n = c.add('arrived', 1)\n"
        "c.set('rank' + os.environ['RANK'], os.environ['RANK'])\n"
        "c.wait(['rank%d' % r for r in range(int(os.environ['WORLD_SIZE']))])\n"
        "print('seen', sorted(c.get('rank%d' % r).decode() for r in range(int(os.environ['WORLD_SIZE']))), c.add('arrived', 0))\n"  # noqa: E501
    )
    res = dl("run", "--nproc-per-node", "3", script)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{r}]: seen ['0', '1', '2'] 3" for r in range(3)]


def test_store_rejects_wrong_token(tmp_path):
    script = tmp_path / "bad_token.py"
    script.write_text(
        "import os, sys\n"
        "from distlaunch.store import StoreClient\n"
        "from distlaunch.errors import StoreAuthError\n"
        "try:\n"
        "    StoreClient(os.environ['DISTLAUNCH_STORE_ADDR'], int(os.environ['DISTLAUNCH_STORE_PORT']),\n"
        "                token='not-the-secret', timeout=5).set('k', b'v')\n"
        "except StoreAuthError:\n"
        "    sys.exit(0)\n"
        "sys.exit(9)\n"
    )
    assert dl("run", script).returncode == 0


# What must not be loaded when a single node's first worker is spawned (the agent's
# rendezvous, observer, events, the store's server loop), and what a short successful
# job never loads (psutil: the observer's first publish is a second in; py-spy's lookup:
# a failure's; GPU discovery: a restart's GPU release wait, a publish's device column).
AFTER_SPAWN = {
    "distlaunch.agent.node",
    "distlaunch.rendezvous",
    "distlaunch.events",
    "distlaunch.agent.observer",
    "distlaunch.store.server",
}
NEVER_IN_SHORT_JOB = {
    "psutil",
    "distlaunch.observe.stacks",
    "distlaunch.observe.records",
    "distlaunch.devices",
}
# What the narrow form of `run` (preparse.py) does not load before its first spawn: click
# and the CLI, a worker failure's records, GPU discovery, -x/--env-file shipping.
NOT_BEFORE_SPAWN_NARROW = {
    "click",
    "distlaunch.cli",
    "distlaunch.rounds",
    "distlaunch.devices",
    "distlaunch.remote.command",
    "json",
    "yaml",
}


def probe_run(probe: str, arg: str, script: str, site: bool = True) -> subprocess.CompletedProcess:
    """``python -c probe arg run --nproc-per-node 2 script`` without the variables that
    send `run` to click (the narrow form's probes); ``site=False``: with ``-S`` (no
    site-packages: the package comes from the checkout, the working directory)."""
    env = narrow_env()
    python = [sys.executable] if site else [sys.executable, "-S"]
    cmd = [*python, "-c", probe, arg, "run", "--nproc-per-node", "2", script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


IMPORT_PROBE = """
import os, sys

me, seen = os.getpid(), {}
def note():
    if os.getpid() == me:
        seen.setdefault("spawn", sorted(sys.modules))
if sys.argv[1] == "cli":  # click's path spawns with subprocess
    import subprocess
    spawn = subprocess.Popen._execute_child
    def execute_child(self, *a, **k):
        note()
        return spawn(self, *a, **k)
    subprocess.Popen._execute_child = execute_child
else:  # the narrow form's fast lane (quick.py) with os.posix_spawn
    pspawn = os.posix_spawn
    def posix_spawn(*a, **k):
        note()
        return pspawn(*a, **k)
    os.posix_spawn = posix_spawn
leave = os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        seen["exit"] = sorted(sys.modules)
        import json  # not before: it is one of the modules checked
        print("MODULES " + json.dumps(seen), flush=True)
    leave(code)
os._exit = exit_
if sys.argv[1] == "cli":  # click's path
    from distlaunch.cli import main
    main(sys.argv[2:])
else:  # python -m distlaunch / the console script: the pre-parser first
    from distlaunch.__main__ import main
    sys.argv[1:] = sys.argv[2:]
    main()
"""
# What the fast lane (quick.py) spawns without: the standard library's heavier modules
# (checked in an interpreter without site, whose imports would hide them) and our
# config, modes, environment tables and dataclass-built records.
NOT_BEFORE_FAST_SPAWN = {
    "typing",
    "dataclasses",
    "inspect",
    "socket",
    "subprocess",
    "tempfile",
    "contextlib",
    "threading",
    "shutil",
    "distlaunch.config",
    "distlaunch.modes",
    "distlaunch.env",
    "distlaunch.topology",
    "distlaunch.command",
    "distlaunch.launcher",
    "distlaunch.agent.specs",
    "distlaunch.agent.group",
}


@pytest.mark.parametrize("entry", ["cli", "main"])
def test_single_node_spawns_before_the_agent_is_imported(tmp_path, entry):
    """The first worker of a single node is spawned before the agent's rendezvous,
    observer, events and the store's loop are imported (they load while the workers'
    interpreters start), with its output prefixed from its first line; psutil and
    py-spy's lookup are never loaded by a short job that succeeds. Through the entry
    point, the narrow form of `run` spawns before click (and the rest of
    NOT_BEFORE_SPAWN_NARROW) is imported, and never imports click."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    res = probe_run(IMPORT_PROBE, entry, str(script), site=entry == "cli")
    assert res.returncode == 0, res.stderr
    assert sorted(ln for ln in res.stdout.splitlines() if "hello" in ln) == [
        "[0]: hello from 0",
        "[1]: hello from 1",
    ]
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("MODULES "))
    seen = {k: set(v) for k, v in json.loads(line[len("MODULES ") :]).items()}
    assert not AFTER_SPAWN & seen["spawn"], sorted(AFTER_SPAWN & seen["spawn"])
    assert not NEVER_IN_SHORT_JOB & seen["exit"], sorted(NEVER_IN_SHORT_JOB & seen["exit"])
    if entry == "cli":
        assert AFTER_SPAWN <= seen["exit"]  # the agent did run the job
    else:  # the fast lane: its agent is built only if the job outlasts its imports
        early = NOT_BEFORE_SPAWN_NARROW | NOT_BEFORE_FAST_SPAWN
        assert not early & seen["spawn"], sorted(early & seen["spawn"])
        assert "click" not in seen["exit"] and "distlaunch.quick" in seen["exit"]


GC_PROBE = """
import gc, os, subprocess, sys

me, seen = os.getpid(), {}
spawn = subprocess.Popen._execute_child
def execute_child(self, *a, **k):
    seen.setdefault("spawn", gc.isenabled())
    return spawn(self, *a, **k)
subprocess.Popen._execute_child = execute_child
pspawn = os.posix_spawn  # the narrow form's fast lane (quick.py)
def posix_spawn(*a, **k):
    seen.setdefault("spawn", gc.isenabled())
    return pspawn(*a, **k)
os.posix_spawn = posix_spawn
leave = os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        print("GC", seen["spawn"], gc.isenabled(), gc.get_freeze_count() > 0, flush=True)
    leave(code)
os._exit = exit_
if sys.argv[1] == "off":  # the user's own choice, which the launcher keeps
    gc.disable()
if sys.argv[1] == "cli":  # click's path
    from distlaunch.cli import main
    main(sys.argv[2:])
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


@pytest.mark.parametrize("before", ["on", "off", "cli"])
def test_narrow_run_starts_without_the_collector_and_supervises_with_it(tmp_path, before):
    """`run` (the narrow form, and click's path: "cli") spawns its workers with the
    cyclic garbage collector paused (start-up makes no garbage worth its ~5 ms) and has
    it on again, with start-up's objects frozen, once it supervises them; a collector
    that was off before stays off."""
    script = tmp_path / "hello.py"
    # it outlasts the fast lane's imports: the launcher supervises it (quick.py)
    script.write_text("import time\ntime.sleep(1)\nprint('hello')\n")
    res = probe_run(GC_PROBE, before, str(script))
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("GC "))
    assert line == ("GC False False False" if before == "off" else "GC False True True"), line


@pytest.mark.parametrize("args", [["--dry-run"], ["--nproc-per-node", "0"]], ids=["dry-run", "bad-value"])
def test_run_invoked_in_process_leaves_the_collector_on(tmp_path, args):
    """A caller that invokes `run` in-process (click's runner: tests, tools) goes on with
    the collector on, also where the command ends before it supervises workers (a plan
    shown, a usage error)."""
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    prog = (
        "import gc, sys\n"
        "from click.testing import CliRunner\n"
        "from distlaunch import cli\n"
        "res = CliRunner().invoke(cli.cli, ['run', *sys.argv[2:], sys.argv[1]])\n"
        "print('EXIT', res.exit_code, 'GC', gc.isenabled())\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", prog, str(script), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("EXIT"))
    assert line.startswith("EXIT 0 ") == (args == ["--dry-run"]), line  # the bad value is refused
    assert line.endswith("GC True"), line


FAILING_STORE = """
import os, sys, time
from distlaunch.cli import main
from distlaunch.errors import RendezvousError, StoreError
from distlaunch.store import server

def written(rank):
    try:
        return open(os.path.join(sys.argv[-1], rank)).read()
    except OSError:
        return ""

def both_run():  # both workers wrote their pid files
    end = time.monotonic() + 20
    while not (written("0") and written("1")) and time.monotonic() < end:
        time.sleep(0.01)

def start(self, listener=None):  # the store fails once both workers run
    both_run()
    raise StoreError("injected: the store cannot start")

class Rendezvous:  # the agent fails before it runs the early group
    def __init__(self, *a, **k):
        both_run()
        raise RendezvousError("injected: the agent cannot join")

if os.environ.get("FAIL_IN") == "agent":
    from distlaunch.agent import node
    node.Rendezvous = Rendezvous
else:
    server.StoreServer.start = start
main(sys.argv[1:])
"""


def test_workers_started_early_are_stopped_when_the_launcher_fails_before_supervising(tmp_path):
    """A single node's workers run before its store's loop and agent start: when one of
    those fails, the launcher stops the workers it started (none is left running), says
    one line and exits 1."""
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", FAILING_STORE, "run", "--nproc-per-node", "2", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert res.returncode == 1, res.stderr
    assert [ln for ln in res.stderr.splitlines() if "error:" in ln] == [
        "distlaunch: error: injected: the store cannot start"
    ], res.stderr
    pids = [int((tmp_path / r).read_text()) for r in "01"]  # both ran before the failure
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} still runs after the launcher exited")


@pytest.mark.parametrize("fail_in", ["store", "agent"])
def test_workers_started_early_get_the_stop_grace_when_the_store_or_agent_fails(tmp_path, fail_in):
    """When the store or the agent fails after a single node's early spawn, its workers
    are stopped as
    the agent stops a group, not killed: SIGTERM to their process groups (rank 0 traps
    it, says so and exits), --stop-timeout's grace, then SIGKILL (rank 1 ignores
    SIGTERM); what they printed, before and during the stop, is read and printed with
    their prefixes (review finding: SIGKILL at once, unread output dropped)."""
    script = tmp_path / "trap.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "rank = os.environ['RANK']\n"
        "def bye(*_):\n"
        "    print('rank', rank, 'got SIGTERM', flush=True)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye if rank == '0' else signal.SIG_IGN)\n"
        "print('rank', rank, 'ready', flush=True)\n"
        "open(os.path.join(sys.argv[1], rank), 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", FAILING_STORE, "run", "--nproc-per-node", "2", "--stop-timeout", "1"]
        + [str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, FAIL_IN=fail_in),
    )
    assert res.returncode == 1, res.stderr
    assert f"distlaunch: error: injected: the {fail_in} cannot" in res.stderr, res.stderr
    assert sorted(res.stdout.splitlines()) == [
        "[0]: rank 0 got SIGTERM",
        "[0]: rank 0 ready",
        "[1]: rank 1 ready",
    ], res.stdout
    for pid in [int((tmp_path / r).read_text()) for r in "01"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_python_without_pidfd_open_supervises_by_polling(tmp_path):
    """Some CPython builds have no os.pidfd_open (AttributeError, not OSError): the
    launcher and its guard fall back to polling; a clean run and a failing rank are both
    reported as with pidfds (review finding: the launch died with a traceback)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\ndel os.pidfd_open\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", str(ROOT))]))
    hello = tmp_path / "hello.py"
    hello.write_text("import os\nprint('hi', os.environ['RANK'])\n")
    ok = dl("run", "--nproc-per-node", "2", hello, env=env)
    assert ok.returncode == 0, ok.stderr
    assert sorted(ok.stdout.splitlines()) == ["[0]: hi 0", "[1]: hi 1"]
    assert "Traceback" not in ok.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    res = dl("run", "--nproc-per-node", "2", bad, env=env)
    assert res.returncode == 3, res.stderr
    assert "Traceback" not in res.stderr and "rank 1" in res.stderr, res.stderr


SLEEPER = """
import os, sys, time
tmp = os.path.join(sys.argv[1], f".pid.{os.environ['RANK']}")  # renamed: never read empty
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("thread", [True, False], ids=["imports-on-thread", "imports-on-main"])
@pytest.mark.parametrize("delay", [0.0, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5])
def test_sigterm_right_after_start_leaves_nothing(tmp_path, delay, thread):
    """SIGTERM to the launcher of the narrow form at any moment of its start (before,
    during and after the fast lane's spawns, around its hand-over to the launcher): it
    ends with 128+15 and says why (or, before its handlers exist, dies of the signal
    having started nothing), and leaves no worker running and no scratch directory;
    with the full path imported on the fast lane's thread (started at once) or at the
    hand-over (its thread waits 30 s)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    env = narrow_env()
    probe = pinned(IMPORT_PATHS[thread])
    cmd = [sys.executable, "-c", probe, "x", "run", "--nproc-per-node", "2", str(script), str(pids)]
    p = subprocess.Popen(
        cmd,
        env={**env, "TMPDIR": str(tmp)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    if p.returncode == -signal.SIGTERM:  # before the relay was installed
        assert not os.listdir(pids)
    else:
        assert p.returncode == 128 + signal.SIGTERM, err
        assert "stopped by signal 15" in err, err
        if not thread:  # (on the thread: it may come before the thread starts)
            assert "IMPORT THREAD False" in out.splitlines(), out
    for name in os.listdir(pids):
        if not name.startswith("."):  # (a worker stopped before its rename)
            assert not _alive(int((pids / name).read_text())), name
    assert os.listdir(tmp) == []


# When the fast lane's thread starts importing the full path, against its last spawn and
# the CPU this interpreter's own start took (its first line: before any of distlaunch).
IMPORT_START_PROBE = """
import json, os, sys, threading, time
start_cpu, me, seen = time.process_time(), os.getpid(), {}
pspawn = os.posix_spawn
def posix_spawn(*a, **k):
    pid = pspawn(*a, **k)
    seen["spawned"] = time.monotonic()
    return pid
os.posix_spawn = posix_spawn
thread_start = threading.Thread.start
def start(self):
    if self.name == "distlaunch-imports":
        seen["imports"] = time.monotonic()
    thread_start(self)
threading.Thread.start = start
import distlaunch.quick as quick
delay_of = quick.Early.import_delay
def import_delay(self, start_cpu):
    seen["delay"] = delay_of(self, start_cpu)
    return seen["delay"]
quick.Early.import_delay = import_delay
leave = os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        print("SEEN " + json.dumps({**seen, "start_cpu": start_cpu}), flush=True)
    leave(code)
os._exit = exit_
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


def test_the_full_path_is_imported_once_the_workers_have_started(tmp_path):
    """The fast lane imports the full path (~40 ms of CPU) only once its workers have
    had the time an interpreter's start takes (this launcher's own start, measured), not
    beside their starts, where it would take a CPU from them; a job that outlasts that
    is then handed over to the launcher as before (its output, exit 0). Nor much later
    than that: at most MAX_IMPORT_DELAY (plus a loaded machine's slack)."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\ntime.sleep(2.0)\nprint('done', os.environ['RANK'])\n")
    res = probe_run(IMPORT_START_PROBE, "x", str(script))
    assert res.returncode == 0, res.stderr
    assert sorted(ln for ln in res.stdout.splitlines() if "done" in ln) == ["[0]: done 0", "[1]: done 1"]
    seen = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("SEEN "))[5:])
    assert "imports" in seen, seen  # the job outlasted the delay: the thread did import
    waited = seen["imports"] - seen["spawned"]
    assert waited >= min(seen["start_cpu"], quick.MAX_IMPORT_DELAY), seen
    # and not far later: the delay it computed (bounded), plus a loaded machine's slack
    assert seen["delay"] <= quick.MAX_IMPORT_DELAY, seen
    assert waited <= seen["delay"] + 1.0, seen  # (the job outlasts that: it runs 2 s)


def pinned(delay: float, probe: str = "") -> str:
    """A probe whose fast lane imports the full path ``delay`` seconds after its spawns
    (``quick.import_delay`` pinned: the path a test takes is not left to timing) and
    prints at the launcher's exit whether its import thread ever started, then runs
    ``probe`` (the launcher's main, if empty; its arguments from argv[2:])."""
    return f"""
import os, threading
import distlaunch.quick as quick
quick.MAX_IMPORT_DELAY, quick.START_MARGIN = {delay!r}, 1e9
pin_me, pin_started, pin_start, pin_leave = os.getpid(), [], threading.Thread.start, os._exit
def pin_record(self):
    pin_started.append(self.name)
    pin_start(self)
threading.Thread.start = pin_record
def pin_exit(code):
    if os.getpid() == pin_me:  # not the forked guard
        print("IMPORT THREAD " + str("distlaunch-imports" in pin_started), flush=True)
    pin_leave(code)
os._exit = pin_exit
""" + (probe or LAUNCH)


LAUNCH = """
import sys
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""
# The fast lane's imports wait 30 s: what ends a job sooner is not that delay.
SLOW_IMPORTS_PROBE = pinned(30.0)
# the fast lane's import thread: started at once (True), or never (False: a 30 s delay)
IMPORT_PATHS = {True: 0.0, False: 30.0}

# Rank 1 fails at once, rank 0 runs on (its pid in argv[1]).
ONE_FAILS = """
import os, sys, time
tmp = os.path.join(sys.argv[1], f".pid.{os.environ['RANK']}")  # renamed: never read empty
with open(tmp, "w") as f:
    f.write(str(os.getpid()))
os.rename(tmp, os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"))
if os.environ["RANK"] == "1":
    sys.exit(3)
time.sleep(60)
"""


def _within_the_delay(tmp_path, program: str) -> tuple:
    """A 2-worker launch of ``program`` through SLOW_IMPORTS_PROBE (the fast lane's
    imports due 30 s on): its command, environment, pid directory and $TMPDIR."""
    script, pids, tmp = tmp_path / "w.py", tmp_path / "pids", tmp_path / "tmp"
    script.write_text(program)
    pids.mkdir()
    tmp.mkdir()
    cmd = [sys.executable, "-c", SLOW_IMPORTS_PROBE, "x", "run", "--nproc-per-node", "2"]
    cmd += [str(script), str(pids)]
    return cmd, {**narrow_env(), "TMPDIR": str(tmp)}, pids, tmp


def test_a_failure_within_the_import_delay_hands_over_at_once(tmp_path):
    """A worker failing before the fast lane's imports were due (30 s on) hands the job
    over at once, the full path imported on the main thread (the import thread never
    started): the failed rank is the root cause, its exit code the job's, the other
    worker is stopped, no scratch directory is left."""
    cmd, env, pids, tmp = _within_the_delay(tmp_path, ONE_FAILS)
    began = time.monotonic()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - began
    assert res.returncode == 3, res.stderr
    assert re.search(r"rank 1 \(local rank 1\).*exit code 3", res.stderr), res.stderr
    assert "IMPORT THREAD False" in res.stdout.splitlines(), res.stdout
    assert took < 15.0, (took, res.stderr)  # (not the 30 s delay: generous for a loaded machine)
    for name in os.listdir(pids):
        if not name.startswith("."):  # (a worker stopped before its rename)
            assert not _alive(int((pids / name).read_text())), name
    assert os.listdir(tmp) == []


def test_a_stop_signal_within_the_import_delay_hands_over_at_once(tmp_path):
    """SIGTERM to the launcher while its workers run, before the fast lane's imports were
    due (30 s on): the job is handed over at once, the full path imported on the main
    thread (the import thread never started), and ends with 128+15 saying why, no
    worker left running and no scratch directory."""
    cmd, env, pids, tmp = _within_the_delay(tmp_path, SLEEPER)
    began = time.monotonic()
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(pids / "pid.0", pids / "pid.1")
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    took = time.monotonic() - began
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal 15" in err, err
    assert "IMPORT THREAD False" in out.splitlines(), out
    assert took < 15.0, (took, err)  # (not the 30 s delay: generous for a loaded machine)
    for name in os.listdir(pids):
        if not name.startswith("."):  # (a worker stopped before its rename)
            assert not _alive(int((pids / name).read_text())), name
    assert os.listdir(tmp) == []


STORE_USER = """
import os
from distlaunch.store import StoreClient
rank, port = os.environ["RANK"], int(os.environ["DISTLAUNCH_STORE_PORT"])
with StoreClient(os.environ["DISTLAUNCH_STORE_ADDR"], port, timeout=60) as c:
    c.set("rank" + rank, rank.encode())
    c.wait(["rank0", "rank1"])
print("stored", rank)
"""


def test_a_worker_at_the_store_starts_the_full_path_at_once(tmp_path):
    """A worker that connects to the job's store before the fast lane's imports were due
    (here: 30 s on) has them start at once: the store is served as soon as the full path
    can take it over, not once the workers should have started."""
    script = tmp_path / "store_user.py"
    script.write_text(STORE_USER)
    began = time.monotonic()
    res = probe_run(SLOW_IMPORTS_PROBE, "x", str(script))
    took = time.monotonic() - began
    assert res.returncode == 0, res.stderr
    stored = sorted(ln for ln in res.stdout.splitlines() if "stored" in ln)
    assert stored == ["[0]: stored 0", "[1]: stored 1"], res.stdout
    assert took < 15.0, (took, res.stderr)  # (not the 30 s delay: generous for a loaded machine)
    assert "IMPORT THREAD True" in res.stdout.splitlines(), res.stdout


# Holds the fast lane's imports of the full path (quick.wait's thread, started at once)
# until a file exists,
# so that a test can act while the workers run and the launcher has not taken them over.
HOLD_PROBE = pinned(  # (the imports start at once: on the thread)
    0.0,
    """
import os, sys, time
hold = sys.argv[1]
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "distlaunch.command":
            while not os.path.exists(hold):
                time.sleep(0.005)
        return None
sys.meta_path.insert(0, Hold())
"""
    + LAUNCH,
)

COUNT_TERMS = """
import os, signal, sys, time
d, rank = sys.argv[1], os.environ["RANK"]
seen = []
def on_term(signum, frame):
    seen.append(time.monotonic())
    with open(os.path.join(d, f"term.{rank}"), "a") as f:
        f.write("x")
signal.signal(signal.SIGTERM, on_term)
open(os.path.join(d, f"up.{rank}"), "w").close()
while not seen or time.monotonic() < seen[0] + 1.0:  # a second SIGTERM would come by then
    time.sleep(0.02)
sys.exit(143)
"""


@contextlib.contextmanager
def _held_launch(tmp_path, program: str):
    """The narrow form's launcher of 2 workers running ``program`` (their argument: a
    marks directory), with the fast lane's imports of the full path held until the
    yielded ``hold`` file exists (touched, and the launcher killed if still running, at
    the end). Yields (the launcher's Popen, stderr piped; marks; hold)."""
    script, marks, hold = tmp_path / "worker.py", tmp_path / "marks", tmp_path / "hold"
    script.write_text(program)
    marks.mkdir()
    env = narrow_env()
    cmd = [sys.executable, "-c", HOLD_PROBE, str(hold), "run", "--nproc-per-node", "2"]
    p = subprocess.Popen(
        [*cmd, str(script), str(marks)], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        yield p, marks, hold
    finally:
        hold.touch()
        if p.poll() is None:
            p.kill()


def _wait_for(*paths, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < end, [p for p in paths if not os.path.exists(p)]
        time.sleep(0.01)


def test_a_stop_signal_during_the_hand_over_reaches_each_worker_once(tmp_path):
    """SIGTERM to the narrow form's launcher while its fast lane's workers run and the
    full path is still being imported: the relay forwards it to each worker then, and
    the launcher that takes them over does not send it again (as click's path: once)."""
    with _held_launch(tmp_path, COUNT_TERMS) as (p, marks, hold):
        _wait_for(marks / "up.0", marks / "up.1")
        p.send_signal(signal.SIGTERM)
        _wait_for(marks / "term.0", marks / "term.1")  # forwarded by the fast lane's relay
        hold.touch()  # the imports go on: the launcher takes the workers over
        _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert [(marks / f"term.{r}").read_text() for r in range(2)] == ["x", "x"], err


# Rank 1 fails at once; rank 0 fails later (as a peer's loss would end it), once told to.
FAIL_IN_TURN = """
import os, sys, time
d, rank = sys.argv[1], os.environ["RANK"]
if rank == "1":
    open(os.path.join(d, "gone.1"), "w").close()
    sys.exit(3)
while not os.path.exists(os.path.join(d, "go")):
    time.sleep(0.005)
open(os.path.join(d, "gone.0"), "w").close()
sys.exit(5)
"""


def test_two_failures_before_the_take_over_name_the_first_as_the_root_cause(tmp_path):
    """Both workers fail while the full path is still being imported, rank 1 first: the
    launcher that takes them over finds both exits already there, and names the one the
    fast lane saw first (its exit code the job's), not the lower rank."""
    with _held_launch(tmp_path, FAIL_IN_TURN) as (p, marks, hold):
        _wait_for(marks / "gone.1")
        time.sleep(1.0)  # rank 1 has exited, and the fast lane has seen it (exits seen
        # in one poll have no order to tell, so rank 0 must exit well after)
        (marks / "go").touch()
        _wait_for(marks / "gone.0")
        time.sleep(0.3)  # rank 0 has exited too
        hold.touch()
        _, err = p.communicate(timeout=60)
    assert p.returncode == 3, err
    assert re.search(r"rank 1 \(local rank 1\).*exit code 3", err), err


# Lists $TMPDIR as the launcher exits (os._exit: nothing after it runs), before its guard
# can notice it is gone; "fail": the full path fails (a ConfigError) once the fast lane
# has handed its running workers over.
EXIT_PROBE = """
import os, sys
me, tmp = os.getpid(), os.environ["TMPDIR"]
leave = os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        print("LEFT " + repr(sorted(os.listdir(tmp))), flush=True)
    leave(code)
os._exit = exit_
if sys.argv[1] == "fail":
    import distlaunch.command as command
    from distlaunch.errors import ConfigError
    def run_parsed(*a, **k):
        raise ConfigError("injected")
    command.run_parsed = run_parsed
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


@pytest.mark.parametrize("case", ["missing", "fail"])
def test_an_error_before_the_hand_over_leaves_no_scratch(tmp_path, case):
    """The narrow form ending with an error before its launcher took the fast lane's
    workers over (a script that is not there; an error on the full path) removes its
    scratch directory itself before it exits (not left to its guard) and leaves no
    worker running."""
    script, pids, tmp = tmp_path / "sleeper.py", tmp_path / "pids", tmp_path / "tmp"
    script.write_text(SLEEPER)
    pids.mkdir()
    tmp.mkdir()
    target = str(tmp_path / "missing.py") if case == "missing" else str(script)
    env = narrow_env()
    cmd = [sys.executable, "-c", EXIT_PROBE, case, "run", "--nproc-per-node", "2", target, str(pids)]
    res = subprocess.run(
        cmd, env={**env, "TMPDIR": str(tmp)}, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2, res.stderr
    assert ("not found" if case == "missing" else "injected") in res.stderr, res.stderr
    assert "LEFT []" in res.stdout.splitlines(), res.stdout
    for name in os.listdir(pids):
        if not name.startswith("."):  # (a worker stopped before its rename)
            assert not _alive(int((pids / name).read_text())), name


# SIGTERM to the launcher itself as its fast lane finds its last worker exited with 0
# (quick.wait's peek): the signal and the last exit come together. The full path's
# imports wait for that (on the thread, or on the main thread at the hand-over).
TERM_AT_LAST_EXIT = """
import os, signal, sys, time
me, peeks, waitid = os.getpid(), [], os.waitid
def peek(*a):
    info = waitid(*a)
    if os.getpid() == me and a[2] & os.WNOWAIT:
        peeks.append(info)
        if len(peeks) == 2:
            os.kill(me, signal.SIGTERM)
    return info
os.waitid = peek
class Hold:
    def find_spec(self, name, path=None, target=None):
        while name == "distlaunch.command" and len(peeks) < 2:
            time.sleep(0.005)
sys.meta_path.insert(0, Hold())
"""


@pytest.mark.parametrize("thread", [True, False], ids=["imports-on-thread", "imports-on-main"])
def test_a_stop_signal_with_the_last_exit_stops_the_job(tmp_path, thread):
    """A stop signal that comes as the fast lane sees its last worker exit with 0 is not
    lost: the job ends with 128+N, as the launcher ends it (not 0), whether the full
    path was being imported on the lane's thread or is imported at the hand-over."""
    script = tmp_path / "ok.py"
    script.write_text("print('done')\n")
    res = probe_run(pinned(IMPORT_PATHS[thread], TERM_AT_LAST_EXIT + LAUNCH), "unused", str(script))
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert "stopped by signal 15" in res.stderr, res.stderr
    assert f"IMPORT THREAD {thread}" in res.stdout.splitlines(), res.stdout


# The launcher's WorkerGroup.start fails as it takes over the fast lane's workers.
START_FAILS_PROBE = """
import sys
import distlaunch.agent.group as group
def start(self, started=None):
    raise RuntimeError("injected")
group.WorkerGroup.start = start
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


def test_a_failed_take_over_closes_each_descriptor_once(tmp_path):
    """The launcher failing to take the fast lane's workers over kills them and closes
    their pipes and pidfds once (the adopted file objects own them from the adoption:
    no descriptor closed twice), and leaves no scratch directory."""
    script, pids, tmp = tmp_path / "sleeper.py", tmp_path / "pids", tmp_path / "tmp"
    script.write_text(SLEEPER)
    pids.mkdir()
    tmp.mkdir()
    env = narrow_env()
    cmd = [sys.executable, "-X", "dev", "-c", START_FAILS_PROBE, "x", "run", "--nproc-per-node", "2"]
    res = subprocess.run(
        [*cmd, str(script), str(pids)],
        env={**env, "TMPDIR": str(tmp)},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "RuntimeError: injected" in res.stderr, res.stderr
    assert "Bad file descriptor" not in res.stderr, res.stderr
    assert os.listdir(tmp) == []
    for name in os.listdir(pids):
        if not name.startswith("."):  # (a worker stopped before its rename)
            assert not _alive(int((pids / name).read_text())), name


# os.posix_spawn without setsid support (NotImplementedError, as on an old libc).
NO_SETSID_PROBE = """
import os, sys
spawn = os.posix_spawn
def posix_spawn(*a, **k):
    if k.get("setsid"):
        raise NotImplementedError("setsid")
    return spawn(*a, **k)
os.posix_spawn = posix_spawn
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


def test_a_posix_spawn_without_setsid_goes_the_full_path(tmp_path):
    """Where os.posix_spawn cannot start a session the fast lane declines and the
    launcher runs the job as usual (no traceback; its notice said once)."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    res = probe_run(NO_SETSID_PROBE, "x", str(script))
    assert res.returncode == 0, res.stderr
    assert sorted(ln for ln in res.stdout.splitlines() if "hello" in ln) == [
        "[0]: hello from 0",
        "[1]: hello from 1",
    ]
    assert res.stderr.count("setting OMP_NUM_THREADS=1") == 1, res.stderr


# The full path's imports never finish (its first module waits for ever; the launcher
# and the take-over are never loaded): a job this launcher ends is ended by the fast
# lane. At exit (before its guard could clean up): which of those loaded, $TMPDIR's
# entries, the workers' segments left.
FAST_END_PROBE = """
import importlib.util, json, os, sys, time
me, marks, tmp = os.getpid(), sys.argv[1], os.environ["TMPDIR"]
class Never:  # (it waits in exec_module: find_spec runs under the global import lock)
    def find_spec(self, name, path=None, target=None):
        if name == "distlaunch.command":
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        while True:
            time.sleep(1)
sys.meta_path.insert(0, Never())
leave = os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        prefixes = [open(os.path.join(marks, n)).read() for n in os.listdir(marks)]
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(tuple(prefixes))]
        full = [m for m in ("distlaunch.launcher", "distlaunch.agent.specs") if m in sys.modules]
        print("END " + json.dumps({"full": full, "tmp": os.listdir(tmp), "shm": shm, "n": len(prefixes)}))
    leave(code)
os._exit = exit_
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""

SEGMENT = """
import os, sys
prefix = os.environ["DISTLAUNCH_SHM_PREFIX"]
open(os.path.join("/dev/shm", prefix + "seg" + os.environ["RANK"]), "w").close()
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as f:
    f.write(prefix)
print("made", os.environ["RANK"])
"""


def test_a_short_job_ends_in_the_fast_lane_and_leaves_nothing(tmp_path):
    """Workers that exit 0 before the full path is imported end the job in the fast
    lane (the full path never loaded: its import here never returns), with their
    output, exit 0, and no scratch directory or shared-memory segment left as the
    launcher exits (not left to the guard)."""
    script, marks, tmp = tmp_path / "segment.py", tmp_path / "marks", tmp_path / "tmp"
    script.write_text(SEGMENT)
    marks.mkdir()
    tmp.mkdir()
    env = narrow_env()
    cmd = [
        sys.executable,
        "-c",
        FAST_END_PROBE,
        str(marks),
        "run",
        "--nproc-per-node",
        "2",
        str(script),
        str(marks),
    ]
    res = subprocess.run(
        cmd, env={**env, "TMPDIR": str(tmp)}, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert sorted(ln for ln in res.stdout.splitlines() if "made" in ln) == ["[0]: made 0", "[1]: made 1"]
    end = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("END "))[4:])
    assert end == {"full": [], "tmp": [], "shm": [], "n": 2}, end


# The launcher's take-over of the fast lane's workers fails (as adopt_first_round does
# when a worker was not started as the launcher would start it) once both workers made a
# segment; at exit: the workers' segments left.
REFUSED_TAKEOVER = """
import json, os, sys, time
marks = sys.argv[1]
from distlaunch.agent import specs
from distlaunch.errors import SpawnError
def refuse(*a, **k):
    end = time.monotonic() + 30
    while len(os.listdir(marks)) < 2 and time.monotonic() < end:
        time.sleep(0.01)
    raise SpawnError("injected: cannot take the workers over")
specs.adopt_first_round = refuse
me, leave = os.getpid(), os._exit
def exit_(code):
    if os.getpid() == me:  # not the forked guard
        prefixes = [open(os.path.join(marks, n)).read() for n in os.listdir(marks)]
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(tuple(prefixes))]
        print("END " + json.dumps({"shm": shm, "n": len(prefixes)}), flush=True)
    leave(code)
os._exit = exit_
from distlaunch.__main__ import main
sys.argv[1:] = sys.argv[2:]
main()
"""


def test_workers_the_launcher_cannot_take_over_leave_no_segment(tmp_path):
    """Workers the fast lane started and the launcher could not take over are undone
    (``Started.abandon``) with their shared-memory segments, as a round's end removes
    them (they were left in /dev/shm: the guard, told to quit, removes nothing); the
    launcher says why in one line and exits 1."""
    script, marks = tmp_path / "segment.py", tmp_path / "marks"
    script.write_text(SEGMENT + "import time\ntime.sleep(60)\n")
    marks.mkdir()
    cmd = [sys.executable, "-c", REFUSED_TAKEOVER, str(marks), "run", "--nproc-per-node", "2", script, marks]
    res = subprocess.run(cmd, env=narrow_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert "distlaunch: error: injected: cannot take the workers over" in res.stderr.splitlines(), res.stderr
    end = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("END "))[4:])
    assert end == {"shm": [], "n": 2}, end


@pytest.mark.parametrize("case", ["ok", "fails", "launcher-killed"])
def test_scratch_is_removed_under_a_tmpdir_with_glob_characters(tmp_path, case):
    """$TMPDIR is the user's, and may hold glob's special characters: the scratch
    directory under it is removed as the path it is (review finding: the fast lane's
    end, the agent's and the guard's took it as a glob pattern that named nothing, and
    left it), whether the job ends in the fast lane, through the launcher, or with the
    launcher killed (its guard removes it)."""
    tmp = tmp_path / "t[1]*?"
    tmp.mkdir()
    mark = tmp_path / "started"
    script = tmp_path / "w.py"
    body = {"ok": "pass", "fails": "sys.exit(3)", "launcher-killed": "time.sleep(60)"}[case]
    script.write_text(f"import pathlib, sys, time\npathlib.Path({str(mark)!r}).write_text('x')\n{body}\n")
    p = subprocess.Popen(
        [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "1", str(script)],
        env={**os.environ, "TMPDIR": str(tmp)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if case == "launcher-killed":
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), "the worker did not start"
        p.kill()
    out, err = p.communicate(timeout=60)
    assert p.returncode == {"ok": 0, "fails": 3, "launcher-killed": -signal.SIGKILL}[case], err
    deadline = time.monotonic() + 20  # (the guard removes it once it sees the launcher gone)
    while os.listdir(tmp) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.listdir(tmp), os.listdir(tmp)
