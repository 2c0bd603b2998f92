"""``distlaunch ps``, ``top`` and ``stacks``: find this user's running job on this host
(observe/registry.py), open its store with the job's own token, and read what its agents
publish (agent/observer.py)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from ..errors import ConfigError, StoreError
from . import registry
from .group import format_groups, group_stacks
from .records import all_records, read_records
from .stacks import RankStack, StackError, decode_stacks
from .table import print_table

if TYPE_CHECKING:
    from ..store.client import StoreClient

PREFIX = "{}/observe"  # agent/observer.py's prefix(run_id)


def pick_job(run_id: str | None, command: str) -> registry.JobEntry:
    """The registry entry of ``run_id`` (None: the only job running). Raises ConfigError
    (one line) when there is none, or several and no run id."""
    jobs = registry.running_jobs()
    if run_id is not None:
        if run_id not in jobs:
            known = ", ".join(jobs) or "none"
            raise ConfigError(
                f"no running job {run_id!r} of yours on this host (running: {known}); see distlaunch ps"
            )
        return jobs[run_id][0]
    if not jobs:
        raise ConfigError(
            f"no distlaunch job of yours runs on this host ({registry.jobs_dir()} lists none); "
            f"run {command} on a node of the job"
        )
    if len(jobs) > 1:
        raise ConfigError(
            f"{len(jobs)} jobs run here: {', '.join(jobs)}; give one: distlaunch {command} RUN_ID"
        )
    return next(iter(jobs.values()))[0]


def connect(e: registry.JobEntry, timeout: float = 10.0) -> StoreClient:
    from ..store.client import StoreAddress

    try:
        return StoreAddress(e.store_host, e.store_port, e.store_token or "").connect(
            timeout, connect_timeout=5.0
        )
    except StoreError as err:
        raise ConfigError(
            f"cannot reach job {e.run_id}'s store at {e.store_host}:{e.store_port}: {err}"
        ) from None


def ps() -> None:
    """One line per running job of this user on this host."""
    for run_id, entries in registry.running_jobs().items():
        print(registry.describe(run_id, entries))


def top(run_id: str | None, once: bool, as_json: bool) -> None:
    """The table of every rank, once or every second until Ctrl-C."""
    e = pick_job(run_id, "top")
    with connect(e) as c:
        while True:
            try:
                records = all_records(read_records(c, PREFIX.format(e.run_id)))
            except (StoreError, ValueError) as err:
                raise ConfigError(f"cannot read job {e.run_id}'s records: {err}") from None
            if once or as_json:
                print_table(records, as_json=as_json)
                return
            if sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # clear the screen, as watch(1) does
            print_table(records)
            sys.stdout.flush()
            time.sleep(1.0)


def stacks(run_id: str | None, full: bool, timeout: float = 20.0, native: bool = False) -> str:
    """Ask every agent of the job for its ranks' stacks (with ``native``: C frames too,
    py-spy's --native) and return them grouped. Blocks up to ``timeout`` seconds for the
    agents' answers. Raises ConfigError (no such job, its store unreachable)."""
    e = pick_job(run_id, "stacks")
    prefix = PREFIX.format(e.run_id)
    with connect(e, timeout) as c:
        try:
            nodes = [n.node for n in read_records(c, prefix)]
            n = c.add(f"{prefix}/stacks_req", 1)
            c.set(f"{prefix}/stacks_req/{n}", "native" if native else "1")  # what the agents wait for
            got: dict[int, RankStack | StackError] = {}
            ops: dict[int, str] = {}
            missing = []
            end = time.monotonic() + timeout
            for node in nodes:
                try:
                    c.wait([f"{prefix}/stacks/{node}/{n}"], max(0.1, end - time.monotonic()))
                except StoreError:
                    missing.append(node)
                    continue
                st, op = decode_stacks(c.get(f"{prefix}/stacks/{node}/{n}"))
                got.update(st)
                ops.update(op)
        except (StoreError, ValueError) as err:
            raise ConfigError(f"cannot read job {e.run_id}'s stacks: {err}") from None
    text = format_groups(group_stacks(got, full=full), ops, full=full)
    if missing:
        text += f"\nno answer within {timeout:g} s from node(s) {', '.join(missing)}"
    return text
