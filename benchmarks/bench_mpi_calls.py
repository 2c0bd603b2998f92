"""Instructions per planned mpi4py small collective, under callgrind, for this checkout
and (optionally) another one side by side: 2 ranks run benchmarks/mpi_coll_calls.py
(``chunks`` runs of ``calls`` repetitions of one op on the same buffers, after 50
warm-up calls); the measured rank runs under ``valgrind --tool=callgrind
--toggle-collect=_operator_countOf --dump-after=_operator_countOf`` (only the measured calls
count, one count per run), the other natively, busy-polling for up to a second
(DISTLAUNCH_SHM_P2P_BUSY_US) so it never sleeps on a futex the measured rank would have
to wake. The measured rank is the slow one: it finds the other's phase published and
does not wait, so the count is its own per-call work, except in a run where the other
was descheduled (the machine's load): the least of the runs is taken, and each call is
followed by an uncounted sleep (the other rank then gets ahead). Prints instructions per
call (the least run's, less the measuring loop's own, op ``none``) for each op, buffer
kind and rank, and ours/before. Usage: python benchmarks/bench_mpi_calls.py [ops,...] [mmap,numpy]
[bytes] [calls] [chunks] [before]"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OPS = ("gather", "scatter", "bcast", "allgather", "alltoall")
WORKER = Path(__file__).resolve().parent / "mpi_coll_calls.py"
PAUSE_US = 10000  # after each measured call (not counted): the other rank gets ahead
ROOT = Path(__file__).resolve().parent.parent
WRAP = """#!/bin/sh
if [ "$RANK" = "$MEASURED" ]; then
  PAUSE_US={pause} exec valgrind -q --tool=callgrind \
    --toggle-collect=_operator_countOf --toggle-collect=time_sleep \
    --dump-after=_operator_countOf \
    --dump-instr=no \
    --callgrind-out-file="$OUTFILE" {py} "$@"
fi
DISTLAUNCH_SHM_P2P_BUSY_US=1000000 exec {py} "$@"
"""


def count(tree: Path, d: Path, op: str, kind: str, size: int, calls: int, chunks: int, rank: int) -> float:
    """Instructions per call of ``rank`` running ``op`` with ``tree``'s distlaunch (the
    least of ``chunks`` runs)."""
    wrap, out = d / "wrap.sh", d / f"cg.{op}.{kind}.{rank}"
    wrap.write_text(WRAP.format(py=sys.executable, pause=PAUSE_US))
    wrap.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(tree), MEASURED=str(rank), OUTFILE=str(out))
    cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", "--no-python", str(wrap)]
    res = subprocess.run(
        [*cmd, str(WORKER), op, kind, str(size), str(calls), str(chunks)],
        env=env,
        capture_output=True,
        text=True,
        cwd=d,
    )
    if res.returncode:
        sys.exit(f"{op} {kind} rank {rank} ({tree}) failed:\n{res.stderr[-3000:]}")
    got = []
    for f in d.glob(out.name + "*"):
        m = re.search(r"^totals: (\d+)", f.read_text(), re.M)
        f.unlink()
        if m and int(m.group(1)):
            got.append(int(m.group(1)))
    assert len(got) == chunks, f"{len(got)} counts of {chunks} runs in the callgrind output"
    return min(got) / calls


def main() -> None:
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else OPS
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ("mmap", "numpy")
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    chunks = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    before = Path(sys.argv[6]) if len(sys.argv) > 6 else None
    print(f"instructions per call, {size} B, least of {chunks} runs of {calls} calls, 2 ranks")
    print(
        f"{'op':>10} {'buffers':>7} {'rank':>4} {'ours':>9}"
        + (f" {'before':>9} {'ours/before':>11}" if before else "")
    )
    with tempfile.TemporaryDirectory() as t:
        loop = {
            tree: count(tree, Path(t), "none", "mmap", size, calls, chunks, 0)
            for tree in (ROOT, before)
            if tree
        }
        print(f"(the measuring loop's own instructions per call, subtracted: {loop[ROOT]:.0f})")
        for op in ops:
            for kind in kinds:
                for rank in (0, 1):
                    ours = count(ROOT, Path(t), op, kind, size, calls, chunks, rank) - loop[ROOT]
                    line = f"{op:>10} {kind:>7} {rank:>4} {ours:>9.0f}"
                    if before:
                        b = count(before, Path(t), op, kind, size, calls, chunks, rank) - loop[before]
                        line += f" {b:>9.0f} {ours / b:>11.3f}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
