"""Ranks with identical stacks grouped into one line each, and the one-line cause of a
hang (the majority's stack against the odd ranks out). Pure: no process is touched.

A compact stack is what the user's code was doing: the library function it called
(``all_reduce``) and then its own frames with file:line, innermost first::

    ranks 0-2,4-7 (7): all_reduce <- step (train.py:42) <- main (train.py:80)
    rank 3: load_batch (data.py:17) <- main (train.py:79)

Library frames (the standard library, site-packages, distlaunch itself, native frames)
are left out of the compact form; ``full=True`` keeps every frame. Ranks are grouped by
the text shown, so two ranks shown alike are always one group.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..progress import rank_ranges
from .stacks import Frame, RankStack, StackError

# how many of the user's own frames the compact form shows
USER_FRAMES = 3

_LIB_DIRS = tuple(
    sorted(
        {
            os.path.join(os.path.realpath(p), "")
            for p in (
                sysconfig.get_path("stdlib"),
                sysconfig.get_path("platstdlib"),
                sysconfig.get_path("purelib"),
                sysconfig.get_path("platlib"),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # distlaunch
            )
            if p
        }
    )
)


def is_library(frame: Frame) -> bool:
    """True for a frame not of the user's program: native, frozen, the standard library,
    an installed package or distlaunch itself."""
    p = frame.path
    if frame.native or p.startswith("<"):
        return True
    if "/site-packages/" in p or "/dist-packages/" in p:
        return True
    return p.startswith(_LIB_DIRS) or os.path.realpath(p).startswith(_LIB_DIRS)


def ranks_label(ranks: Iterable[int]) -> str:
    """``rank 3`` for one rank, ``ranks 0-2,4-7 (7)`` for several."""
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rank_ranges(rs)} ({len(rs)})"


def _frame_text(f: Frame) -> str:
    return f"{f.name} ({f.file})" if f.native else f"{f.name} ({f.file}:{f.line})"


@dataclass(frozen=True)
class StackGroup:
    """Ranks showing one identical stack of one thread (``thread`` None: the main
    thread), or (``error`` set) ranks whose stack could not be read for one reason.

    ``frames``: the frames shown, innermost first. ``what`` / ``where``: the call the
    thread waits in and the user's file:line around it (for ``hang_cause``)."""

    ranks: tuple[int, ...]
    thread: str | None
    frames: tuple[str, ...]
    what: str = ""
    where: str = ""
    error: str | None = None


def _is_wrapper(name: str) -> bool:
    """A decorator's inner function (``_exception_logger.<locals>.wrapper``, torch's
    logging wrapper around every collective): not what the user called."""
    return "<locals>" in name or name in ("wrapper", "wrapped", "inner", "decorated", "_fn")


def _called(frames: tuple[Frame, ...], k: int) -> int:
    """The index of the library function the user's frame ``k`` called, past decorators'
    wrappers (``all_reduce``, not torch's ``wrapper`` around it); ``k`` when none."""
    c = k - 1 if k > 0 else k
    while 0 < c < k and _is_wrapper(frames[c].name):
        c -= 1
    return c


def _shown(frames: tuple[Frame, ...], full: bool) -> tuple[tuple[str, ...], str, str]:
    """(frames shown, what, where) of one thread's stack."""
    if not frames:
        return (), "?", ""
    user = [i for i, f in enumerate(frames) if not is_library(f)]
    if not user:  # only library code (a helper thread): its innermost frames
        top = frames[0]
        shown = frames if full else frames[:USER_FRAMES]
        return tuple(_frame_text(f) for f in shown), top.name, "" if top.native else f"{top.file}:{top.line}"
    k = user[0]
    c = _called(frames, k)
    what = frames[c].name
    where = f"{frames[k].file}:{frames[k].line}"
    if full:
        return tuple(_frame_text(f) for f in frames), what, where
    head = (frames[c].name,) if k > 0 else ()
    return head + tuple(_frame_text(frames[i]) for i in user[:USER_FRAMES]), what, where


