"""The Slurm agent step's command line and environment, its early start, and each
agent's pick of its own spec from the step's one line (``select_spec``).

Light on purpose (the standard library without ``subprocess``, ``re``, ``shlex`` or
``signal``: srun starts through ``os.posix_spawn``, ``popen``; ``remote.command`` and
``hostlist``, which load none of them, where the step's command line is built; outside
the ``engine`` package, whose registry costs more to import): ``python -m distlaunch
run`` inside an allocation starts the agent step from here before the CLI's own
imports (``start_early``), so the step's launch (slurmctld, each node's slurmd and
slurmstepd, the agents' interpreters) overlaps the head's start-up instead of following
it. The Slurm engine (``engine/slurm.py``) builds the same command line and takes that
step over (``take_early``) when it is exactly the one it would start; otherwise it ends
it and starts its own.

Only a launch whose outcome the command line alone decides starts early: ``run`` with at
most ``--nproc-per-node N`` before an existing script, in an allocation (``SLURM_JOB_ID``
set, not inside a step), no ``PET_*`` variable (they set options). Anything else waits
for the CLI as before. The agents of an early step only say hello and wait for their
spec on stdin: a head that ends without sending one (an error found later) closes it,
and they end having started nothing.
"""

from __future__ import annotations

import _signal  # signal's C module, loaded at start-up (signal builds its enums: ~4 ms)
import _thread  # (threading's C module, loaded at start-up)
import os
import sys
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Mapping, Sequence
    from typing import IO, Any

AGENT_ARGV = ["-m", "distlaunch", "agent"]

# srun reads these from the environment as defaults for options the agent step must not
# inherit from the user's allocation or batch script (srun(1), INPUT ENVIRONMENT VARIABLES).
_SRUN_INHERITED = (
    "SLURM_EXACT",
    "SLURM_STDINMODE",
    "SLURM_STDOUTMODE",
    "SLURM_STDERRMODE",
    "SLURM_ARBITRARY",
    "SLURM_HOSTFILE",
    "SLURM_EXCLUSIVE",
)

_NPROC = ("--nproc-per-node", "--nproc_per_node")

SPECS_KEY = "slurm_nodes"  # the broadcast spec line holds this key (see select_spec)


