"""One running operation: :class:`OpContext`, and :class:`Members`, the part of a group
an operation needs (who is in it, this rank's place, its sequence numbers, whether it
is broken).

This layer sits between the wire/buffer modules and the transports' algorithms: the
algorithms, the shared-memory channel and the backends see only an OpContext and its
``group`` (a :class:`Members`), never :class:`~.group.ProcessGroup`, so nothing below
the group imports it. The node-local, leader and column sub-groups of a hierarchical
group are plain Members.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, NamedTuple

from .errors import CollectiveArgumentError, CollectiveMismatchError, CollectiveTimeoutError
from .ops import ReduceOp
from .transport import Check, Request
from .wire import COLL, DTYPE_NAMES, NO_REDOP, OP_CODES, OP_NAMES, Header

DEFAULT_TIMEOUT = 1800.0


def to_seconds(timeout: float | datetime.timedelta | None, name: str = "timeout") -> float | None:
    """float seconds from None, a positive number or a datetime.timedelta; raises
    CollectiveArgumentError for anything else."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise CollectiveArgumentError(
            f"{name} must be a positive number of seconds or a timedelta, not {timeout!r}"
        )
    return float(timeout)


class OpTimeout(Exception):
    """Internal: a wait ran past the operation's deadline; ``peers`` are the group ranks
    waited on. The group turns it into CollectiveTimeoutError naming the missing ranks."""

    mapped = False  # True once its peers are the ranks of the parent group (hierarchy)

    def __init__(self, peers: list[int]):
        super().__init__(peers)
        self.peers = peers


