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

import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..hosts import Host
from . import RemoteError
from .ssh import SSHConnection

__all__ = ["HostReport", "preflight"]

_MARK = "DISTLAUNCH-PREFLIGHT"
_PROBE = f"import distlaunch; print('{_MARK} version', distlaunch.__version__)"
_SCRIPT = """\
d={cwd}; py={python}
if [ ! -d "$d" ]; then echo "{mark} nodir"; exit 0; fi
cd -- "$d" 2>/dev/null || {{ echo "{mark} nocd"; exit 0; }}
case "$py" in
  */*) if [ -d "$py" ] || [ ! -x "$py" ]; then echo "{mark} nopython"; exit 0; fi ;;
  *) command -v "$py" >/dev/null 2>&1 || {{ echo "{mark} nopython"; exit 0; }} ;;
esac
"$py" -c {probe} </dev/null 2>&1
echo "{mark} rc $?"
"""


@dataclass(frozen=True)
class HostReport:
    """The outcome for one host: ``ok``, or ``problem`` (one line saying what is wrong)."""

    host: Host
    ok: bool
    problem: str | None


def _script(python: str, cwd: str) -> bytes:
    return _SCRIPT.format(
        cwd=shlex.quote(cwd), python=shlex.quote(python), mark=_MARK, probe=shlex.quote(_PROBE)
    ).encode()


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
    if "nodir" in marks:
        return f"directory {cwd} does not exist"
    if "nocd" in marks:
        return f"directory {cwd} cannot be entered (permissions?)"
    if "nopython" in marks:
        return f"python {python} not found or not executable"
    if "version" in marks:
        found = marks["version"]
        return None if found == version else f"distlaunch {version} expected, found {found} (python {python})"
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
    with ThreadPoolExecutor(
        max_workers=min(64, len(conns)), thread_name_prefix="distlaunch-preflight"
    ) as pool:
        return list(pool.map(lambda c: _check(c, python, cwd, version, timeout), conns))
