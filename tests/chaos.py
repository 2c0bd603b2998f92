"""Chaos trials: start 2 nodes x 2 workers, inject one fault at a random moment, and check
that the job ends well within a bounded time: completed (with the expected restart
count) or exited non-zero saying why, with no process of the job left and no temporary
file or shared-memory segment left behind.

Modes: ``head`` (distlaunch run -H node1:2,node2:2 through a real sshd), ``pernode``
(two `distlaunch run --nnodes 2` launchers; node 0 hosts the store), ``dynamic`` (two
launchers with --rdzv-endpoint on a standalone `distlaunch store`). Faults:
kill_worker, stop_worker (SIGSTOP: its peers' collectives time out), kill_agent,
kill_head, cut_store (SIGKILL the standalone store), freeze_store (SIGSTOP it), and
term_rendezvous: SIGTERM to a launcher (the head in head mode) while the job forms: the
launchers start up to 2 s apart and the signal lands 0.3-2.5 s after the first start
(at least 0.3 s after the victim's), in start-up, while connecting to the store, in
rendezvous, or as the workers start. kill_guard: SIGKILL one agent's orphan guard (found
by its title) while the workers run: the job completes without a restart, one line says
so. shm_full: no fault injected; each launcher runs in its own mount namespace with a
1 MiB /dev/shm (``unshare --mount``): the job completes over TCP, one warning per node.

Every job process carries the trial's id in its initial environment, which is how
survivors are found: CHAOS_TRIAL=<id> (the workers get it through --env-all in head
mode), and an entry naming it on PYTHONPATH, the one variable a head-mode agent gets on
its SSH command line (the rest of its environment travels on stdin). Used by
tests/test_chaos.py and benchmarks/chaos.py.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "chaos_worker.py"
FAULTS = {
    "head": ("kill_worker", "stop_worker", "kill_agent", "kill_head", "term_rendezvous", "kill_guard"),
    "pernode": (
        "kill_worker",
        "stop_worker",
        "kill_agent",
        "kill_head",
        "term_rendezvous",
        "kill_guard",
        "shm_full",
    ),
    "dynamic": ("kill_worker", "cut_store", "freeze_store", "term_rendezvous", "shm_full"),
}
# each launcher in a private mount namespace with a 1 MiB /dev/shm (shm_full)
SMALL_SHM = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" "$@"']


def unshare_problem() -> str | None:
    """Why shm_full cannot run here (no unshare, or no mount in a namespace), or None."""
    try:
        cp = subprocess.run([*SMALL_SHM, "true"], capture_output=True, text=True)
    except OSError as e:
        return f"cannot run unshare: {e}"
    return None if cp.returncode == 0 else f"unshare --mount refused: {cp.stderr.strip()}"


WORK_SECONDS = 3.0  # what the job computes when nothing goes wrong
BOUND = 60.0  # a trial not over by then is a hang


@dataclass
class Outcome:
    mode: str
    fault: str
    delay: float
    delivered: bool = False  # the fault hit a live target
    codes: list = field(default_factory=list)  # exit codes of the launchers we started
    restarts: int | None = None  # restart count of a completed job
    hung: bool = False
    survivors: list = field(default_factory=list)
    leftovers: list = field(default_factory=list)
    detect_s: float | None = None  # fault -> the other workers of that round are gone
    recover_s: float | None = None  # fault -> a new round's 4 workers run (restart faults)
    clean_s: float | None = None  # fault -> no process of the job is left (others)
    end_s: float | None = None  # fault -> every launcher we started has exited
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _marker(trial: str) -> str:
    """A PYTHONPATH entry naming the trial (no such directory: Python skips it)."""
    return str(ROOT / f".chaos-{trial}")


def _leftovers(trial: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"distlaunch_{trial}_*")) + glob.glob(
        f"/dev/shm/*{trial}*"
    )


def job_processes(trial: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("CHAOS_TRIAL") == trial or _marker(trial) in env.get("PYTHONPATH", ""):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _workers(trial: str) -> list[psutil.Process]:
    """The job's workers (launchers name the worker script on their command line too)."""
    out = []
    for p in job_processes(trial):
        try:
            cmd = p.cmdline()
            if str(WORKER) in cmd and "distlaunch" not in cmd and "RANK" in p.environ():
                out.append(p)
        except psutil.Error:
            pass
    return out


