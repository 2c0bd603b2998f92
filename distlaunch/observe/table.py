"""The ``distlaunch top`` table: one row per rank, drawn with rich on a terminal, as plain
aligned text otherwise (a pipe, a log), or as JSON for scripts (a list of dicts, one per
rank, with RankRecord's field names and units: cpu in percent, rss in bytes, ages in
seconds)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from typing import Literal, TextIO

from .records import RankRecord

HEADERS = ("RANK", "NODE", "PID", "STATE", "CPU%", "RSS", "OP", "OUT AGE", "LAST LINE")
NUMERIC = ("RANK", "PID", "CPU%", "RSS", "OUT AGE")


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units, one decimal, as ``top`` and ``ps``)."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def _age(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f} s"


def headers(records: Sequence[RankRecord]) -> tuple[str, ...]:
    """HEADERS, with a DEVICES column after PID when a rank has GPUs set."""
    if any(r.devices for r in records):
        return (*HEADERS[:3], "DEVICES", *HEADERS[3:])
    return HEADERS


def rows(records: Sequence[RankRecord]) -> list[tuple[str, ...]]:
    """The table's cells, one tuple per record in ``headers(records)``' order."""
    devices = any(r.devices for r in records)
    return [
        (
            str(r.rank),
            r.node,
            str(r.pid),
            *((r.devices or "-",) if devices else ()),
            r.state,
            f"{r.cpu:.1f}",
            human_bytes(r.rss),
            "-" if r.op is None else f"{r.op}, {_age(r.op_age)}",
            _age(r.line_age),
            r.line,
        )
        for r in records
    ]


def plain_table(records: Sequence[RankRecord], width: int = 120) -> str:
    """Aligned columns; each row cut to ``width`` characters (as ``top`` does), so the
    last output line gets what room is left."""
    heads = headers(records)
    cells = [heads, *rows(records)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(heads) - 1)]
    out = []
    for row in cells:
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths))
        out.append(f"{line}  {row[-1]}"[:width].rstrip())
    return "\n".join(out)


def json_table(records: Sequence[RankRecord]) -> str:
    """A JSON list of dicts, one per record (RankRecord's field names)."""
    return json.dumps([r.as_dict() for r in records])


def print_table(
    records: Sequence[RankRecord],
    file: TextIO | None = None,
    as_json: bool = False,
    terminal: bool | None = None,
    width: int | None = None,
) -> None:
    """Write the table of ``records`` to ``file`` (default stdout): JSON when
    ``as_json``, else a rich table when ``terminal`` (default: ``file`` is a tty), else
    plain text. ``width``: columns (default: the terminal's, else 120)."""
    out = sys.stdout if file is None else file
    if as_json:
        out.write(json_table(records) + "\n")
        return
    if terminal is None:
        terminal = out.isatty()
    if width is None:
        width = shutil.get_terminal_size((120, 24)).columns
    if not terminal:
        out.write(plain_table(records, width) + "\n")
        return
    from rich.console import Console  # only here: the agent and plain output never pay for it
    from rich.table import Table
    from rich.text import Text

    heads = headers(records)
    cells = rows(records)
    fits = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    # rich squeezes the first columns to nothing when the last is too wide: cut it here
    # (and the in-flight op wraps in its cell when the last line would get under 20)
    op = heads.index("OP")
    avail = width - sum(fits) + fits[op] + fits[-1] - 2 * (len(heads) - 1)
    op_w = min(fits[op], max(12, avail - min(fits[-1], 20)))
    room = max(len(heads[-1]), avail - op_w)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i, (h, fit) in enumerate(zip(heads, fits)):
        justify: Literal["right", "left"] = "right" if h in NUMERIC else "left"
        if i == op:
            table.add_column(h, justify=justify, width=op_w, overflow="fold")
        else:
            table.add_column(h, justify=justify, no_wrap=True, min_width=min(fit, room))
    for row in cells:
        last = row[-1] if len(row[-1]) <= room else row[-1][: room - 1] + "\u2026"
        table.add_row(*(Text(c) for c in (*row[:-1], last)))  # Text: a worker's line is not rich markup
    Console(file=out, force_terminal=True, width=width, highlight=False).print(table)
