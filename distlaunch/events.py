"""The job's events: one line per rendezvous round and per round's end for the user, and
a machine-readable JSON-lines file ``<log-dir>/<run-id>/events.jsonl``.

Event records (``time`` is Unix seconds):

    {"event": "round", "round": R, "restart_count": N, "members": [{"node", "host", "workers"}]}
    {"event": "round_end", "round": R, "cause": null | {"kind": "failure" | "join" | "lost" | "signal", ...}}
                                                    (the cause as rounds.cause_to_dict writes it)
    {"event": "drop", "host": H, "why": ...}        head mode: a host left out from now on
    {"event": "end", "why": ...}                    head mode: too few hosts left
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .report import say
from .rounds import Cause, Failure, Join, Lost, Signal, cause_from_dict, cause_to_dict

if TYPE_CHECKING:  # rendezvous imports this module's users; for annotations only
    from .rendezvous import Member


def round_event(
    rnd: int, restarts: int, members: Iterable[Member] | None, nodes: int, workers: int
) -> dict[str, Any]:
    """A round of ``nodes`` nodes and ``workers`` workers started with restart count
    ``restarts``; ``members`` (rendezvous.Member), where known, name them."""
    event = {"event": "round", "round": rnd, "restart_count": restarts, "nodes": nodes, "workers": workers}
    if members is not None:
        event["members"] = [{"node": m.node_rank, "host": m.host, "workers": m.slots} for m in members]
    return event


def round_end_event(rnd: int, cause: Cause | None) -> dict[str, Any]:
    """Round ``rnd`` ended for ``cause`` (None: every worker succeeded)."""
    return {"event": "round_end", "round": rnd, "cause": None if cause is None else cause_to_dict(cause)}


def describe_cause(cause: Cause | None) -> str:
    if cause is None:
        return "every worker succeeded"
    if isinstance(cause, Failure):
        f = cause.failure
        rc = f.returncode
        how = (
            f"killed by {signal.Signals(-rc).name}"
            if rc < 0 and -rc in signal.valid_signals()
            else f"exit code {rc}"
        )
        return f"rank {f.rank} (local rank {f.local_rank}) on node {f.node_rank} ({f.host}) {how}"
    if isinstance(cause, Join):
        return "a node joined"
    if isinstance(cause, Lost):
        return f"node {cause.node} lost ({cause.why})"
    if isinstance(cause, Signal):
        return f"stopped by {signal.Signals(cause.signum).name}"
    return type(cause).__name__.lower()


def one_line(event: dict[str, Any]) -> str:
    if event["event"] == "drop":
        return f"dropping host {event['host']}: {event['why']}"
    if event["event"] == "end":
        return f"ending the job: {event['why']}"
    if event["event"] == "round":
        if "members" not in event:
            return (
                f"round {event['round']}: {event['nodes']} node(s), {event['workers']} worker(s), "
                f"restart count {event['restart_count']}"
            )
        members = ", ".join(f"{m['host']}:{m['workers']}" for m in event["members"])
        return (
            f"round {event['round']}: {event['nodes']} node(s) [{members}], "
            f"restart count {event['restart_count']}"
        )
    cause = event["cause"]
    return (
        f"round {event['round']} ended: {describe_cause(None if cause is None else cause_from_dict(cause))}"
    )


class EventLog:
    """Thread-safe. ``emit(event)`` appends to the events file (if ``log_dir``) and shows
    the one-line form through ``report.say`` when ``verbose(event)`` says so. A file that
    cannot be written is given up with one warning said; emit never raises."""

    def __init__(
        self,
        log_dir: str | None,
        run_id: str,
        verbose: Callable[[dict[str, Any]], bool] = lambda e: True,
    ):
        self.path = os.path.join(log_dir, run_id, "events.jsonl") if log_dir else None
        self.verbose = verbose
        self._lock = threading.Lock()

    def emit(self, event: dict[str, Any]) -> None:
        event = {**event, "time": round(time.time(), 3)}
        with self._lock:
            if self.path:
                try:
                    os.makedirs(os.path.dirname(self.path), exist_ok=True)
                    with open(self.path, "a") as f:
                        f.write(json.dumps(event) + "\n")
                except OSError as e:  # disk full, EIO ...: the job goes on without the file
                    path, self.path = self.path, None
                    say(f"warning: cannot write {path} ({e.strerror}); events are no longer recorded there")
            if self.verbose(event):
                say(one_line(event))
