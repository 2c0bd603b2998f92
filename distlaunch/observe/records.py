"""Compact per-rank records for ``distlaunch top``: what each rank's process is doing,
sampled by its node's agent (psutil) and published through the job's store.

Each node writes one value per publish, ``<prefix>/node/<node>`` (a small JSON object
with its publish time and its ranks' records), and adds its name once to
``<prefix>/nodes``; a viewer reads the names and then every node's value in one
``multi_get``. Nothing secret goes in a record: the last output line is the worker's own
console output, which the job's users see anyway.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import psutil

# the longest last output line a record carries (characters); the table cuts it further
LINE_WIDTH = 200

VERSION = 1


@dataclass(frozen=True)
class RankRecord:
    """One rank as sampled: ``state`` is the agent's word for it (starting, running,
    stopping, exited CODE, restarted N times), ``cpu`` percent of one CPU since the last
    sample, ``rss`` bytes, ``line_age`` seconds since its last output line (None: none
    yet) and ``line`` that line, ``op`` the operation in flight on distlaunch's runtime
    (``all_reduce #1834, waiting for ranks 5,7``) and ``op_age`` seconds it has been in
    flight (None: no operation), ``devices`` the GPUs it sees (its visibility variable's
    value, e.g. ``CUDA_VISIBLE_DEVICES=3``; empty: none set)."""

    rank: int
    node: str
    pid: int
    state: str
    cpu: float = 0.0
    rss: int = 0
    line_age: float | None = None
    line: str = ""
    op: str | None = None
    op_age: float | None = None
    devices: str = ""

    def encode(self) -> list[object]:
        """A JSON-able list (positional: a record is a few dozen bytes)."""
        r1 = lambda x: None if x is None else round(x, 1)
        return [
            self.rank,
            self.node,
            self.pid,
            self.state,
            round(self.cpu, 1),
            self.rss,
            r1(self.line_age),
            self.line[:LINE_WIDTH],
            self.op,
            r1(self.op_age),
            self.devices,
        ]

    @classmethod
    def decode(cls, value: Sequence[object]) -> RankRecord:
        """The record ``encode`` gave. Raises ValueError for anything else."""
        try:
            rank, node, pid, state, cpu, rss, line_age, line, op, op_age, devices = value
            return cls(
                int(rank),  # type: ignore[call-overload]
                str(node),
                int(pid),  # type: ignore[call-overload]
                str(state),
                float(cpu),  # type: ignore[arg-type]
                int(rss),  # type: ignore[call-overload]
                None if line_age is None else float(line_age),  # type: ignore[arg-type]
                str(line),
                None if op is None else str(op),
                None if op_age is None else float(op_age),  # type: ignore[arg-type]
                str(devices),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a rank record: {value!r:.80}") from e

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class NodeRecords:
    """One node's last publish: ``time`` its wall clock then (seconds since the epoch,
    so a viewer can tell a node that stopped publishing) and its ranks' records."""

    node: str
    time: float
    records: tuple[RankRecord, ...]


def encode_node(records: Iterable[RankRecord], now: float | None = None) -> bytes:
    t = time.time() if now is None else now
    return json.dumps(
        {"v": VERSION, "t": round(t, 2), "r": [r.encode() for r in records]}, separators=(",", ":")
    ).encode()


def decode_node(node: str, value: bytes) -> NodeRecords:
    """Raises ValueError for a value ``encode_node`` did not write."""
    try:
        d = json.loads(value)
        if d["v"] != VERSION:
            raise ValueError(f"record version {d['v']!r}, this distlaunch reads {VERSION}")
        return NodeRecords(node, float(d["t"]), tuple(RankRecord.decode(r) for r in d["r"]))
    except (TypeError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"node {node}'s records are not readable: {e}") from e


@dataclass(frozen=True)
class ProcSample:
    """``cpu``: percent of one CPU since the previous sample (0.0 on the first);
    ``rss``: resident memory in bytes."""

    cpu: float
    rss: int


class Sampler:
    """CPU % and RSS of processes, one ``psutil.Process`` kept per pid across samples
    (its CPU times are the baseline of the next percentage). Not thread-safe."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: Mapping[int, int]) -> dict[int, ProcSample | None]:
        """rank -> sample for each rank's pid; None for a process that is gone (or not
        readable). Reads /proc once per process; never blocks on the processes."""
        procs = {}
        for pid in set(pids.values()):
            p = self._procs.get(pid)
            if p is None:
                try:
                    p = psutil.Process(pid)
                except psutil.Error:
                    continue
            procs[pid] = p
        self._procs = procs  # forget processes no longer asked about
        out: dict[int, ProcSample | None] = {}
        for rank, pid in pids.items():
            p = procs.get(pid)
            try:
                if p is None:
                    raise psutil.NoSuchProcess(pid)
                with p.oneshot():
                    out[rank] = ProcSample(p.cpu_percent(None), p.memory_info().rss)
            except psutil.Error:
                out[rank] = None
        return out


class KeyValueStore(Protocol):
    """What these functions use of a store: StoreClient and PrefixStore both are one."""

    def set(self, key: str, value: bytes | str) -> None: ...
    def get(self, key: str, timeout: float | None = None) -> bytes: ...
    def append(self, key: str, value: bytes | str) -> None: ...
    def check(self, keys: Iterable[str]) -> bool: ...
    def multi_get(self, keys: Iterable[str], timeout: float | None = None) -> list[bytes]: ...


class Publisher:
    """Publishes one node's records under ``prefix`` in a store (see the module
    docstring). ``node`` must not contain a newline (names are newline-separated)."""

    def __init__(self, store: KeyValueStore, prefix: str, node: str) -> None:
        if not node or "\n" in node:
            raise ValueError(f"node name {node!r} cannot be published: it must be one non-empty line")
        self.store, self.prefix, self.node = store, prefix, node
        self._listed = False

    def publish(self, records: Iterable[RankRecord], now: float | None = None) -> None:
        """One ``set`` (and, the first time, one ``append`` of the node's name, after
        the value so a reader never finds a name without its value). Raises the store's
        errors (StoreConnectionError when the store is gone)."""
        self.store.set(f"{self.prefix}/node/{self.node}", encode_node(records, now))
        if not self._listed:
            self.store.append(f"{self.prefix}/nodes", self.node + "\n")
            self._listed = True


def read_records(store: KeyValueStore, prefix: str, timeout: float = 10.0) -> list[NodeRecords]:
    """Every node's last publish under ``prefix``, in the order nodes first published;
    empty when none has. Blocks at most ``timeout`` seconds. Raises ValueError for a
    value that is not a node's records, and the store's errors."""
    key = f"{prefix}/nodes"
    if not store.check([key]):
        return []
    names = list(dict.fromkeys(n for n in store.get(key, timeout).decode().split("\n") if n))
    values = store.multi_get([f"{prefix}/node/{n}" for n in names], timeout)
    return [decode_node(n, v) for n, v in zip(names, values)]


def all_records(nodes: Iterable[NodeRecords]) -> list[RankRecord]:
    """Every rank's record of ``nodes``, sorted by rank."""
    return sorted((r for n in nodes for r in n.records), key=lambda r: r.rank)
