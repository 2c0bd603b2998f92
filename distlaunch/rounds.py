"""The vocabulary of the round protocol: every store key a job uses, the typed causes
that stop a round with their JSON codec, and the pure record a failure carries
(:class:`WorkerFailure`). Pure: no store, no processes, nothing of distlaunch imported
(the bottom of the launcher's layers: errors, policy and agent/ build on it).

Keys live under ``<run_id>/`` (values are JSON):

    r<R>/plan         head mode: {"members": [node ids], "restarts": N} or {"end": true}
    r<R>/node/<K>     node K joined round R: {"slots", "host", "addr"}
    r<R>/ready        count of nodes that published r<R>/node/<K>; the one that brings it
                      to the round's size publishes r<R>/members
    r<R>/members      every node's r<R>/node/<K> value, as one JSON list in node-rank order
                      (read by node 0 and the head, for the round's line and events)
    r<R>/seat/<K>     "first rank,world size" of node K, written with r<R>/members: all a
                      node needs to start its workers, so each waits on its own short key
    r<R>/master       {"addr", "port", "restarts"}: MASTER_ADDR/MASTER_PORT for round R
                      (node 0 picks) and the job's restart count
    r<R>/stop         the first cause that stopped round R (a compare_set: first writer
                      wins), as encoded by :func:`encode_cause`
    r<R>/pgids/<K>    [[agent pid, start], [worker pgid, start]...] of node K in round R
                      (start: /proc start time, so the head never kills a reused pid)
    r<R>/done/<K>     node K's workers of round R have all exited ("1"; "s": the head
                      stood in for a lost agent)
    r<R>/ndone        count of the r<R>/done/<K> keys; whoever sees it reach the round's
                      size less the lost nodes sets r<R>/alldone, which the barrier awaits
    r<R>/alldone      every node not lost passed round R's exit barrier
    r<R>/left         count of agents that read round R's outcome (the store's host keeps
                      the store up until everyone has)
    r<R>/hb/<K>       node K's heartbeat counter in round R (node K-1 watches it)
    r<R>/lost         "K,": appended by the node that found node K lost in round R
    r<R>/joined       dynamic membership: arrival counter (arrival order = node rank)
    r<R>/closed       dynamic membership: the number of nodes admitted to round R
    agent_exit/<I>    head mode: the agent of host I (its index in the host list) ended
                      normally; an agent whose channel closes without it was lost

R is the round number; the restart count (TORCHELASTIC_RESTART_COUNT, torchrun's
"attempt", the log directory's ``attempt_N``) counts only the rounds that followed a
worker failure. Rounds that follow a membership change (a node joined, a node was lost
and dropped) keep the restart count.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True, eq=False)  # never compared: no __eq__/__hash__ built at import
class RoundKeys:
    """The key names of round ``rnd`` of job ``run_id`` (see the module docstring)."""

    run_id: str
    rnd: int

    def _k(self, name: str) -> str:
        return f"{self.run_id}/r{self.rnd}/{name}"

    @property
    def plan(self) -> str:
        return self._k("plan")

    @property
    def master(self) -> str:
        return self._k("master")

    @property
    def stop(self) -> str:
        return self._k("stop")

    @property
    def left(self) -> str:
        return self._k("left")

    @property
    def joined(self) -> str:
        return self._k("joined")

    @property
    def closed(self) -> str:
        return self._k("closed")

    @property
    def ready(self) -> str:
        return self._k("ready")

    @property
    def members(self) -> str:
        return self._k("members")

    @property
    def ndone(self) -> str:
        return self._k("ndone")

    @property
    def alldone(self) -> str:
        return self._k("alldone")

    @property
    def lost(self) -> str:
        return self._k("lost")

    def node(self, k: int) -> str:
        return self._k(f"node/{k}")

    def seat(self, k: int) -> str:
        return self._k(f"seat/{k}")

    def pgids(self, k: int) -> str:
        return self._k(f"pgids/{k}")

    def done(self, k: int) -> str:
        return self._k(f"done/{k}")

    def hb(self, k: int) -> str:
        return self._k(f"hb/{k}")


def agent_exit_key(run_id: str, node_id: int) -> str:
    """Head mode: set by the agent of host ``node_id`` when it ends normally."""
    return f"{run_id}/agent_exit/{node_id}"


# --- records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerFailure:
    """How a worker failed: the root-cause record shown to the user."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    returncode: int  # negative: killed by signal -returncode (subprocess convention)
    timestamp: float  # time.time() when the launcher saw the exit
    stderr_tail: str
    error_file_text: str | None = None
    # --hang-timeout: the group made no progress and was stopped; ``cause`` is the hang's
    # one line (``hang: 3 of 4 ranks in all_reduce (train.py:42) for 5.0 s; rank 2 in ...``)
    hang: bool = False
    cause: str = ""
    # the node's other ranks' grouped stacks when this failure was seen (--stacks-on-failure)
    stacks: str = ""

    @property
    def exit_code(self) -> int:
        """What a shell would report: the exit status, or 128+N for death by signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode

    @property
    def how(self) -> str:
        if self.hang:
            return f"stopped by the hang watchdog (exit code {self.exit_code})"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            return f"killed by {name} (exit code {self.exit_code})"
        return f"exit code {self.returncode}"


# --- stop causes --------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A worker exited non-zero or died by a signal (the root-cause record)."""

    failure: WorkerFailure


@dataclass(frozen=True)
class Signal:
    """A launcher (or the head) was told to stop by signal ``signum``."""

    signum: int


@dataclass(frozen=True)
class Lost:
    """Node rank ``node`` of the round stopped answering (``why`` says how it was seen)."""

    node: int
    why: str


@dataclass(frozen=True)
class Join:
    """Dynamic membership: a node arrived after the round closed."""


@dataclass(frozen=True)
class Over:
    """The exit barrier passed with nothing else recorded: every worker succeeded."""


Cause = Failure | Signal | Lost | Join | Over

_KINDS = {"failure": Failure, "signal": Signal, "lost": Lost, "join": Join, "over": Over}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}


def cause_to_dict(cause: Cause) -> dict[str, Any]:
    """The JSON form: ``{"kind": ..., <fields>}``; a failure's record is under
    ``"failure"``. Used for the stop key and for events.jsonl."""
    if isinstance(cause, Failure):
        return {"kind": "failure", "failure": dataclasses.asdict(cause.failure)}
    return {"kind": _NAMES[type(cause)], **dataclasses.asdict(cause)}


def cause_from_dict(d: dict[str, Any]) -> Cause:
    """Inverse of :func:`cause_to_dict`. Raises KeyError/TypeError for a malformed value."""
    cls = _KINDS[d["kind"]]
    if cls is Failure:
        return Failure(WorkerFailure(**d["failure"]))
    return cls(**{k: v for k, v in d.items() if k != "kind"})


def encode_cause(cause: Cause) -> str:
    return json.dumps(cause_to_dict(cause))


def decode_cause(raw: bytes | str) -> Cause:
    return cause_from_dict(json.loads(raw))
