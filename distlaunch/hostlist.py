"""Slurm's compact host lists and task counts: ``n[01-04,07],gpu-a[1-2]`` and ``2(x3),1``.

Slurm writes node sets in its *hostlist* syntax (``SLURM_JOB_NODELIST``,
``SLURM_STEP_NODELIST``, ``scontrol``, ``sinfo``) and per-node task counts in a
run-length form (``SLURM_TASKS_PER_NODE``, ``SLURM_STEP_TASKS_PER_NODE``); ``-H``
host lists accept the same syntax. This module expands both, with the results of
``scontrol show hostnames`` (tests/test_hostlist.py compares them on generated input).

Hostlist syntax, as Slurm's ``hostlist_create`` reads it:

- items are separated by commas, spaces or tabs outside brackets; empty items are
  skipped; other white space and control characters are refused;
- an item is text with bracket groups ``[ranges]``; ``ranges`` is a comma-separated list
  of ``N`` or ``LO-HI`` (decimal, ``LO <= HI``); each number is zero-padded to the width
  of how ``LO`` is written (``n[08-10]`` -> n08 n09 n10, ``n[8-010]`` -> n8 n9 n10);
- several groups in one item expand to every combination in the order of Slurm's
  recursive expansion: the last group varies fastest, and before it the other groups
  from the last-but-one (slowest) to the first: ``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1
  r2n2, but ``a[1-2]b[3-4]c[5-6]`` -> a1b3c5 a1b3c6 a2b3c5 a2b3c6 a1b4c5 ...;
- order and duplicates are kept as written.

One deliberate difference: text after the last group (``node[1-2]-ib``) is accepted,
as newer Slurm releases, python-hostlist and ClusterShell do; Slurm 22.05's ``scontrol``
refuses it.

Standard library only, pure; without ``re`` (~5 ms of a fresh interpreter's CPU): the
Slurm agent step's early start expands ``SLURM_JOB_NODELIST`` before anything else is
imported (``remote.srun.start_early``).
"""

from __future__ import annotations

import itertools

__all__ = ["MAX_HOSTS", "expand_hostlist", "parse_tasks_per_node"]

# Slurm refuses a single range of more than 64 Ki hosts; the whole expansion is capped
# too, so a typo like n[1-99999999] is an error, not a memory blow-up.
MAX_RANGE = 64 * 1024
MAX_HOSTS = 1 << 20


def _decimal(text: str) -> bool:
    r"""``\d+`` as ``re`` reads it in a str pattern: one or more Unicode decimal digits."""
    return text.isdecimal()  # (False for "")


def _split_items(text: str) -> list[str]:
    """Split at commas, spaces and tabs outside brackets (Slurm's separators). Raises
    ValueError for unbalanced or nested brackets, or other white space or control
    characters (Slurm would make them part of a name)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise ValueError(f"host list {text!r}: nested '[' at position {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"host list {text!r}: ']' without '[' at position {i}")
            depth = 0
        elif depth == 0 and ch in ", \t":
            items.append(text[start:i])
            start = i + 1
        elif ch.isspace() or not ch.isprintable():
            raise ValueError(f"host list {text!r}: character {ch!r} at position {i} is not allowed")
    if depth:
        raise ValueError(f"host list {text!r}: '[' is never closed")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_group(group: str, item: str) -> list[str]:
    """``01-03,7`` -> ["01", "02", "03", "7"]."""
    out: list[str] = []
    for part in group.split(","):
        lo_text, dash, hi_text = part.partition("-")  # N or LO-HI
        if not _decimal(lo_text) or (dash and not _decimal(hi_text)):
            raise ValueError(f"host list item {item!r}: bad range {part!r} (use N or LO-HI, decimal)")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if hi < lo:
            raise ValueError(f"host list item {item!r}: range {part!r} runs backwards")
        if hi - lo >= MAX_RANGE:
            raise ValueError(f"host list item {item!r}: range {part!r} holds more than {MAX_RANGE} hosts")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _pieces(item: str) -> list[str]:
    """``item`` (brackets balanced, not nested: ``_split_items``) cut into text, group,
    text, group, ..., text: ``n[1-2]x[3]`` -> ["n", "1-2", "x", "3", ""]."""
    pieces, rest = [], item
    while (i := rest.find("[")) >= 0:
        j = rest.index("]", i)
        pieces += [rest[:i], rest[i + 1 : j]]
        rest = rest[j + 1 :]
    pieces.append(rest)
    return pieces


def _expand_item(item: str) -> list[str]:
    pieces = _pieces(item)
    groups = [_expand_group(p, item) for p in pieces[1::2]]
    total = 1
    for g in groups:
        total *= len(g)
    if total > MAX_HOSTS:
        raise ValueError(f"host list item {item!r} expands to more than {MAX_HOSTS} hosts")
    if not groups:
        return [item]
    # Slurm's order: the last group varies fastest; before it, the other groups from the
    # last-but-one (slowest) to the first (see the module docstring).
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1]
    out = []
    for combo in itertools.product(*(groups[i] for i in order)):
        value = dict(zip(order, combo))
        out.append("".join(p if i % 2 == 0 else value[i // 2] for i, p in enumerate(pieces)))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist (see the module docstring) into host names, in Slurm's
    order, duplicates kept: ``expand_hostlist("n[01-02,07],gpu-a[1-2]")`` ->
    ``["n01", "n02", "n07", "gpu-a1", "gpu-a2"]``. Follows ``scontrol show hostnames``.

    Raises ValueError naming the bad text: unbalanced or nested brackets, an empty,
    non-decimal or backwards range, or more than MAX_HOSTS names.
    """
    out: list[str] = []
    for item in _split_items(text):
        out.extend(_expand_item(item))
        if len(out) > MAX_HOSTS:
            raise ValueError(f"host list {text[:80]!r} expands to more than {MAX_HOSTS} hosts")
    return out


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's run-length task counts (``SLURM_TASKS_PER_NODE``,
    ``SLURM_STEP_TASKS_PER_NODE``): ``"2(x3),1"`` -> ``[2, 2, 2, 1]``, one count per
    node in node order. Raises ValueError naming the bad item (not ``N`` or ``N(xR)``
    with R >= 1, or more than MAX_HOSTS nodes)."""
    out: list[int] = []
    for item in text.strip().split(","):
        count, times, rest = item.strip().partition("(x")  # N or N(xR)
        repeat = rest[:-1] if rest.endswith(")") else ""
        if not _decimal(count) or (times and not (_decimal(repeat) and int(repeat) >= 1)):
            raise ValueError(f"tasks per node {text!r}: bad item {item!r} (use N or N(xR), e.g. 2(x3),1)")
        times_n = int(repeat) if times else 1
        if len(out) + times_n > MAX_HOSTS:
            raise ValueError(f"tasks per node {text[:80]!r} counts more than {MAX_HOSTS} nodes")
        out.extend([int(count)] * times_n)
    return out
