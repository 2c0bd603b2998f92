"""Pre-flight checks: before starting anything, make sure every remote host can run
``python -m distlaunch agent`` the way the head expects.

One SSH exec per host, all hosts in parallel. The check is a small POSIX ``sh`` script
sent on stdin to ``sh -s`` (so the remote login shell's syntax does not matter) that:

1. the working directory exists and can be entered (the program runs there);
2. the interpreter is executable (a path, relative to that directory if relative, or a
   name found on the remote ``PATH``);
3. ``cd <cwd> && <python> -c "import distlaunch; print(distlaunch.__version__)"`` works
   and prints the head's version (mixed versions would speak different protocols).
"""

from __future__ import annotations

import select
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..hosts import Host
from . import RemoteError, in_threads
from .command import AGENT_HELLO, CHECK_MARK, check_problem, host_checks, version_mismatch
from .ssh import RemoteProcess, SSHConnection

__all__ = ["HostReport", "preflight", "start_checked"]

_MARK = CHECK_MARK
_PROBE = f"import distlaunch; print('{_MARK} version', distlaunch.__version__)"


@dataclass(frozen=True)
class HostReport:
    """The outcome for one host: ``ok``, or ``problem`` (one line saying what is wrong)."""

    host: Host
    ok: bool
    problem: str | None


def _script(python: str, cwd: str) -> bytes:
    probe = f'"$py" -c {shlex.quote(_PROBE)} </dev/null 2>&1\necho "{_MARK} rc $?"\n'
    return (host_checks(python, cwd) + "\n" + probe).encode()


def _verdict(python: str, cwd: str, version: str, status: int, out: str, err: str) -> str | None:
    """The problem the script's output reveals, or None if all is well."""
    marks = {}
    other = []
    for line in out.splitlines():
        if line.startswith(_MARK + " "):
            key, _, value = line[len(_MARK) + 1 :].partition(" ")
            marks[key] = value.strip()
        elif line.strip():
            other.append(line.strip())
    for key in marks:  # host_checks prints at most one mark, then exits
        problem = check_problem(key, python, cwd)
        if problem is not None:
            return problem
    if "version" in marks:
        found = marks["version"]
        return None if found == version else version_mismatch(version, found, python)
    if "rc" in marks:
        detail = other[-1] if other else f"exit status {marks['rc']}"
        return f"distlaunch not importable by python {python} in {cwd}: {detail}"
    detail = (err.strip().splitlines() or [f"exit status {status}"])[-1]
    return f"the check script did not run: {detail}"


def _check(conn: SSHConnection, python: str, cwd: str, version: str, timeout: float) -> HostReport:
    try:
        status, out, err = conn.run("sh -s", timeout=timeout, stdin_data=_script(python, cwd))
    except RemoteError as e:
        return HostReport(conn.host, False, str(e))
    problem = _verdict(python, cwd, version, status, out, err)
    return HostReport(conn.host, problem is None, problem)


def preflight(
    conns: list[SSHConnection], python: str, cwd: str, version: str, timeout: float = 30.0
) -> list[HostReport]:
    """Check every connected host in parallel; one :class:`HostReport` per connection, in
    order. ``python`` is the remote interpreter, ``cwd`` the remote working directory,
    ``version`` the head's ``distlaunch.__version__``.

    Blocks until all hosts answered, at most about ``timeout`` seconds. Never raises for
    a host's problem (a lost connection or a timeout is reported as that host's problem);
    the caller decides what to do with failed reports.
    """
    if not conns:
        return []
    futures = in_threads(
        lambda c: _check(c, python, cwd, version, timeout), conns, 64, "distlaunch-preflight"
    )
    return [f.result() for f in futures]


def start_checked(
    conns: Mapping[int, SSHConnection],
    cmd: str,
    python: str,
    cwd: str,
    version: str,
    timeout: float = 30.0,
) -> tuple[dict[int, RemoteProcess], list[HostReport]]:
    """Start ``cmd`` (``command.checked_command`` running ``python -m distlaunch agent``)
    on every host with stdin kept open, and wait for each agent's first line,
    ``AGENT_HELLO <version>``: the check and the start are one interpreter per host.

    Returns the started processes by node id (their stdin still open: the caller sends
    the spec, or closes them, which ends the agents before they start anything) and one
    :class:`HostReport` per host, in ``conns`` order. A host whose agent ended without a
    hello is checked again with :func:`preflight`'s probe to name the problem; a failed
    host's process is closed and left out of the result. Blocks about ``timeout``
    seconds at most; never raises for a host's problem.
    """
    procs: dict[int, RemoteProcess] = {}
    problems: dict[int, str] = {}
    unexplained: list[int] = []  # no hello and no mark: the probe says why
    for k, conn in conns.items():
        try:
            procs[k] = conn.exec(cmd, keep_stdin_open=True)
        except RemoteError as e:
            problems[k] = str(e)
    out = {k: b"" for k in procs}
    deadline = time.monotonic() + timeout
    waiting = set(procs)
    while waiting and time.monotonic() < deadline:
        poller = select.poll()  # not select(): descriptors may be above 1024 in big jobs
        for k in waiting:
            poller.register(procs[k].fileno(), select.POLLIN)
        poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
        for k in list(waiting):
            p = procs[k]
            out[k] += p.read_stdout()
            line, nl, _ = out[k].partition(b"\n")
            if not nl and not (p.exited() and p.eof()):
                continue
            waiting.discard(k)
            word, _, found = line.decode(errors="replace").partition(" ")
            if nl and word == AGENT_HELLO:
                if found.strip() != version:
                    problems[k] = version_mismatch(version, found.strip(), python)
            elif word == _MARK:
                status = p.exit_status()
                why = _verdict(python, cwd, version, -1 if status is None else status, line.decode(), "")
                problems[k] = why or f"the host check failed: {line.decode(errors='replace')}"
            else:
                err = p.read_stderr().decode(errors="replace")
                problems[k] = (
                    "the agent ended before starting: "
                    + (err.strip().splitlines() or [f"exit status {p.exit_status()}"])[-1]
                )
                unexplained.append(k)
    for k in waiting:
        problems[k] = f"no answer from the agent within {timeout:g} s"
        unexplained.append(k)
    if unexplained:  # rare: one more interpreter per such host finds the precise reason
        for k, report in zip(unexplained, preflight([conns[k] for k in unexplained], python, cwd, version)):
            problems[k] = report.problem or problems[k]
    for k in problems:
        if k in procs:
            procs.pop(k).close()
    reports = [HostReport(conn.host, k not in problems, problems.get(k)) for k, conn in conns.items()]
    return procs, reports
