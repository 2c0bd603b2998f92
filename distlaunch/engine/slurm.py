"""The Slurm engine: every agent of a job in one ``srun`` step inside the user's allocation;
and, under ``srun``, one launcher per node placed by Slurm's variables. All of the
launcher's Slurm knowledge is here (``PLUGIN``, registered in ``engine.ENGINES``); the
workers' side (a process srun started without a launcher) reads Slurm's variables in
``env.scheduler_identity``.

Where it applies (``SlurmPlugin.detect``): under srun (``SLURM_STEP_ID`` and
``SLURM_PROCID`` set) each task is one node's launcher (nodes, node rank and the store
from the step: ``node_options``); inside an allocation (``SLURM_JOB_ID``, no step) this
launcher is the head over the allocation's nodes (``discover``).

One step, one task per node::

    srun --overlap --nodes=N --ntasks=N --ntasks-per-node=1 --nodelist=n1,n2,...
         --kill-on-bad-exit=0 --wait=0 --input=all --label --verbose --mpi=none
         --cpu-bind=none --export=ALL sh -c '<host checks>; exec python -m distlaunch agent'

- ``--overlap`` lets the step share the CPUs of the user's running batch step (without
  it the step waits for free CPUs forever); steps started this way are inside the job, so
  ``scancel`` and the time limit reach the agents, their workers and anything they start
  (Slurm's process tracking), and Slurm accounts for them.
- The host checks and the hello are the SSH engine's (``remote.command.checked_command``,
  ``AGENT_HELLO <version>``): nothing is sent before every agent said hello with this
  version. Then the specs go to srun's stdin, which ``--input=all`` broadcasts to every
  task, as one JSON line ``{"slurm_nodes": {node name: spec minus the common part},
  "common": {...}}``; each agent keeps its own by ``SLURMD_NODENAME`` (``select_spec``).
  The secret is in the spec: never on a command line, never in the environment.
- Per-node ends: ``--label`` prefixes every line of task K with ``K:``, and ``--verbose``
  makes srun report where each task runs (``launching StepId=... on host n2, 1 tasks:
  1``) and how each ended (``_task_finish: n2: task 1: Completed``, ``error: n2: task
  1: Exited with exit code 3``, ``...: Killed``), so the head hears of each agent's end
  when it happens, as with one SSH channel per agent. srun's other verbose lines are
  dropped; its warnings and errors are relayed.
- ``--kill-on-bad-exit=0`` and ``--wait=0`` (overriding a site's KillOnBadExit and
  WaitTime): an agent exits non-zero whenever the job failed, and Slurm must not kill the
  others while they pass the exit barrier; a node whose agent died is a lost node for the
  head, exactly as in SSH mode. Workers never outlive their agent anyway (orphan guard).
- ``--cpu-bind=none``: Slurm's task binding would pin each agent, and so every worker of
  its node, to the CPUs of one task; distlaunch binds workers itself (``--bind-to``).

- The step may be running already: ``python -m distlaunch run`` starts it before its
  CLI's imports when the command line alone decides it (``remote/srun.py``), and
  ``_launch`` takes it over when it is exactly this one (else ends it, starts its own).

A kill of an unresponsive agent's recorded processes is one more small step on that node
(``srun --overlap --nodelist=NODE --ntasks=1 python -m distlaunch.agent.kill ...``).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from ..agent.output import write_all
from ..env import in_slurm_step, lookup, route_source, slurm_node_addresses
from ..errors import ConfigError
from ..hostlist import expand_hostlist
from ..remote.command import AGENT_HELLO, CHECK_MARK, check_problem, version_mismatch
from ..remote.srun import AGENT_ARGV, SPECS_KEY, Srun, popen, select_spec, srun_argv, srun_env, take_early
from ..report import progress, say
from . import AgentLaunch, EnginePlugin, OnEnd, Placement

if TYPE_CHECKING:
    from ..hosts import Host
    from ..run_options import RunOptions

__all__ = ["PLUGIN", "SlurmEngine", "SlurmPlugin", "select_spec", "SPECS_KEY"]


_LABEL = re.compile(rb"^ *(\d+): ?")
_LAUNCH = re.compile(r"^srun: launching (?:StepId=)?(\S+) on host (\S+), \d+ tasks?: ([\d,-]+)")
_FINISH = re.compile(r"^srun: (?:launch/slurm: _task_finish: |error: )(\S+): tasks? ([\d,-]+): (.+)$")
_EXIT_CODE = re.compile(r"Exited with exit code (\d+)")
# srun --verbose chatter: its option table and plugin lines ("srun: route/default: ...")
_VERBOSE = re.compile(
    r"^srun: (-{5}|defined options|end of defined options|jobid \d+: nodes|[a-z_]+/[\w]+: |\S+ +: )"
)
_NOISE = ("srun: cluster configuration lacks support for cpu binding",)


def _ids(text: str) -> list[int]:
    """``0-2,5`` -> [0, 1, 2, 5] (srun's task id lists)."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _status(text: str) -> int:
    """srun's end text of a task -> exit status (-1: killed by a signal or unknown)."""
    if text.strip() == "Completed":
        return 0
    m = _EXIT_CODE.search(text)
    return int(m.group(1)) if m else -1


def broadcast_line(specs: Mapping[str, dict[str, Any]]) -> bytes:
    """The one JSON line every agent receives: the values shared by all specs once, and
    per node only what differs; it names this engine (``agent.entry`` looks it up). Pure."""
    first = next(iter(specs.values()), {})
    common = {k: v for k, v in first.items() if all(s.get(k, not v) == v for s in specs.values())}
    nodes = {name: {k: v for k, v in s.items() if k not in common} for name, s in specs.items()}
    return (json.dumps({"engine": "slurm", SPECS_KEY: nodes, "common": common}) + "\n").encode()


class SlurmEngine:
    """Agents on the Slurm nodes ``nodes`` (node id -> node name) of the current
    allocation, run as ``python`` in ``cwd`` with ``cmd_env`` in srun's environment,
    which ``--export=ALL`` passes on (nothing secret: see remote.command). See
    ``engine.AgentEngine`` for the methods.
    ``agent_argv``: the agent program's arguments after ``python`` (tests start a stand-in).
    ``start_timeout``: how long ``start`` waits for the agents' hellos, in seconds."""

    start_timeout = 60.0

    def __init__(
        self,
        nodes: Mapping[int, str],
        python: str,
        cwd: str,
        cmd_env: Mapping[str, str],
        version: str,
        agent_argv: Sequence[str] = AGENT_ARGV,
    ):
        self.nodes = dict(nodes)
        self.ids = {name: k for k, name in self.nodes.items()}
        self.addresses: dict[str, str] = {}  # node name -> address, set by connect
        self.python, self.cwd, self.cmd_env, self.version = python, cwd, dict(cmd_env), version
        self.agent_argv = list(agent_argv)
        self.proc: Srun | None = None
        # readable once srun exited (its output may close a little before: that wait
        # must not be a sleep); None where the kernel gives none (before Linux 5.3)
        self._exit_fd: int | None = None
        self.started: list[int] = []
        self.task_node: dict[int, int] = {}  # srun task id -> node id
        self.status: dict[int, int | None] = {}  # node id -> exit status, once ended
        self._pending = {1: b"", 2: b""}
        self._in_options = False
        # while starting: reads each agent's first line (hello or check mark)
        self._greeter: Callable[[int, str], bool] | None = None
        # first lines of tasks srun has not yet said the node of (stdout and stderr are
        # separate pipes, read in either order)
        self._unplaced: list[tuple[int, str]] = []
        self.step: str | None = None  # "JOB.STEP" once srun said where it launches the step
        self.sent = False  # the specs went to the step: only then do its agents run a job
        self._cancelled = False  # the step is being cancelled: srun's reports of it are noise

    @classmethod
    def connect(
        cls, hosts: Mapping[int, Host], launch: AgentLaunch, agent_argv: Sequence[str] = AGENT_ARGV
    ) -> SlurmEngine:
        """Start the agent step on the Slurm nodes named by ``hosts`` (``_launch``) and,
        while the agents start, look up the nodes' addresses (``env.slurm_node_addresses``):
        the step's start overlaps the head's own set-up. Blocks. Raises ConfigError (the
        step, if started, is closed: its agents read end-of-file and end)."""
        nodes = {k: h.name for k, h in hosts.items()}
        progress(f"asking Slurm for {len(nodes)} node(s)", False)
        engine = cls(nodes, launch.python, launch.cwd, launch.cmd_env, launch.version, agent_argv)
        try:
            engine._launch(list(nodes))
            engine.addresses = slurm_node_addresses(list(nodes.values()))
        except BaseException:
            engine.close()
            raise
        return engine

    # -- addresses --------------------------------------------------------------------

    def store_address(self) -> str | None:
        here = lookup("SLURMD_NODENAME")
        others = [a for n, a in self.addresses.items() if n != here] or list(self.addresses.values())
        return route_source(others[0]) if others else None

    def master_address(self, node_id: int) -> str:
        return self.addresses[self.nodes[node_id]]

    # -- the step -----------------------------------------------------------------------

    def srun_argv(self, node_ids: Sequence[int]) -> list[str]:
        """The agent step's command line (``--dry-run`` shows it). Pure."""
        return srun_argv([self.nodes[k] for k in node_ids], self.python, self.cwd, self.agent_argv)

    def _launch(self, node_ids: Sequence[int]) -> None:
        """Run the agent step on ``node_ids`` (``srun_argv``) without waiting: the agents
        say hello and wait for their spec (``start``). Raises ConfigError when srun cannot
        be run."""
        argv, env = self.srun_argv(node_ids), srun_env(self.cmd_env)
        self.started = list(node_ids)
        # the step `python -m distlaunch run` started before its CLI's imports, if it is
        # this one (remote/srun.py)
        self.proc = take_early(argv, env)
        if self.proc is None:
            try:
                self.proc = popen(argv, env)
            except OSError as e:
                raise ConfigError(f"cannot run srun: {e}") from None
        try:
            self._exit_fd = os.pidfd_open(self.proc.pid)
        except (OSError, AttributeError):  # AttributeError: a Python built without pidfd_open
            pass  # a short poll of srun's status instead (_pump_once)
        for f in (self.proc.stdout, self.proc.stderr):
            assert f is not None
            os.set_blocking(f.fileno(), False)

    def start(self, specs: Mapping[int, dict[str, Any]]) -> None:
        """Wait until each agent of the step ``connect`` started said hello with this
        version (each report is said), and only then send the specs. Blocks up to
        ``start_timeout`` s. Raises ConfigError when ``specs`` are not for the started
        nodes, srun fails or a node failed its check (nothing was started anywhere: the
        agents read end-of-file and end)."""
        progress(f"starting agents on {len(specs)} Slurm node(s)", False)
        if set(specs) != set(self.started):
            raise ConfigError(f"specs for nodes {sorted(specs)}, but agents run on {sorted(self.started)}")
        problems: dict[str, str] = {}
        try:
            self._await_hellos(set(specs), problems)
            if problems:
                self.close()  # the agents read end-of-file and end; their marks are read
        finally:
            self._greeter = None
        if problems:
            for k in specs:
                say(f"preflight {self.nodes[k]}: {problems.get(self.nodes[k], 'ok')}")
            failed = ", ".join(self.nodes[k] for k in specs if self.nodes[k] in problems)
            raise ConfigError(
                f"preflight failed on {len(problems)} of {len(specs)} Slurm node(s) ({failed}); "
                "nothing was started"
            )
        for k in specs:
            say(f"preflight {self.nodes[k]}: ok")
        assert self.proc is not None  # launched by connect
        stdin = self.proc.stdin
        assert stdin is not None
        self.sent = True
        try:
            stdin.write(broadcast_line({self.nodes[k]: s for k, s in specs.items()}))
        except OSError:
            pass  # srun ended: pump() reports every agent's end
        self._close_stdin(stdin)

    @staticmethod
    def _close_stdin(stdin: IO[bytes]) -> None:
        try:
            stdin.close()
        except OSError:
            pass

    def _await_hellos(self, node_ids: set[int], problems: dict[str, str]) -> None:
        """Relay output until every agent said hello or failed; fills ``problems``
        ({node name: what is wrong}). A check mark read later (srun may report a task's
        end before its output) replaces a vaguer problem."""
        greeted: set[int] = set()
        deadline = time.monotonic() + self.start_timeout

        def first_line(task: int, text: str) -> bool:
            k = self.task_node.get(task)
            if k is None:  # srun's line placing the task (stderr) not read yet: keep it
                if text.partition(" ")[0] in (AGENT_HELLO, CHECK_MARK):
                    self._unplaced.append((task, text))
                    return True
                return False
            word, _, rest = text.partition(" ")
            if word == AGENT_HELLO and k not in greeted:
                greeted.add(k)
                if rest.strip() != self.version:
                    problems[self.nodes[k]] = version_mismatch(self.version, rest.strip(), self.python)
                return True
            if word == CHECK_MARK:
                why = check_problem(rest.strip(), self.python, self.cwd)
                problems[self.nodes[k]] = why or f"host check failed: {rest}"
                return True
            return False

        self._greeter = first_line
        while greeted | {self.ids[n] for n in problems} != node_ids:
            left = deadline - time.monotonic()
            if left <= 0:
                for k in node_ids - greeted:
                    problems.setdefault(
                        self.nodes[k], f"no answer from the agent within {self.start_timeout:g} s"
                    )
                return
            eof = self._pump_once(left, (), None)[1]
            for k, status in self.status.items():
                if k not in greeted:
                    problems.setdefault(self.nodes[k], f"the agent ended before starting (status {status})")
            if eof:
                for k in node_ids - greeted:
                    problems.setdefault(
                        self.nodes[k], f"srun ended (status {self.proc and self.proc.poll()})"
                    )
                return

    # -- watching -----------------------------------------------------------------------

    @property
    def running(self) -> list[int]:
        """The agents that got their spec and have not ended (none before ``start`` sent
        the specs: an agent without one runs nothing, and ``close`` cancels the step)."""
        return self._alive() if self.sent else []

    def _alive(self) -> list[int]:
        return [k for k in self.started if k not in self.status]

    def _fds(self) -> list[int]:
        assert self.proc is not None
        return [f.fileno() for f in (self.proc.stdout, self.proc.stderr) if f is not None and not f.closed]

    def pump(
        self, timeout: float | None, extra_fds: Sequence[int] = (), on_end: OnEnd | None = None
    ) -> list[int]:
        return self._pump_once(timeout, extra_fds, on_end)[0]

    def _pump_once(
        self,
        timeout: float | None,
        extra_fds: Sequence[int],
        on_end: OnEnd | None,
    ) -> tuple[list[int], bool]:
        """One wait for output, srun's end or ``extra_fds``; returns (ready extra fds,
        srun's output ended)."""
        assert self.proc is not None
        poller = select.poll()
        fds = self._fds()
        for fd in (*fds, *extra_fds):
            poller.register(fd, select.POLLIN)
        wait = timeout
        if not fds and self.proc.poll() is None:  # output closed, srun still exiting
            if self._exit_fd is not None:
                poller.register(self._exit_fd, select.POLLIN)
            else:
                wait = 0.05 if timeout is None else min(timeout, 0.05)
        ready = {fd for fd, _ in poller.poll(None if wait is None else wait * 1000)}
        for stream, f in ((1, self.proc.stdout), (2, self.proc.stderr)):
            if f is None or f.closed or f.fileno() not in ready:
                continue
            try:
                data = os.read(f.fileno(), 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                f.close()
                data = b"\n" if self._pending[stream] else b""
            self._lines(stream, data, on_end)
        if not self._fds() and self.proc.poll() is not None:
            code = self.proc.returncode
            for k in self.started:
                self._end(k, 0 if code == 0 else -1, on_end)
            return [fd for fd in extra_fds if fd in ready], True
        return [fd for fd in extra_fds if fd in ready], False

    def _lines(self, stream: int, data: bytes, on_end: OnEnd | None) -> None:
        buf = self._pending[stream] + data
        *lines, self._pending[stream] = buf.split(b"\n")
        out = []
        for raw in lines:
            m = _LABEL.match(raw)
            if m is not None:  # a line of agent K
                text = raw[m.end() :]
                greet = self._greeter
                if greet is not None and greet(int(m.group(1)), text.decode(errors="replace")):
                    continue
                out.append(text)
            elif self._srun_line(raw.decode(errors="replace"), on_end):
                out.append(raw)
        if out and not self._cancelled:
            try:
                write_all(stream, b"\n".join(out) + b"\n")
            except OSError:
                pass  # our console is gone; supervision goes on

    def _srun_line(self, line: str, on_end: OnEnd | None) -> bool:
        """Digest one of srun's own lines; True when it should be shown."""
        if line == "srun: defined options":
            self._in_options = True
        if self._in_options:
            self._in_options = line != "srun: end of defined options"
            return False
        m = _LAUNCH.match(line)
        if m is not None and m.group(2) in self.ids:
            self.step = m.group(1)
            for task in _ids(m.group(3)):
                self.task_node[task] = self.ids[m.group(2)]
            early, self._unplaced = self._unplaced, []
            for task, text in early:
                if self._greeter is not None:
                    self._greeter(task, text)  # placed now, or kept again
            return False
        m = _FINISH.match(line)
        if m is not None and m.group(1) in self.ids:
            self._end(self.ids[m.group(1)], _status(m.group(3)), on_end)
            return line.startswith("srun: error:")
        return bool(line.strip()) and not _VERBOSE.match(line) and line not in _NOISE

    def _end(self, k: int, status: int | None, on_end: OnEnd | None) -> None:
        if k in self.status:
            return
        self.status[k] = status
        if on_end is not None:
            on_end(k, status)

    def signal_group(self, sig: int) -> None:
        """Relay SIGUSR1/SIGUSR2 the head received (``sbatch --signal=B:USR1@T`` signals
        only the batch shell) to every process of the agent step: srun forwards the signals
        it receives to the step's tasks (srun(1), SIGNALS), which Slurm delivers to each
        process of the step once, the workers included. Other signals are ignored: the
        head stops a job through the store. The ``agent.signals.SignalRelay`` target
        interface; never raises."""
        if sig not in (signal.SIGUSR1, signal.SIGUSR2) or self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def abandon(self, node_id: int) -> None:
        self.status.setdefault(node_id, -1)

    def kill(self, node_id: int, records: list[tuple[int, int]]) -> None:
        if not records or node_id not in self.nodes:
            return
        argv = [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={self.nodes[node_id]}",
            "--kill-on-bad-exit=0",
            "--input=none",
            "--mpi=none",
            "--cpu-bind=none",
            "--export=ALL",
            "--job-name=distlaunch-kill",
            self.python,
            "-m",
            "distlaunch.agent.kill",
            *(f"{p}:{t}" for p, t in records),
        ]
        env = srun_env(self.cmd_env)
        try:
            subprocess.run(argv, env=env, capture_output=True, timeout=10, start_new_session=True)
        except (OSError, subprocess.TimeoutExpired):
            pass  # the node is unreachable: Slurm's own end of the job is the last resort

    def close(self) -> None:
        """Relay the agents' last output (srun may report a task's end before its last
        lines) and end srun: at once with SIGTERM when agents still run (srun then cancels
        the step; Slurm kills what remains after KillWait), else after it exits by itself
        (at most 5 s). SIGKILL if it still runs 5 s later. Before the specs were sent (a
        stop signal or a failure while the step starts) the agents have nothing to finish:
        the step is cancelled (``scancel JOB.STEP``) and srun gets 0.5 s, then SIGKILL.
        Idempotent."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self._close_stdin(self.proc.stdin)
        if not self.sent and self.proc.poll() is None:
            self._cancel_step()
        else:
            self._finish(0.5 if self._alive() else 5.0)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                f.close()
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None

    def _cancel_step(self) -> None:
        """End the step at once: ``scancel`` it (Slurm signals every process of the step,
        SIGKILL after KillWait) and SIGTERM srun (still creating the step: it gives up);
        then read output for at most 0.5 s and SIGKILL srun if it still runs. The step's
        reports of the cancel (srun's and slurmstepd's: aborted, killed) are not shown."""
        self._cancelled = True
        if self.step is not None:
            env = srun_env({})
            try:
                subprocess.run(["scancel", "--quiet", self.step], env=env, capture_output=True, timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass  # srun's SIGTERM below still ends the step
        self._escalate(((signal.SIGTERM, 0.5), (signal.SIGKILL, 1.0)))

    def _finish(self, grace: float) -> None:
        """Relay output until srun ended and its output is closed: ``grace`` s, then after
        SIGTERM 5 s more, then SIGKILL."""
        self._escalate(((None, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)))

    def _escalate(self, steps: Sequence[tuple[int | None, float]]) -> None:
        """For each (signal or None, seconds): send the signal to srun if it still runs,
        then relay output for up to that long; return once srun ended and its output is
        closed."""
        assert self.proc is not None
        for sig, wait in steps:
            if sig is not None and self.proc.poll() is None:
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self._pump_once(max(0.0, deadline - time.monotonic()), (), None)[1]:
                    return


def allocation_nodes(environ: Mapping[str, str] | None = None) -> list[str]:
    """The nodes of the current allocation, in Slurm's order: ``SLURM_JOB_NODELIST``
    (``SLURM_NODELIST`` on older releases) expanded. Raises ConfigError outside an
    allocation or for a malformed list."""
    text = lookup("SLURM_JOB_NODELIST", environ) or lookup("SLURM_NODELIST", environ)
    if not text:
        raise ConfigError(
            "not inside a Slurm allocation (SLURM_JOB_NODELIST is not set); use salloc or sbatch"
        )
    try:
        return expand_hostlist(text)
    except ValueError as e:
        raise ConfigError(f"SLURM_JOB_NODELIST: {e}") from None


class SlurmPlugin:
    """The Slurm engine in the registry (``engine.EnginePlugin``)."""

    local_agent_in_process = False  # the head's node too runs its agent in the step
    fills_around_given = False  # under srun, a per-node option given: the launch as written

    def detect(self, environ: Mapping[str, str]) -> Placement | None:
        if in_slurm_step(environ):
            return "node"
        return "head" if lookup("SLURM_JOB_ID", environ) is not None else None

    def check(self, environ: Mapping[str, str]) -> None:
        if self.detect(environ) is None:
            raise ConfigError(
                "--launcher slurm needs a Slurm allocation (SLURM_JOB_ID is not set); run it "
                "inside salloc or an sbatch script, or use --launcher ssh with -H"
            )

    def node_options(
        self, environ: Mapping[str, str], options: Mapping[str, Any], given: frozenset[str]
    ) -> dict[str, Any]:
        """The per-node options of one launcher per node under srun (``srun -N2
        --ntasks-per-node=1 distlaunch run ...``): node count and rank from the step, node
        0 (the step's first node) hosts the store at a port derived from the job and step
        ids, and the run id (hence the store token) comes from them too. Raises
        ConfigError when the step runs several launchers on one node."""
        from ..config import run_id_from
        from ..env import scheduler_identity, slurm_node_address

        ident = scheduler_identity(environ)
        assert ident is not None and ident.source == "slurm"  # detect saw a step
        if ident.local_world_size != 1:
            raise ConfigError(
                f"distlaunch run under srun is one launcher per node, but this step runs "
                f"{ident.local_world_size} on this node; use srun --ntasks-per-node=1"
            )
        return {
            "nnodes": str(ident.world_size),
            "node_rank": ident.rank,
            "master_addr": ident.store_host or slurm_node_address(ident.store_node or ""),
            "master_port": ident.store_port,
            "run_id": run_id_from(ident.context),
        }

    def discover(self, opts: RunOptions, environ: Mapping[str, str]) -> list[Host]:
        """The allocation's nodes: slots per node from --nproc-per-node when given, else
        SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE, else the node's CPU count
        (torchrun's auto); --include/--exclude pick among them."""
        from ..hostlist import parse_tasks_per_node
        from ..hosts import Host, filter_hosts

        names = allocation_nodes(environ)
        per_node, tasks = (
            lookup("SLURM_NTASKS_PER_NODE", environ) or "",
            lookup("SLURM_TASKS_PER_NODE", environ),
        )
        if "nproc_per_node" in opts.given:
            slots = [opts.nproc_per_node] * len(names)
        elif per_node.isdigit():
            slots = [int(per_node)] * len(names)
        elif tasks:
            try:
                slots = parse_tasks_per_node(tasks)
            except ValueError as e:
                raise ConfigError(f"SLURM_TASKS_PER_NODE: {e}") from None
        else:
            slots = [os.cpu_count() or 1] * len(names)
        if len(slots) != len(names):
            raise ConfigError(
                f"SLURM_TASKS_PER_NODE gives {len(slots)} nodes, SLURM_JOB_NODELIST {len(names)}; "
                f"give --nproc-per-node"
            )
        return filter_hosts([Host(n, slots=k) for n, k in zip(names, slots)], opts.include, opts.exclude)

    def engine(self) -> type[SlurmEngine]:
        return SlurmEngine

    def describe(self, hosts: Mapping[int, Host], launch: AgentLaunch) -> str:
        import shlex

        names = {k: h.name for k, h in hosts.items()}
        srun = SlurmEngine(names, launch.python, launch.cwd, launch.cmd_env, launch.version).srun_argv(
            list(names)
        )
        return shlex.join(srun[:-1]) + " '<host checks; then the agent>'"

    def agent_spec(self, message: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        return select_spec(message, environ)


PLUGIN: EnginePlugin = SlurmPlugin()  # mypy checks it against the protocol