def _launch(
    mode: str, trial: str, env: dict, sshd, join_timeout: float = 30
) -> tuple[list, subprocess.Popen | None]:
    """The job's launcher command lines, and its store (started) in dynamic mode."""
    common = [
        "--max-restarts",
        "1",
        "--stop-timeout",
        "2",
        "--run-id",
        trial,
        "--rdzv-conf",
        f"heartbeat_timeout=3,heartbeat_interval=0.3,join_timeout={join_timeout:g}",
    ]
    dl = [sys.executable, "-m", "distlaunch", "run"]
    work = [str(WORKER), str(WORK_SECONDS)]
    if mode == "head":
        return [
            dl + ["--ssh-config", sshd.ssh_config, "-H", "node1:2,node2:2", "--env-all", *common, *work]
        ], None
    port = free_port()
    if mode == "dynamic":
        store = subprocess.Popen(
            [sys.executable, "-m", "distlaunch", "store", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        store.stderr.readline()  # "listening": up before any launcher could bind the port
        return [
            dl
            + [
                "--nnodes",
                "2",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--nproc-per-node",
                "2",
                *common,
                *work,
            ]
            for _ in range(2)
        ], store
    return [
        dl
        + [
            "--nnodes",
            "2",
            "--node-rank",
            str(k),
            "--master-port",
            str(port),
            "--nproc-per-node",
            "2",
            *common,
            *work,
        ]
        for k in range(2)
    ], None


def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _start_and_term(cmds: list, env: dict, rng, delay: float):
    """term_rendezvous: start the launchers up to 2 s apart and SIGTERM one of them
    ``delay`` s after the first start, or 0.3 s after its own start if that is later.
    Returns (launchers, victim)."""
    t0 = time.monotonic()
    starts = [0.0] + [round(rng.uniform(0.0, 2.0), 2)] * (len(cmds) - 1)
    pick = rng.randrange(len(cmds))
    shoot = max(delay, starts[pick] + 0.3)
    procs, victim = [], None
    for at, what in sorted(
        [(t, k) for k, t in enumerate(starts)] + [(shoot, "term")], key=lambda e: (e[0], e[1] == "term")
    ):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        if what == "term":
            victim = psutil.Process(procs[pick].pid)
            victim.send_signal(signal.SIGTERM)
        else:
            procs.append(_spawn(cmds[what], env))
    return procs, victim


def _target(mode: str, fault: str, trial: str, procs: list, store, rng):
    """(process to hit, signal) for the fault, or (None, None) if it has no target now."""
    if fault in ("kill_worker", "stop_worker"):
        ws = _workers(trial)
        return (rng.choice(ws) if ws else None, signal.SIGKILL if fault == "kill_worker" else signal.SIGSTOP)
    if fault in ("cut_store", "freeze_store"):
        return psutil.Process(store.pid), signal.SIGKILL if fault == "cut_store" else signal.SIGSTOP
    if fault == "kill_head":
        return psutil.Process(procs[0].pid), signal.SIGKILL
    if fault == "kill_guard":
        guards = [p for p in job_processes(trial) if _cmdline(p).startswith("distlaunch guard for pid")]
        return (rng.choice(guards) if guards else None), signal.SIGKILL
    # kill_agent: node 1's launcher (pernode/dynamic) or the agent of node2 (head mode)
    if mode != "head":
        return psutil.Process(procs[1].pid), signal.SIGKILL
    for w in _workers(trial):
        try:
            if int(w.environ().get("GROUP_RANK", -1)) == 1:
                return psutil.Process(w.ppid()), signal.SIGKILL
        except psutil.Error:
            pass
    return None, None


def run_trial(mode: str, fault: str, rng, sshd=None) -> Outcome:
    trial = f"chaos{os.getpid()}x{rng.randrange(1 << 30)}"
    forming = fault == "term_rendezvous"
    delay = round(rng.uniform(0.3, 2.5) if forming else rng.uniform(0.3, WORK_SECONDS), 2)
    out = Outcome(mode, fault, delay)
    env = dict(
        os.environ,
        CHAOS_TRIAL=trial,
        PYTHONPATH=f"{ROOT}{os.pathsep}{_marker(trial)}",
        DISTLAUNCH_STORE_TOKEN=f"secret-{trial}",
    )  # shared by per-node launchers and store
    env.pop("OMP_NUM_THREADS", None)
    # A node whose peer was stopped before it joined waits join_timeout for it.
    cmds, store = _launch(mode, trial, env, sshd, join_timeout=10 if forming else 30)
    if fault == "shm_full":
        cmds = [SMALL_SHM + c for c in cmds]
    procs = []
    frozen = []
    try:
        if forming:
            procs, victim = _start_and_term(cmds, env, rng, delay)
            t_fault, sig = time.monotonic(), None
            out.delivered = True
        else:
            procs = [_spawn(c, env) for c in cmds]
            started = time.monotonic()
            while time.monotonic() - started < 30 and len(_workers(trial)) < 4:
                time.sleep(0.05)
            time.sleep(delay)
            victim, sig = (
                _target(mode, fault, trial, procs, store, rng) if fault != "shm_full" else (None, None)
            )
            out.delivered = fault == "shm_full"  # the condition holds from the start
            t_fault = time.monotonic()
        before = set()
        if victim is not None and sig is not None:
            try:
                before = {p.pid for p in _workers(trial)} - {victim.pid}
                victim.send_signal(sig)
                out.delivered = True
                if sig == signal.SIGSTOP:
                    frozen.append(victim)
            except psutil.NoSuchProcess:
                before = set()
        _watch(out, trial, procs, store, before, victim, t_fault)
        errs = []
        for p in procs:
            if p.poll() is None:  # still running at the bound: a hang
                out.hung = True
                out.problems.append(f"hang: a launcher still ran {BOUND:.0f} s after the fault")
                p.kill()
            errs.append(p.communicate()[1])
            out.codes.append(p.returncode)
        _judge(out, errs)
    finally:
        for p in frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass
        end = time.monotonic() + 10
        while time.monotonic() < end and job_processes(trial):
            time.sleep(0.1)
        for p in job_processes(trial):
            if store is None or p.pid != store.pid:
                out.survivors.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            p.kill()
        if store is not None:
            store.kill()
            store.wait()
        out.leftovers = _leftovers(trial)
    if out.survivors:
        out.problems.append(f"{len(out.survivors)} survivor(s): {out.survivors[:3]}")
    if out.leftovers:
        out.problems.append(f"left behind: {out.leftovers[:3]}")
    return out


def _watch(out: Outcome, trial: str, procs: list, store, before: set, victim, t_fault: float) -> None:
    """Until every launcher exited and no job process is left (at most BOUND s): note
    when the round's other workers were gone (detect), when a new round's workers all
    ran (recover), when no job process was left (clean), and when the launchers we
    started had exited (end)."""
    old = set(before) | ({victim.pid} if victim is not None else set())
    while time.monotonic() - t_fault < BOUND:
        now = round(time.monotonic() - t_fault, 2)
        workers = {p.pid for p in _workers(trial)}
        if out.detect_s is None and out.delivered and not (before & workers):
            out.detect_s = now
        if out.recover_s is None and len(workers - old) >= 4:
            out.recover_s = now
        if out.clean_s is None and not [
            p for p in job_processes(trial) if store is None or p.pid != store.pid
        ]:
            out.clean_s = now
        if out.end_s is None and all(p.poll() is not None for p in procs):
            out.end_s = now
        if out.end_s is not None and out.clean_s is not None:
            return
        time.sleep(0.05)


def _judge(out: Outcome, errs: list[str]) -> None:
    """A trial ends well: every launcher that survived the fault either completed (0)
    or exited non-zero saying why (a root cause or a lost node / store)."""
    if out.hung:
        return
    for code, err in zip(out.codes, errs):
        if code == -signal.SIGKILL:  # the launcher we killed
            continue
        if code == -signal.SIGTERM and out.fault == "term_rendezvous":
            continue  # signalled before Python installed its handlers: nothing had started
        if code == 0:
            m = re.findall(r"succeeded after (\d+) restart", err or "")
            out.restarts = int(m[-1]) if m else 0
        elif not re.search(
            r"root cause|was lost|lost the store|stopped by signal|gave up waiting"
            r"|could not connect|nodes arrived within",
            err or "",
        ):
            out.problems.append(f"exit {code} without a reason: {(err or '').strip()[-300:]}")
    if out.fault in ("kill_guard", "shm_full") and out.delivered:
        if not all(c == 0 for c in out.codes) or out.restarts:
            out.problems.append(f"{out.fault}: the job did not complete without a restart: {out.codes}")
        said = "\n".join(errs).count("orphan guard" if out.fault == "kill_guard" else "cannot hold a")
        if said != (1 if out.fault == "kill_guard" else len(errs)):
            out.problems.append(f"{out.fault}: said {said} times (one line per guard / per node expected)")
    if out.fault == "term_rendezvous" and 0 in out.codes:
        out.problems.append("a launcher completed the job although one was stopped while it formed")
    if out.fault in ("kill_worker", "stop_worker") and out.delivered:
        if out.codes and all(c == 0 for c in out.codes) and out.restarts != 1:
            # a fault that landed after the workers finished needs no restart
            if out.restarts != 0:
                out.problems.append(f"completed with {out.restarts} restarts, expected 1")
