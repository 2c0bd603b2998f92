"""A real two-node Slurm cluster on this machine for the Slurm tests.

Use it by importing the fixture into a test module (a helper module, not a conftest)::

    from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

    def test_x(slurm_cluster):
        out = slurm_cluster.run("srun", "-N2", "hostname")

What runs (Debian's ``slurm-wlm`` and ``munge``, ``apt-get install -y slurm-wlm munge``):
``munged`` with its own key, socket, pid, log and seed files in a temporary directory (so it
never meets a system munged), ``slurmctld`` and two ``slurmd -N n1`` / ``slurmd -N n2``,
all in the foreground. Both nodes have ``NodeAddr=127.0.0.1`` on their own port and
declare ``CPUs=4`` (``SlurmdParameters=config_overrides``: the machine has fewer), so a
4-task step fits on one node. ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/
none``, no accounting, state and spool in the temporary directory, ``KillWait=5``
(seconds between SIGTERM and SIGKILL at ``scancel`` or the time limit; Slurm's default is
30), ``MinJobAge=600`` (ended jobs stay visible to ``scontrol show job``).

The daemons run under one supervisor process (this file run as a script): it is a child
subreaper, so the ``slurmstepd`` processes that slurmd detaches, and every task they
start, stay its descendants; at the end of the session (or when pytest dies: parent-death
signal) it stops the daemons and SIGKILLs every remaining descendant by pid, so no
slurmctld, slurmd, munged, slurmstepd or task survives. The tests are skipped (with the
reason) when the packages are missing, when not root, or when the cluster does not come
up within 30 s.

The client tools (``srun``, ``salloc``, ``sbatch``, ``scancel``, ``scontrol``, ``sinfo``)
find the cluster through ``SLURM_CONF`` (``SlurmCluster.env``), which the supervisor also
exports to the daemons.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ports import free_ports

NODES = ("n1", "n2")
CPUS_PER_NODE = 4
KILL_WAIT = 5  # s; slurm.conf KillWait
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "scancel", "scontrol", "sinfo", "squeue")
START_TIMEOUT = 30.0

# Job states after which a job no longer runs (squeue(1) "JOB STATE CODES").
ENDED_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


@dataclass
class SlurmCluster:
    """What the ``slurm_cluster`` fixture yields."""

    dir: Path  # the temporary directory holding configuration, state, spool and logs
    conf: Path  # slurm.conf
    nodes: tuple[str, ...]  # ("n1", "n2"), in Slurm's node order
    cpus_per_node: int
    kill_wait: int  # s between SIGTERM and SIGKILL at scancel / time limit
    version: str  # "22.05.8"
    process: subprocess.Popen = field(repr=False, default=None)  # the supervisor

    def env(self, base: dict | None = None, **extra: str) -> dict:
        """An environment for a Slurm client: ``base`` (default os.environ) without any
        inherited ``SLURM_*`` job variable, plus ``SLURM_CONF`` and ``extra``."""
        src = os.environ if base is None else base
        env = {k: v for k, v in src.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(
        self,
        tool: str,
        *args: str,
        timeout: float = 60,
        input: str | None = None,
        env: dict | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run the client ``tool`` (srun, sbatch, ...) against this cluster to completion;
        stdout/stderr as text. A run past ``timeout`` fails the test with what it printed
        and the daemons' log tails."""
        try:
            cp = subprocess.run(
                [tool, *map(str, args)],
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                env=self.env() if env is None else env,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                f"{tool} {' '.join(map(str, args))} still ran after {timeout} s\n"
                f"--- stdout ---\n{_text(e.stdout)[-3000:]}\n--- stderr ---\n{_text(e.stderr)[-3000:]}\n"
                f"{self.log_tails()}"
            ) from None
        if check and cp.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(map(str, args))} exited {cp.returncode}:\n{cp.stderr}")
        return cp

    def popen(self, tool: str, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
        """Start the client ``tool`` without waiting (stdout/stderr piped, text)."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return subprocess.Popen([tool, *map(str, args)], env=self.env() if env is None else env, **kw)

    def sbatch(self, script: str, *args: str, env: dict | None = None) -> int:
        """Submit ``script`` (its text, ``#!`` line included) with ``sbatch --parsable``;
        returns the job id."""
        cp = self.run("sbatch", "--parsable", *args, input=script, env=env, check=True)
        return int(cp.stdout.strip().split(";")[0])

    def scancel(self, job_id: int, *args: str) -> None:
        self.run("scancel", *args, str(job_id), check=True)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o JOB`` as a dict (JobState, ExitCode, NodeList, ...);
        empty when Slurm does not know the job."""
        cp = self.run("scontrol", "show", "job", "-o", str(job_id))
        if cp.returncode != 0:
            return {}
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", cp.stdout))

    def wait_job_end(self, job_id: int, timeout: float = 60) -> dict[str, str]:
        """Wait until job ``job_id`` ended (a state of ENDED_STATES); returns its
        ``job()`` record. Raises AssertionError at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in ENDED_STATES:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout} s")
            time.sleep(0.1)

    def hostnames(self, hostlist: str) -> list[str]:
        """``scontrol show hostnames HOSTLIST``: Slurm's own expansion."""
        cp = self.run("scontrol", "show", "hostnames", "--", hostlist, check=True)
        return cp.stdout.split()

    def log_tails(self, n: int = 1500) -> str:
        """The end of every daemon's log, for failure messages."""
        parts = []
        for log in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-n:]}")
        return "\n".join(parts)

    def daemon_pids(self) -> list[int]:
        """Pids of every process below the supervisor (daemons, slurmstepd, tasks)."""
        return descendants(self.process.pid) if self.process is not None else []


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""