def srun_env(cmd_env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """srun's environment: ``environ`` (default this process's) less _SRUN_INHERITED (srun
    would take them as defaults), plus ``cmd_env``, which ``--export=ALL`` passes on to
    the agents. Pure."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in _SRUN_INHERITED}
    env.update(cmd_env)
    return env


def srun_argv(
    names: Sequence[str], python: str, cwd: str, agent_argv: Sequence[str] = AGENT_ARGV
) -> list[str]:
    """The agent step's command line: one task per node of ``names`` (see engine/slurm.py
    for each option), running the host checks and then ``python agent_argv`` in ``cwd``.
    Pure. Raises ConfigError as ``remote.command.checked_command``."""
    from .command import checked_command  # (an agent picking its spec needs none of it)

    # cmd_env reaches the agents through srun's environment (srun_env): no `env` process
    # between the shell and the agent
    cmd = checked_command(python, cwd, list(agent_argv), {})
    n = len(names)
    return [
        "srun",
        "--overlap",
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(names)}",
        "--kill-on-bad-exit=0",
        "--wait=0",
        "--input=all",
        "--label",
        "--verbose",
        "--mpi=none",
        "--cpu-bind=none",
        "--export=ALL",
        "--job-name=distlaunch-agents",
        "sh",
        "-c",
        cmd,
    ]


def select_spec(message: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """On a node: this agent's spec from the broadcast line (``{"slurm_nodes": {node
    name: per-node part}, "common": {...}}``), chosen by ``SLURMD_NODENAME`` (the Slurm
    node this task runs on, distinct even for several slurmd on one machine). Pure.
    Raises ConfigError when the variable is missing or names no node of the line."""
    from ..errors import ConfigError

    # (env.lookup's table has it; env is not loaded here: it pulls in dataclasses, which
    # an agent loads only once its workers are spawned)
    name = (os.environ if environ is None else environ).get("SLURMD_NODENAME")
    if not name:
        raise ConfigError("SLURMD_NODENAME is not set: this agent was not started by srun")
    nodes = message[SPECS_KEY]
    if name not in nodes:
        raise ConfigError(f"no job spec for Slurm node {name!r} (specs for {', '.join(sorted(nodes))})")
    return {**message.get("common", {}), **nodes[name]}


class Srun:
    """srun, started by ``popen``: what the engine uses of ``subprocess.Popen`` (``pid``,
    ``stdin``/``stdout``/``stderr``, ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``), with Popen's return codes (-N: killed by signal N).
    ``popen``: the Popen it was started with where posix_spawn could not (it reaps it)."""

    def __init__(
        self,
        pid: int,
        stdin: IO[bytes],
        stdout: IO[bytes],
        stderr: IO[bytes],
        popen: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._popen = popen
        # held while reaping, as Popen's _waitpid_lock: a poll from a signal handler (the
        # engine's signal_group) that interrupts a reap returns None instead of reaping
        # srun itself, which would leave the interrupted waitpid ECHILD and no status
        self._lock = _thread.allocate_lock()

    def poll(self) -> int | None:
        """srun's exit code once it ended (reaping it), else None (also while another
        call is reaping it). Never blocks."""
        return self._reap(True)

    def wait(self, timeout: float | None = None) -> int:
        """srun's exit code, waiting for it up to ``timeout`` s (None: for good). Raises
        ``subprocess.TimeoutExpired`` when it still runs then, as Popen.wait."""
        if timeout is None:
            code = self._reap(False)
            assert code is not None  # (a blocking reap)
            return code
        deadline, pause = time.monotonic() + timeout, 0.0005
        while (code := self.poll()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                from subprocess import TimeoutExpired  # (only now: see the module's docstring)

                raise TimeoutExpired(["srun"], timeout)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.05)  # as Popen.wait's polling
        return code

    def _reap(self, nohang: bool) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._popen is not None:
            self.returncode = self._popen.poll() if nohang else self._popen.wait()
            return self.returncode
        if not self._lock.acquire(not nohang):  # reaping elsewhere (this thread, interrupted)
            return None
        try:
            while self.returncode is None:  # (set meanwhile by the holder we waited for)
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG if nohang else 0)
                except ChildProcessError:  # reaped outside this object: unknown, as Popen says 0
                    pid, status = self.pid, 0
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                elif nohang:
                    break
        finally:
            self._lock.release()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """``sig`` to srun unless it was reaped (its pid may be another process's by
        then), as Popen.send_signal. Never raises for a process that is gone."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # (as Popen: reaped by someone else)
                pass

    def terminate(self) -> None:
        self.send_signal(_signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(_signal.SIGKILL)


def popen(argv: list[str], env: dict[str, str]) -> Srun:
    """Start srun as ``subprocess.Popen(argv, env=env, stdin=PIPE, stdout=PIPE,
    stderr=PIPE, start_new_session=True)`` would (the head handles Ctrl-C; srun must not
    see it: a session of its own; SIGPIPE and SIGXFSZ back to their defaults; no
    descriptor but the pipes inherited), but through ``os.posix_spawn``: importing
    ``subprocess`` costs ~10 ms of CPU, which the early start (``start_early``) would
    spend before the step can start. ``argv[0]`` without a ``/`` is looked up on
    ``env``'s ``PATH`` (``os.defpath`` without one), as Popen. Through ``subprocess``
    where this Python's posix_spawn cannot start a session. Raises OSError as Popen
    (no such program: FileNotFoundError; not executable: PermissionError)."""
    try:
        return _spawn(argv, env)
    except NotImplementedError:  # built without POSIX_SPAWN_SETSID (glibc < 2.26)
        import subprocess

        p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert p.stdin is not None and p.stdout is not None and p.stderr is not None  # (PIPE)
        return Srun(p.pid, p.stdin, p.stdout, p.stderr, p)


def _spawn(argv: list[str], env: dict[str, str]) -> Srun:
    """``popen`` through ``os.posix_spawn``. Raises OSError, NotImplementedError."""
    ends: list[int] = []  # closed on the way out (the parent's three once files own them)
    files: list[IO[bytes]] = []
    try:
        for _ in range(3):
            ends.extend(os.pipe())  # stdin r, w; stdout r, w; stderr r, w
        child = [ends[0], ends[3], ends[5]]
        # the parent's files before the spawn: nothing can fail after it (a child left
        # unreaped); each file owns its descriptor from its open on
        for fd, mode, buffering in ((ends[1], "wb", -1), (ends[2], "rb", 0), (ends[4], "rb", 0)):
            ends.remove(fd)
            files.append(open(fd, mode, buffering))
        actions: list[tuple[int, ...]] = [
            (os.POSIX_SPAWN_DUP2, child[0], 0),
            (os.POSIX_SPAWN_DUP2, child[1], 1),
            (os.POSIX_SPAWN_DUP2, child[2], 2),
        ]
        # the pipes are close-on-exec; descriptors this process inherited as
        # inheritable are closed too (Popen's close_fds)
        actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable()]
        pid = _spawn_on_path(argv, env, actions)
    except BaseException:
        for f in files:
            f.close()
        raise
    finally:
        for fd in ends:
            os.close(fd)
    stdin, stdout, stderr = files
    return Srun(pid, stdin, stdout, stderr)