class Members:
    """The members of a group as an operation sees them.

    ``runtime``: anything with ``rank`` (this process's global rank) and ``transport``;
    ``gid``: the group id in message headers; ``ranks``: sorted global ranks; ``timeout``:
    seconds per operation. ``broken`` is the first error that made the group unusable
    (set by failure handling, read by waits); ``seq`` the last sequence number taken.
    """

    def __init__(self, runtime: Any, gid: int, ranks: list[int], timeout: float, name: str):
        self.runtime = runtime
        self.gid = gid
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(runtime.rank)
        self.timeout = timeout
        self.name = name
        self.broken: BaseException | None = None
        self.seq = 0
        self._index = {g: i for i, g in enumerate(self.ranks)}

    def __repr__(self) -> str:
        return f"ProcessGroup({self.name}, ranks={self.ranks})"

    def next_seq(self) -> int:
        """Take the next sequence number (callers serialise: a sub-group's operations run
        inside its parent's)."""
        self.seq += 1
        return self.seq

    def is_member(self, global_rank: int) -> bool:
        return global_rank in self._index

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Rank inside the group of ``global_rank``; CollectiveArgumentError if it is not
        a member."""
        try:
            return self._index[global_rank]
        except (KeyError, TypeError):
            raise CollectiveArgumentError(
                f"{what}={global_rank!r} is not a rank of {self.name} (ranks {self.ranks})"
            ) from None

    def check_group_rank(self, group_rank: int, what: str) -> int:
        """``group_rank`` itself; CollectiveArgumentError when it is not an int in 0..size-1."""
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < self.size:
            raise CollectiveArgumentError(
                f"{what}={group_rank!r} is outside 0..{self.size - 1} of {self.name}"
            )
        return group_rank


class SmallCall(NamedTuple):
    """A call as the group's small-operation fast path records it (the fields of
    OpContext it sets)."""

    name: str
    op: int
    dtype: int
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose: OpContext's name
    root: int = -1
    redop: int = NO_REDOP
    record: bytes | None = None  # the packed call record, when made once for many calls


def describe(op: int, dtype: int, count: int, root: int, redop: int, ranks: list[int]) -> str:
    """``all_reduce(dtype=float32, count=4, op=SUM)``: a call for error messages (``root``
    is a group rank, shown as the global rank from ``ranks``)."""
    parts = [f"dtype={DTYPE_NAMES.get(dtype, '?')}", f"count={count}"]
    if root >= 0:
        parts.append(f"root={ranks[root] if root < len(ranks) else root}")
    if redop != NO_REDOP:
        parts.append(f"op={ReduceOp(redop).name if redop in ReduceOp._value2member_map_ else redop}")
    return f"{OP_NAMES[op] if op < len(OP_NAMES) else op}({', '.join(parts)})"


class OpContext:
    """One running collective: posts its messages with the right header and expectation,
    and waits for them against the operation's deadline.

    ``shm`` is the shared-memory channel (:class:`~.transport.shm.ShmChannel`) the
    operation runs on (set by the backend choice), or None; typed loosely so that this
    module needs nothing above it (the algorithms on the channel annotate it).
    """

    def __init__(
        self,
        group: Members,
        name: str,
        seq: int,
        dtype: int | None = None,
        count: int = 0,
        root: int = -1,
        redop: int | None = None,
        timeout: float | None = None,
    ):
        self.group = group
        self.name = name
        self.seq = seq
        self.op = OP_CODES[name]
        self.dtype = dtype or 0
        self.count = count
        self.root = root
        self.redop = NO_REDOP if redop is None else int(redop)
        self.record: bytes | None = None  # the packed call record (shared memory), once made
        self.timeout = group.timeout if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout
        self._posted: list[Request] = []
        # the ShmChannel (transport.shm, which imports this module) while the operation
        # runs on shared memory, else None
        self.shm: Any = None
        self._transport = group.runtime.transport
        self._me = group.runtime.rank

    def _header(self, step: int, nbytes: int) -> Header:
        return Header(
            COLL,
            self.dtype,
            self.op,
            self.redop,
            self._me,
            self.group.gid,
            self.seq,
            step,
            self.root,
            self.count,
            nbytes,
        )

    def describe(self, op: int, dtype: int, count: int, root: int, redop: int) -> str:
        """A call (this one's fields, or a peer's) as text for mismatch errors."""
        return describe(op, dtype, count, root, redop, self.group.ranks)

    def describe_mine(self) -> str:
        return self.describe(self.op, self.dtype, self.count, self.root, self.redop)

    def _check(self, step: int) -> Check:
        def check(h: Header) -> CollectiveMismatchError | None:
            if (h.op, h.dtype, h.count, h.root, h.redop, h.step) == (
                self.op,
                self.dtype,
                self.count,
                self.root,
                self.redop,
                step,
            ):
                return None
            theirs = self.describe(h.op, h.dtype, h.count, h.root, h.redop)
            mine = self.describe_mine()
            if theirs == mine:
                theirs += f" at protocol step {h.step}"
                mine += f" at protocol step {step}"
            return CollectiveMismatchError(f"rank {h.src} called {theirs} but rank {self._me} called {mine}")

        return check

    def send(self, peer: int, payload: memoryview, step: int = 0) -> Request:
        """Post ``payload`` (bytes view, kept unchanged until waited) to group rank ``peer``."""
        try:
            req = self._transport.isend(
                self.group.ranks[peer],
                self._header(step, len(payload)),
                payload,
                self.deadline,
                owner=self.group.gid,
            )
        except CollectiveTimeoutError:
            raise OpTimeout([peer]) from None
        req.grank = peer
        self._posted.append(req)
        self._check_broken()
        return req

    def recv(self, peer: int, buf: memoryview, step: int = 0) -> Request:
        """Post a receive from group rank ``peer`` into ``buf`` (bytes view)."""
        req = self._transport.irecv(
            self.group.ranks[peer],
            (COLL, self.group.gid, self.seq),
            buf,
            self._check(step),
            owner=self.group.gid,
        )
        req.grank = peer
        self._posted.append(req)
        self._check_broken()
        return req

    def _check_broken(self) -> None:
        # an ABORT may have arrived before this request was posted
        if self.group.broken is not None:
            raise self.group.broken

    def wait(self, *reqs: Request) -> None:
        """Wait for ``reqs``; raises their error, or OpTimeout past the deadline."""
        for r in reqs:
            if not r.wait(max(0.0, self.deadline - time.monotonic())):
                raise OpTimeout(sorted({q.grank for q in reqs if not q.done}))
            if r.error is not None:
                raise r.error

    def check_leftovers(self) -> None:
        """Raise CollectiveMismatchError if a message of this operation arrived that no
        receive took (its sender ran a different op, root or size)."""
        late = self._transport.take_leftovers((COLL, self.group.gid, self.seq))
        if late:
            h = late[0]
            theirs = self.describe(h.op, h.dtype, h.count, h.root, h.redop)
            raise CollectiveMismatchError(
                f"rank {h.src} sent data for {theirs} that this rank did not expect in {self.describe_mine()}"
            )

    def cancel_pending(self) -> None:
        """Withdraw this operation's receives that have not started to match."""
        for r in self._posted:
            if not r.done and not r.is_send:
                self._transport.cancel(r)
        self._posted.clear()