def version() -> str | None:
    """The installed Slurm version (``slurmd -V``), or None."""
    if shutil.which("slurmd") is None:
        return None
    try:
        out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.split()[-1] if out.split() else None


def skip_reason() -> str | None:
    for tool in ("munged", "slurmctld", "slurmd", *CLIENTS):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not installed (apt-get install -y slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd, which must start jobs as their user; run them as root"
    return None


def first_job_id() -> int:
    """Where this pytest worker's cluster starts numbering jobs. Workers that srun starts
    derive their store port from the job id (env.SLURM_PORTS: 16 * job + step, mod 6000),
    and the clusters of concurrent xdist workers all counting from 1 derived the same
    port at once; blocks of 90 ids are disjoint mod 375 for four workers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 1 + 90 * (int(worker[2:] or 0) % 4)


def write_config(base: Path, host: str) -> Path:
    """Write slurm.conf and a fresh munge key under ``base``; returns slurm.conf's path.
    Keys as documented by slurm.conf(5) of Slurm 22.05."""
    base.mkdir(parents=True, exist_ok=True)
    (base / "state").mkdir(exist_ok=True)
    key = base / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_bytes(1024))
    os.close(fd)
    ctld_port, *node_ports = free_ports(1 + len(NODES))
    lines = [
        "ClusterName=distlaunch-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={base / 'munge.sock'}",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool-%n'}",
        f"SlurmctldPidFile={base / 'slurmctld.pid'}",
        f"SlurmdPidFile={base / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={base / 'slurmctld.log'}",
        f"SlurmdLogFile={base / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SwitchType=switch/none",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        f"KillWait={KILL_WAIT}",
        "MinJobAge=600",
        f"FirstJobId={first_job_id()}",
        "InactiveLimit=0",
        "SlurmdTimeout=300",
        *(
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for n, p in zip(NODES, node_ports)
        ),
        f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]
    conf = base / "slurm.conf"
    conf.write_text("\n".join(lines))
    return conf


def start(base: Path) -> SlurmCluster:
    """Configure and start the cluster under ``base``; wait until both nodes are idle.
    Raises RuntimeError (with the logs) when it does not come up in START_TIMEOUT s."""
    host = socket.gethostname().split(".")[0]
    conf = write_config(base, host)
    log = open(base / "supervisor.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, __file__, str(base)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    log.close()
    cluster = SlurmCluster(base, conf, NODES, CPUS_PER_NODE, KILL_WAIT, version() or "?", proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the Slurm supervisor exited with {proc.returncode}\n{cluster.log_tails()}"
                )
            cp = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                capture_output=True,
                text=True,
                env=cluster.env(),
                timeout=30,
            )
            states = dict(line.split() for line in cp.stdout.splitlines() if len(line.split()) == 2)
            if cp.returncode == 0 and all(states.get(n) in ("idle", "mix", "alloc") for n in NODES):
                return cluster
            if time.monotonic() > deadline:
                seen = cp.stdout.strip() or cp.stderr.strip()
                raise RuntimeError(
                    f"Slurm nodes not idle after {START_TIMEOUT:g} s (sinfo: {seen})\n{cluster.log_tails()}"
                )
            time.sleep(0.1)
    except BaseException:
        stop(cluster)
        raise


def stop(cluster: SlurmCluster) -> None:
    """Stop the supervisor, which stops the daemons and kills every descendant left."""
    proc = cluster.process
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(KILL_WAIT + 15)
        except subprocess.TimeoutExpired:  # supervisor stuck: kill what it supervised ourselves
            for pid in descendants(proc.pid):
                _kill(pid)
            proc.kill()
            proc.wait(10)


# --- the supervisor (this file run as a script) ------------------------------------------


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), parents before children."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def supervise(base: Path) -> None:
    """Run munged, slurmctld and one slurmd per node in the foreground as a child
    subreaper; on SIGTERM (or the parent's death) stop them and kill every descendant."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: detached slurmstepd stay ours
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG: pytest killed -> we clean up
    stopping = False

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(base / "slurm.conf")
    sock = base / "munge.sock"
    daemons = [
        subprocess.Popen(
            [
                shutil.which("munged") or "/usr/sbin/munged",
                "-F",
                "--force",
                f"--socket={sock}",
                f"--key-file={base / 'munge.key'}",
                f"--pid-file={base / 'munged.pid'}",
                f"--log-file={base / 'munged.log'}",
                f"--seed-file={base / 'munged.seed'}",
            ],
            env=env,
        )
    ]
    deadline = time.monotonic() + 10
    while not sock.exists() and time.monotonic() < deadline and daemons[0].poll() is None:
        time.sleep(0.02)
    daemons.append(
        subprocess.Popen([shutil.which("slurmctld") or "/usr/sbin/slurmctld", "-D", "-i"], env=env)
    )
    for node in NODES:
        daemons.append(
            subprocess.Popen([shutil.which("slurmd") or "/usr/sbin/slurmd", "-D", "-N", node], env=env)
        )
    while not stopping:
        _reap()
        if any(d.poll() is not None for d in daemons):
            print(f"a daemon exited: {[d.args[0] for d in daemons if d.poll() is not None]}", flush=True)
            break
        time.sleep(0.2)
    for d in reversed(daemons):  # slurmd first, munged last
        if d.poll() is None:
            d.terminate()
    end = time.monotonic() + 5
    while time.monotonic() < end and any(d.poll() is None for d in daemons):
        _reap()
        time.sleep(0.05)
    # Whatever is left (daemons that ignored SIGTERM, slurmstepd, tasks and their
    # orphans, all reparented to us) is killed by pid until nothing remains.
    end = time.monotonic() + 10
    while time.monotonic() < end:
        left = descendants(os.getpid())
        if not left:
            break
        for pid in left:
            _kill(pid)
        time.sleep(0.05)
        _reap()


# Each test module that imports the fixture gets its own (session-scoped) instance of it;
# they share one cluster, stopped when the last of them is finalized.
_shared: dict = {"cluster": None, "users": 0, "error": None}


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node Slurm cluster (``SlurmCluster``) for the whole session."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    if _shared["error"]:
        pytest.skip(_shared["error"])
    if _shared["cluster"] is None:
        try:
            _shared["cluster"] = start(tmp_path_factory.mktemp("slurm"))
        except RuntimeError as e:
            _shared["error"] = f"the test Slurm cluster did not come up: {e}"
            pytest.skip(_shared["error"])
    _shared["users"] += 1
    try:
        yield _shared["cluster"]
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            stop(_shared["cluster"])
            _shared["cluster"] = None


if __name__ == "__main__":
    supervise(Path(sys.argv[1]))