def group_stacks(stacks: Mapping[int, RankStack | StackError], full: bool = False) -> list[StackGroup]:
    """Group ranks with identical stacks, thread by thread. Order: the main thread's
    groups (largest first, then by lowest rank), then the ranks whose stack could not be
    read (by reason), then the other threads' groups (by thread name, largest first)."""
    main: dict[tuple[str, ...], list[int]] = {}
    other: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    errors: dict[str, list[int]] = {}
    info: dict[tuple[str, ...], tuple[str, str]] = {}
    for rank, st in sorted(stacks.items()):
        if isinstance(st, StackError):
            errors.setdefault(st.message, []).append(rank)
            continue
        for t in st.threads:
            shown, what, where = _shown(t.frames, full)
            if t.main:
                main.setdefault(shown, []).append(rank)
                info.setdefault(shown, (what, where))
            else:
                # one line per thread name and rank: two identical helper threads of a rank count once
                rs = other.setdefault((t.name, shown), [])
                if not rs or rs[-1] != rank:
                    rs.append(rank)
    by_size = lambda item: (-len(item[1]), item[1][0])
    out = [StackGroup(tuple(rs), None, fr, *info[fr]) for fr, rs in sorted(main.items(), key=by_size)]
    out += [StackGroup(tuple(rs), None, (), error=msg) for msg, rs in sorted(errors.items(), key=by_size)]
    out += [
        StackGroup(tuple(rs), name, fr)
        for (name, fr), rs in sorted(other.items(), key=lambda it: (it[0][0], -len(it[1]), it[1][0]))
    ]
    return out


def _ops_text(ranks: tuple[int, ...], ops: Mapping[int, str]) -> str:
    """`` [op]`` when every rank of the group has the same in-flight op, else each op
    with its ranks; empty when none has one."""
    by_op: dict[str, list[int]] = {}
    for r in ranks:
        if ops.get(r):
            by_op.setdefault(ops[r], []).append(r)
    if not by_op:
        return ""
    if len(by_op) == 1 and len(next(iter(by_op.values()))) == len(ranks):
        return f"  [{next(iter(by_op))}]"
    return "  [" + "; ".join(f"{ranks_label(rs)}: {op}" for op, rs in by_op.items()) + "]"


def format_groups(
    groups: Iterable[StackGroup], ops: Mapping[int, str] | None = None, full: bool = False
) -> str:
    """The groups as text, one line per group (``full``: a header line per group, then
    one indented line per frame). ``ops``: rank -> that rank's in-flight operation
    (``all_reduce #1834, 3.2 s, waiting for ranks 5,7``), appended to its main-thread
    group's line."""
    lines: list[str] = []
    for g in groups:
        label = ranks_label(g.ranks)
        if g.error is not None:
            lines.append(f"{label}: no stack: {g.error}")
            continue
        head = label if g.thread is None else f'{label}, thread "{g.thread}"'
        tail = _ops_text(g.ranks, ops) if ops and g.thread is None else ""
        if full:
            lines.append(f"{head}:{tail}")
            lines.extend(f"    {f}" for f in g.frames or ("(no frames)",))
        else:
            lines.append(f"{head}: {' <- '.join(g.frames) or '(no frames)'}{tail}")
    return "\n".join(lines)


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def hang_cause(groups: Iterable[StackGroup], seconds: float) -> str:
    """The one-line cause of a hang from the main threads' groups: the largest group
    against the odd ranks out, e.g. ``hang: 7 of 8 ranks in all_reduce (train.py:42)
    for 300 s; rank 3 in load_batch at data.py:17``. ``seconds``: how long no rank
    made progress."""
    gs = [g for g in groups if g.thread is None]
    stacks = [g for g in gs if g.error is None]
    errors = [g for g in gs if g.error is not None]
    total = sum(len(g.ranks) for g in gs)
    if not stacks:
        return f"hang: no progress for {_secs(seconds)} s; no rank's stack could be read" + "".join(
            f"; {ranks_label(g.ranks)}: {g.error}" for g in errors
        )
    big = stacks[0]
    where = f" ({big.where})" if big.where else ""
    parts = [f"hang: {len(big.ranks)} of {total} ranks in {big.what}{where} for {_secs(seconds)} s"]
    parts += [
        f"{ranks_label(g.ranks)} in {g.what}" + (f" at {g.where}" if g.where else "") for g in stacks[1:]
    ]
    parts += [f"{ranks_label(g.ranks)}: no stack ({g.error})" for g in errors]
    return "; ".join(parts)
