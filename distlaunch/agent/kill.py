"""The records of a node's processes, and killing them from the head when its agent
does not stop.

The agent records, per round, ``[[agent pid, start], [worker pgid, start], ...]`` in the
store (``r<R>/pgids/<K>``), ``start`` being the process's start time in clock ticks since
boot (``/proc/<pid>/stat`` field 22). The head reads it back, validates every value as an
integer in range (anything that can write the store, a worker included, must not be able
to inject a command), and runs one small Python program on the host over SSH that kills
only what is still the same process:

- the agent pid only if its start time is unchanged (else the pid was reused);
- a worker process group if its leader's start time is unchanged, or if the leader is
  gone (the kernel does not reuse a pid while a process group of that id exists, so a
  group whose leader exited still holds only the job's processes).

Never a pattern kill (``pkill``). Standard library only. The host runs this module
(``python -m distlaunch.agent.kill PID:START ...``) with the agent's interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import sys

PID_MAX = 1 << 22  # Linux's largest possible pid_max


def start_time(pid: int) -> int:
    """``pid``'s start time in clock ticks since boot (0 if it is already gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def with_start_times(pids: list[int]) -> list[list[int]]:
    """``[[pid, start_time(pid)], ...]``: the record an agent publishes at spawn."""
    return [[pid, start_time(pid)] for pid in pids]


def parse_records(raw: bytes | str) -> list[tuple[int, int]]:
    """Validate a record read back from the store: a JSON list of ``[pid, start]`` pairs
    of plain integers, 1 < pid < 2**22, start >= 0. Raises ValueError for anything else
    (a malformed or hostile record is never acted on)."""
    try:
        data = json.loads(raw)
    except RecursionError:  # absurdly nested
        raise ValueError("process record is nested too deeply") from None
    if not isinstance(data, list):
        raise ValueError(f"process record is not a list: {str(raw)[:80]!r}")
    out = []
    for item in data:
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(type(v) is int for v in item)  # not bool, float or str
            and 1 < item[0] < PID_MAX
            and item[1] >= 0
        ):
            raise ValueError(f"process record entry {item!r} is not [pid, start time]")
        out.append((item[0], item[1]))
    return out


def kill_recorded(records: list[tuple[int, int]]) -> None:
    """On the host: SIGKILL the agent (first record) and worker groups (the rest) that are
    still the recorded processes (see the module docstring). Errors are ignored: a
    process that is gone needs no kill."""
    for i, (pid, recorded) in enumerate(records):
        now = start_time(pid)
        if not recorded or (now and now != recorded):
            continue  # never seen alive, or the pid now belongs to another process
        try:
            if i > 0:
                os.killpg(pid, signal.SIGKILL)  # also when the leader is gone (docstring)
            elif now:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    kill_recorded([(int(pid), int(start)) for pid, start in (item.split(":") for item in sys.argv[1:])])
