"""The op table: every operation of the collectives is one :class:`OpSpec` entry in
:data:`OPS`, and every transport's algorithm for it registers itself on that entry.

An entry says what the rest of the runtime needs to know about an operation: its
name, its wire code (the header's ``op`` field, which peers compare: codes are never
renumbered), whether it has a root and a reduce op (checked, and carried in the header),
which algorithm it runs (variants such as ``all_gather_into_tensor`` run another
entry's), and how ``distlaunch bench`` measures it. The algorithms register with
:func:`implements` next to their code (:mod:`.algorithms.tcp`, :mod:`.algorithms.shm`,
:mod:`.algorithms.hierarchy`); a backend runs :func:`algorithm` of its transport:

- ``"tcp"``: ``fn(ctx, *args)``, required for every collective;
- ``"shm"``: ``fn(ctx, *args)`` on the group's shared-memory channel; without one the
  shared-memory backend compares the calls on the channel, then runs the TCP algorithm;
- ``"hierarchical"``: ``fn(backend, ctx, *args)`` (a method of the hierarchical backend,
  which holds the sub-groups); without one the operation runs flat over TCP.

An operation whose transport has its own algorithm is *native* there (no TCP messages
under the group's id: the group skips its leftover check).

Adding a collective: one entry below, its TCP algorithm decorated with
``@implements(name, "tcp")`` (and optionally a shared-memory or hierarchical one), then
``ProcessGroup.collective(name, ...)`` runs it; the public wrappers (:mod:`.api`, the
torch backend) only convert buffers. This module imports nothing of the runtime (it
sits beside the wire format, which takes its op codes from here).
"""

from __future__ import annotations

from collections.abc import Callable

TRANSPORTS = ("tcp", "shm", "hierarchical")


class OpSpec:
    """One operation. ``name``: as in torch.distributed (and in error messages);
    ``code``: its wire code; ``root``: the call names a root rank; ``redop``: the call
    takes a ReduceOp (checked against the dtype before anything is sent);
    ``algorithm``: the entry whose algorithms run it ("" = its own); ``bench``: the
    nccl-tests bus bandwidth factor on n ranks when ``distlaunch bench`` measures it
    (None: not benchmarked); ``blocked``: bench's size-defining buffer holds n blocks;
    ``impl``: transport -> algorithm (filled by :func:`implements`). (A plain class:
    dataclasses would add milliseconds to every worker's import.)"""

    __slots__ = ("name", "code", "root", "redop", "algorithm", "bench", "blocked", "impl")

    def __init__(
        self,
        name: str,
        code: int,
        root: bool = False,
        redop: bool = False,
        algorithm: str = "",
        bench: Callable[[int], float] | None = None,
        blocked: bool = False,
    ) -> None:
        self.name, self.code, self.root, self.redop = name, code, root, redop
        self.algorithm, self.bench, self.blocked = algorithm, bench, blocked
        self.impl: dict[str, Callable[..., None]] = {}

    def __repr__(self) -> str:
        return f"OpSpec({self.name!r}, {self.code}, transports={sorted(self.impl)})"


def _ring(n: int) -> float:
    return (n - 1) / n


# in presentation order (``distlaunch bench`` lists its ops so); codes are the wire's
OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("none", 0),
        OpSpec("barrier", 1),
        OpSpec("all_reduce", 4, redop=True, bench=lambda n: 2 * (n - 1) / n),
        OpSpec("broadcast", 2, root=True, bench=lambda n: 1.0),
        OpSpec("reduce", 3, root=True, redop=True),
        OpSpec("scatter", 5, root=True),
        OpSpec("gather", 6, root=True),
        OpSpec("all_gather", 7, bench=_ring, blocked=True),
        OpSpec("all_gather_into_tensor", 8, algorithm="all_gather"),
        OpSpec("reduce_scatter", 9, redop=True, bench=_ring, blocked=True),
        OpSpec("reduce_scatter_tensor", 10, redop=True, algorithm="reduce_scatter"),
        OpSpec("all_to_all", 11, bench=_ring, blocked=True),
        OpSpec("all_to_all_single", 12, algorithm="all_to_all"),
        # point to point: wire codes only (ProcessGroup.isend / irecv run them)
        OpSpec("send", 13),
        OpSpec("recv", 14),
    )
}

# the wire's op names by code, and codes by name
OP_NAMES = tuple(s.name for s in sorted(OPS.values(), key=lambda s: s.code))
OP_CODES = {s.name: s.code for s in OPS.values()}
assert [OP_CODES[n] for n in OP_NAMES] == list(range(len(OPS))), "op codes must be 0..n-1"


def implements(name: str, transport: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: register ``fn`` as operation ``name``'s algorithm on ``transport``
    (one of :data:`TRANSPORTS`); returns ``fn`` unchanged."""
    assert transport in TRANSPORTS, transport

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        OPS[name].impl[transport] = fn
        return fn

    return register


def spec(name: str) -> OpSpec:
    """The entry of operation ``name`` (KeyError for an unknown one)."""
    return OPS[name]


def algorithm(op: OpSpec, transport: str) -> Callable[..., None] | None:
    """``op``'s algorithm on ``transport`` (through the entry it runs), or None."""
    return OPS[op.algorithm or op.name].impl.get(transport)


def benchmarked() -> tuple[str, ...]:
    """The collectives ``distlaunch bench`` measures, in table order."""
    return tuple(s.name for s in OPS.values() if s.bench is not None)