def _spawn_on_path(argv: list[str], env: dict[str, str], actions: list[tuple[int, ...]]) -> int:
    """``os.posix_spawn`` of ``argv[0]`` as Popen's exec finds it: itself if it holds a
    ``/``, else the first of ``env``'s ``PATH`` (``os.get_exec_path``) that starts; the
    error of the first that exists but cannot start (else FileNotFoundError), naming
    ``argv[0]``. Raises OSError, NotImplementedError."""
    program = argv[0]
    paths = [program] if "/" in program else [os.path.join(d, program) for d in os.get_exec_path(env)]
    first: OSError | None = None
    for path in paths:
        try:
            os.stat(path)  # (a spawn, a clone of this process, only where there is a file)
            return os.posix_spawn(
                path,
                argv,
                env,
                file_actions=actions,
                setsid=True,
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ),  # ignored by Python (Popen's restore_signals)
            )
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            first = first or e
    if first is None:
        first = FileNotFoundError(2, os.strerror(2))  # ENOENT
    raise OSError(first.errno, first.strerror, program)  # (OSError picks the subclass)


def _inheritable() -> list[int]:
    """This process's inheritable descriptors above 2 (Linux: /proc/self/fd)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            if fd > 2 and os.get_inheritable(fd):
                out.append(fd)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


_early: tuple[list[str], dict[str, str], Srun] | None = None


def early_script(args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The script of ``distlaunch run ARGS`` when ``environ`` and ``args`` alone say the
    launch is the Slurm head's over the whole allocation, with this interpreter in this
    directory: inside an allocation but not a step, no ``PET_*`` variable, and ``args``
    at most ``--nproc-per-node N`` (N a positive integer) before an existing file. None
    otherwise. Pure but for the file check."""
    if "SLURM_JOB_ID" not in environ or ("SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ):
        return None
    if any(k.startswith("PET_") for k in environ):
        return None
    i = 0
    while i < len(args):
        a = args[i]
        if a in _NPROC and i + 1 < len(args):
            value, i = args[i + 1], i + 2
        elif a.startswith(tuple(f"{o}=" for o in _NPROC)):
            value, i = a.partition("=")[2], i + 1
        else:
            break
        if not (
            value.isascii() and value.isdigit() and int(value) > 0
        ):  # isdigit alone takes '²', which int() refuses
            return None
    if i >= len(args) or args[i].startswith("-") or not os.path.isfile(args[i]):
        return None
    return args[i]


def start_early(args: Sequence[str]) -> None:
    """Start the agent step now when ``distlaunch run ARGS`` is sure to start it
    (``early_script``), as the Slurm engine will: this interpreter, this directory,
    PYTHONPATH passed on, every node of ``SLURM_JOB_NODELIST``. Never raises: anything
    unexpected leaves the start to the engine."""
    global _early
    environ = os.environ
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if _early is not None or not nodelist or early_script(args, environ) is None:
        return
    try:
        from ..hostlist import expand_hostlist

        cmd_env = {"PYTHONPATH": environ["PYTHONPATH"]} if "PYTHONPATH" in environ else {}
        argv = srun_argv(expand_hostlist(nodelist), sys.executable, os.getcwd())
        env = srun_env(cmd_env)
        _early = (argv, env, popen(argv, env))
    except Exception:  # a malformed node list, no srun: the engine says what is wrong
        return
    import signal

    # Until the CLI's own handling is in place, a SIGTERM or SIGHUP would end this
    # process at once and leave srun running (Ctrl-C already raises KeyboardInterrupt,
    # which the CLI's exit path turns into end_early).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _stopped_early)


def _stopped_early(signum: int, _frame: object) -> None:
    """A stop signal before the CLI handles signals: end the early step and exit as the
    CLI does when stopped (128 + N, one line)."""
    end_early()
    from ..report import say

    say(f"stopped by signal {signum}; workers stopped")
    sys.stderr.flush()
    os._exit(128 + signum)


def take_early(argv: Sequence[str], env: Mapping[str, str]) -> Srun | None:
    """The early step's srun when it runs exactly ``argv`` with ``env`` (then it is the
    caller's to supervise), else None; an early step that differs is ended first (stdin
    closed: its agents end without starting anything; srun terminated, which cancels the
    step) and reaped. Called once, by the engine that starts the step."""
    global _early
    early, _early = _early, None
    if early is None:
        return None
    early_argv, early_env, proc = early
    if early_argv == list(argv) and early_env == dict(env):
        return proc
    _end(proc)
    return None


def end_early() -> None:
    """End the early step if nobody took it over (the CLI is leaving: a usage error, a
    configuration error, Ctrl-C before the engine started). Never raises."""
    global _early
    early, _early = _early, None
    if early is not None:
        try:
            _end(early[2])
        except Exception:  # leaving anyway: srun ends with its stdin closed
            pass


def _end(proc: Srun) -> None:
    """Close the step's pipes (its agents end having started nothing), terminate srun
    (which cancels the step) and reap it."""
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    proc.terminate()
    from subprocess import TimeoutExpired  # (as Srun.wait: not at start-up)

    try:
        proc.wait(5.0)
    except TimeoutExpired:
        proc.kill()
        proc.wait()
