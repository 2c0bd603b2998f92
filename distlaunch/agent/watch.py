"""The agent's hang watchdog (``--hang-timeout``) and the survivors' stacks at a failure
(``--stacks-on-failure``), for one round of one node's worker group.

Progress of a rank is an output line, a ``distlaunch.heartbeat()`` or a completed
operation on distlaunch's runtime (both read from its ``distlaunch.progress`` record).
The group's event loop calls ``output()`` for each chunk a worker writes and ``check()``
at ``due()``; when no rank of this node progressed for ``timeout`` seconds, ``explain()``
reads every live worker's stack with py-spy (the agent is their parent, see
observe/stacks.py), groups them and names the odd ranks out.

Multi-node: each agent decides for its own workers; ranks are the job's global ranks,
so the cause names them correctly, and the first node to see the hang stops the round
(its cause is the one reported).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import progress
from ..report import say

# The longest a reader of the records waits between two looks (seconds): a hang is seen
# at most this much (or a quarter of the timeout, if shorter) after the timeout.
CHECK_SECONDS = 1.0
# Until some rank shows a first sign of progress (start-up: imports, the program's own
# rendezvous), a hang is declared only after this long, or the timeout if longer (seconds).
STARTUP_SECONDS = 60.0
# Several nodes: how long a node whose ranks all wait alike lets the others claim a hang.
DEFER_SECONDS = 2.0
# How long py-spy may take for one process (seconds).
DUMP_TIMEOUT = 10.0


@dataclass(frozen=True, eq=False)  # never compared: no __eq__/__hash__ built at import
class Explained:
    """What the ranks were doing: ``cause`` one line (a hang's), ``stacks`` the grouped
    stacks, ``odd`` the rank the cause names first (the odd one out), if any."""

    cause: str
    stacks: str
    odd: int | None
    alike: bool = False  # every rank read shows the same main-thread stack


@dataclass(eq=False)  # never compared: no __eq__ built at import
class Watchdog:
    """One round's watchdog. ``timeout``: seconds without progress before a hang (0:
    never). ``records``: rank -> its progress record file. ``report_path``: where the
    dumps are written (None: nowhere). ``note``: added to a hang's cause (e.g. where
    NCCL's flight recorder dumps)."""

    timeout: float
    records: Mapping[int, str]
    stacks_on_failure: bool = True
    report_path: str | None = None
    note: str = ""
    echo: bool = False  # print the stacks when found (several nodes: each shows its own)
    _readers: dict[int, progress.Reader] = field(default_factory=dict)
    _counts: dict[int, int] = field(default_factory=dict)
    _last: float = 0.0
    _due: float | None = None
    _deferred: bool = False
    deferred_with: Explained | None = None  # the hang's explanation when it was deferred
    _moved: bool = False  # some rank has shown progress this round
    _sampler: bool | None = None  # py-spy is there (looked up at the first failure)

    def reads_stacks(self) -> bool:
        """--stacks-on-failure is on and py-spy is installed (looked up once, when a
        worker fails: not on the start-up path)."""
        if self._sampler is None:
            from ..observe.stacks import sampler_path

            self._sampler = sampler_path() is not None
        return self.stacks_on_failure and self._sampler

    def start(self) -> None:
        """The workers are started: progress is counted from now."""
        now = time.monotonic()
        self._last = now
        readers = {}
        for rank, path in self.records.items():
            try:
                readers[rank] = progress.Reader(path)
            except OSError:
                pass  # that rank is watched through its output only
        self._readers = readers  # one assignment: the observer thread iterates over it
        if self.timeout > 0:
            self._due = now + min(CHECK_SECONDS, self.timeout / 4)

    def output(self, now: float) -> None:
        """A worker wrote output: progress."""
        self._last = now
        self._moved = True

    def due(self) -> float | None:
        """When ``check`` must next run (monotonic seconds; None: never)."""
        return self._due

    def check(self, now: float) -> bool:
        """Look at the records; True when no rank progressed for ``timeout`` seconds (or,
        before any rank showed progress, for max(timeout, STARTUP_SECONDS))."""
        if self._due is None:
            return False
        for rank, r in self._readers.items():
            c = r.read().count
            if c != self._counts.get(rank, 0):
                self._counts[rank] = c
                self._last = now
                self._moved = True
        idle = now - self._last
        # until a first sign of life, start-up (imports, rendezvous) gets STARTUP_SECONDS
        limit = self.timeout if self._moved else max(self.timeout, STARTUP_SECONDS)
        if idle >= limit:
            self._due = None  # once per round
            return True
        self._due = now + min(CHECK_SECONDS, self.timeout / 4, limit - idle)
        return False

    def defer(self, now: float) -> bool:
        """Several nodes: this node's ranks all wait alike, so the odd rank out is likely on
        another node, whose agent sees the hang at about the same time. Look again in
        DEFER_SECONDS (once per round) so that node's cause, which names it, stands first.
        False when there is one node or this round deferred already."""
        if not self.echo or self._deferred:
            return False
        self._deferred = True
        self._due = now + DEFER_SECONDS
        return True

    def idle(self, now: float) -> float:
        """Seconds since the last progress of any rank."""
        return now - self._last

    def ops(self) -> dict[int, str]:
        """rank -> its operation in flight (``all_reduce #12, 3.0 s, waiting for rank 2``)."""
        out = {}
        for rank, r in self._readers.items():
            d = r.read().describe()
            if d:
                out[rank] = d
        return out

    def in_flight(self) -> dict[int, tuple[str, float]]:
        """rank -> (its operation in flight without its age, seconds in flight), for
        ``distlaunch top``'s records."""
        out = {}
        for rank, r in self._readers.items():
            p = r.read()
            if p.op is not None and p.op_age is not None:
                out[rank] = (", ".join(x for x in (p.label(), p.waiting) if x), p.op_age)
        return out

    def explain(self, pids: Mapping[int, int], idle: float | None, failed: str = "") -> Explained | None:
        """Read the stacks of ``pids`` (rank -> pid) and explain them: a hang's cause when
        ``idle`` (seconds without progress) is given, else the survivors of ``failed``
        (a line saying which rank failed). Writes them to ``report_path`` and, with
        ``echo``, prints them (else the root cause shows them). Blocks while py-spy
        reads (about 0.1 s per process; at most DUMP_TIMEOUT). None when there is
        nothing to read, or py-spy is missing."""
        from ..observe.group import format_groups, group_stacks, hang_cause, rank_ranges
        from ..observe.stacks import dump_stacks

        if not pids:
            return None
        try:
            stacks = dump_stacks(pids, timeout=DUMP_TIMEOUT)
        except FileNotFoundError as e:
            say(f"cannot read the workers' stacks: {e}")
            return None
        groups = group_stacks(stacks)
        text = format_groups(groups, self.ops())
        main = [g for g in groups if g.thread is None and g.error is None]
        odd = main[-1].ranks[0] if len(main) > 1 else (main[0].ranks[0] if main else None)
        cause = "" if idle is None else hang_cause(groups, idle) + (f"; {self.note}" if self.note else "")
        if self.echo:
            say(cause or f"{failed}; where the other ranks of this node were (ranks {rank_ranges(pids)}):")
            for line in text.splitlines():
                say(f"    {line}")
        if self.report_path:
            try:
                with open(self.report_path, "a") as f:
                    f.write((cause or failed) + "\n" + text + "\n\n")
            except OSError as e:
                say(f"cannot write {self.report_path} ({e.strerror}); the stacks are above")
        return Explained(cause, text, odd, len(main) == 1 and len(main[0].ranks) == len(pids))


def nccl_trace_env(base: Mapping[str, str], log_root: str | None) -> tuple[dict[str, str], str]:
    """torch's NCCL flight recorder for a job with ``--hang-timeout``: its ring buffer on
    (``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``), dumped on
    NCCL's own timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``), into ``log_root``
    (``TORCH_FR_DUMP_TEMP_FILE``, formerly ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; torch
    appends the rank); each only when the user set neither name. Returns the variables
    to add and a note naming where the dumps go."""
    out: dict[str, str] = {}
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & base.keys():
        out["TORCH_FR_BUFFER_SIZE"] = "2000"
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in base:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    prefix = base.get("TORCH_FR_DUMP_TEMP_FILE") or base.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix is None and log_root is not None:
        prefix = out["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(log_root, "nccl_trace_rank_")
    where = prefix or "/tmp/nccl_trace_rank_"  # torch's default
    return out, f"NCCL's flight recorder, if NCCL timed out: {where}<rank>"
