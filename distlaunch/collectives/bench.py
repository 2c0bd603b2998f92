"""nccl-tests-style benchmark of one collective; run on every worker by ``distlaunch bench``::

    python -m distlaunch.collectives.bench OP --sizes 8B..64MiB --dtype float32 [--iters N]
        [--json] [--plot FILE.png]

OP: all_reduce, broadcast, all_gather, reduce_scatter, all_to_all, send_recv. Sizes double
from MIN to MAX (suffixes B, KiB, MiB, GiB; also a comma-separated list). As in
nccl-tests, *size* is the bytes of the larger buffer of one rank: the buffer for
all_reduce, broadcast and send_recv, the output of all_gather (n blocks), the input of
reduce_scatter (n blocks), the send buffer of all_to_all. Rank 0 prints one row per size:

- time: median over 5 repetitions of the mean time per call of ``iters`` back-to-back
  calls, the slowest rank's (microseconds);
- algbw = size / time (GB/s, 1e9 bytes); busbw = algbw x the nccl-tests bus factor:
  all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast and
  send_recv 1 (docs of nccl-tests, PERFORMANCE.md);
- #wrong: elements that differ from the expected result after one more checked call,
  summed over ranks (inputs are small integers, exact in every dtype).

``--json``: one JSON object per size instead of the table. ``--plot FILE``: also draw
algbw and busbw against size with matplotlib (exit status 2 with a one-line error when
matplotlib is not installed, checked before measuring). Exit status 1 if any element was
wrong.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from typing import Any

import numpy as np

import distlaunch.collectives as dist
from distlaunch.collectives.optable import OPS as OP_TABLE
from distlaunch.collectives.optable import benchmarked
from distlaunch.collectives.wire import DTYPE_CODES

# the op table's benchmarked collectives, and point-to-point send/recv
OPS = (*benchmarked(), "send_recv")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """'8B', '64KiB', '1M', '1048576' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r} (e.g. 8B, 64KiB, 16MiB)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_sizes(text: str) -> list:
    """'MIN..MAX' (doubling) or 'A,B,C' -> sizes in bytes."""
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        if lo <= 0 or hi < lo:
            raise ValueError(f"bad size range {text!r}")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_options(sizes: str, dtype: str, iters: int | None) -> tuple[list[int], np.dtype]:
    """``--sizes``, ``--dtype`` and ``--iters`` as (sizes in bytes, dtype), checked by
    `distlaunch bench` before any worker starts and again by each worker. Raises
    ValueError: one line naming the option, its value and what is accepted."""
    try:
        out = parse_sizes(sizes)
    except ValueError:
        out = []
    if not out:
        raise ValueError(
            f"--sizes {sizes!r} is invalid: give MIN..MAX (doubling) or a list, in B, KiB, MiB "
            f"or GiB, e.g. 8B..64MiB or 8B,1KiB"
        )
    try:
        dt: np.dtype | None = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError):  # numpy parses structured specs ('i4,(')
        dt = None
    if dt not in DTYPE_CODES:
        names = ", ".join(map(str, DTYPE_CODES))
        raise ValueError(f"--dtype {dtype!r} is not an element type of the collectives; give one of {names}")
    if iters is not None and iters < 1:
        raise ValueError(f"--iters {iters} is invalid: give at least 1 (or leave it out: by size)")
    assert dt is not None  # in DTYPE_CODES
    return out, dt


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``n`` ranks (from the op table;
    send_recv: 1)."""
    factor = OP_TABLE[op].bench if op in OP_TABLE else None
    return 1.0 if factor is None else factor(n)


def default_iters(nbytes: int) -> int:
    return 200 if nbytes <= 64 << 10 else 40 if nbytes <= 1 << 20 else 8 if nbytes <= 16 << 20 else 3


def _pattern(count, dtype, rank, salt=0):
    """Rank-specific small integers (exact in every dtype, sums stay exact)."""
    v = (np.arange(count, dtype=np.int64) * 7 + rank * 3 + salt) % 5
    return (v % 2).astype(dtype) if dtype.kind == "b" else v.astype(dtype)


class Case:
    """Buffers and the call of one (op, size); ``expected()`` checks the last result."""

    def __init__(self, dist: Any, op: str, nbytes: int, dtype: np.dtype, rank: int, n: int) -> None:
        self.dist, self.op, self.dtype, self.rank, self.n = dist, op, dtype, rank, n
        isz = dtype.itemsize
        blocked = op in OP_TABLE and OP_TABLE[op].blocked
        per = max(1, nbytes // isz // n) if blocked else max(1, nbytes // isz)
        self.count = per * n if blocked else per  # elements of the size-defining buffer
        self.per = per
        self.nbytes = self.count * isz
        if op == "all_reduce":
            self.buf = np.empty(per, dtype)
        elif op == "broadcast":
            self.buf = np.empty(per, dtype)
        elif op == "all_gather":
            self.inp, self.out = np.empty(per, dtype), np.empty(per * n, dtype)
        elif op == "reduce_scatter":
            self.inp, self.out = np.empty(per * n, dtype), np.empty(per, dtype)
        elif op == "all_to_all":
            self.inp, self.out = np.empty(per * n, dtype), np.empty(per * n, dtype)
        else:
            self.inp, self.out = np.empty(per, dtype), np.empty(per, dtype)
        self.reset()

    def reset(self) -> None:
        d, r = self.dtype, self.rank
        if self.op in ("all_reduce", "broadcast"):
            self.buf[:] = _pattern(self.per, d, r)
        else:
            self.inp[:] = _pattern(self.inp.size, d, r)

    def call(self) -> None:
        dist, op, n, r = self.dist, self.op, self.n, self.rank
        if op == "all_reduce":
            dist.all_reduce(self.buf)
        elif op == "broadcast":
            dist.broadcast(self.buf, src=0)
        elif op == "all_gather":
            dist.all_gather_into_tensor(self.out, self.inp)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(self.out, self.inp)
        elif op == "all_to_all":
            dist.all_to_all_single(self.out, self.inp)
        elif n == 1:
            self.out[:] = self.inp
        else:
            works = [dist.isend(self.inp, (r + 1) % n), dist.irecv(self.out, (r - 1) % n)]
            for w in works:
                w.wait()

    def wrong(self) -> int:
        d, r, n, per = self.dtype, self.rank, self.n, self.per
        if self.op == "all_reduce":
            want = _pattern(per, d, 0)
            for k in range(1, n):
                want = np.add(want, _pattern(per, d, k), dtype=d)
            got = self.buf
        elif self.op == "broadcast":
            want, got = _pattern(per, d, 0), self.buf
        elif self.op == "all_gather":
            want, got = np.concatenate([_pattern(per, d, k) for k in range(n)]), self.out
        elif self.op == "reduce_scatter":
            want = _pattern(per * n, d, 0)[r * per : (r + 1) * per]
            for k in range(1, n):
                want = np.add(want, _pattern(per * n, d, k)[r * per : (r + 1) * per], dtype=d)
            got = self.out
        elif self.op == "all_to_all":
            want = np.concatenate([_pattern(per * n, d, k)[r * per : (r + 1) * per] for k in range(n)])
            got = self.out
        else:
            want, got = _pattern(per, d, (r - 1) % n), self.out
        return int(np.count_nonzero(got != want))


def measure(dist: Any, case: Case, iters: int, reps: int = 5) -> float:
    """Median over ``reps`` of the slowest rank's mean time per call (seconds). In-place
    reductions repeated on one buffer overflow to inf: harmless here (the checked call
    starts from fresh inputs), so numpy's warnings are silenced."""
    per_call = []
    with np.errstate(all="ignore"):
        for _ in range(2):
            case.call()
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(iters):
                case.call()
            per_call.append((time.perf_counter() - t) / iters)
    worst = np.array(per_call)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return statistics.median(worst.tolist())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m distlaunch.collectives.bench", description=__doc__.split("\n")[0]
    )
    p.add_argument("op", choices=OPS)
    p.add_argument("--sizes", default="8B..64MiB")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    try:
        sizes, dtype = parse_options(args.sizes, args.dtype, args.iters)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    dist.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        if rank == 0:
            print(
                "bench: --plot needs matplotlib, which is not installed (pip install matplotlib)",
                file=sys.stderr,
            )
        dist.destroy_process_group()
        return 2
    world = dist.GroupMember.WORLD
    assert world is not None  # set by init_process_group
    dist.barrier()
    transport = "shared memory" if world.backend == "shm" else "tcp"
    rows = []
    if rank == 0 and not args.json:
        print(
            f"# distlaunch.collectives {args.op}: {n} ranks, dtype {dtype}, transport {transport}, "
            f"time = median of 5 x mean of iters calls (slowest rank)"
        )
        print(
            f"# {'size':>12} {'count':>12} {'type':>8} {'iters':>6} {'time(us)':>11} "
            f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}",
            flush=True,
        )
    bad = 0
    for nbytes in sizes:
        case = Case(dist, args.op, nbytes, dtype, rank, n)
        iters = args.iters or default_iters(case.nbytes)
        t = measure(dist, case, iters)
        case.reset()
        case.call()
        wrong_counts = np.array([case.wrong()], np.int64)
        dist.all_reduce(wrong_counts)
        wrong = int(wrong_counts[0])
        bad += wrong
        algbw = case.nbytes / t / 1e9
        busbw = algbw * bus_factor(args.op, n)
        row = dict(
            op=args.op,
            size=case.nbytes,
            count=case.count,
            dtype=str(dtype),
            world_size=n,
            transport=transport,
            iters=iters,
            time_us=round(t * 1e6, 2),
            algbw_gbps=round(algbw, 4),
            busbw_gbps=round(busbw, 4),
            wrong=wrong,
        )
        rows.append(row)
        if rank == 0:
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"  {case.nbytes:>12} {case.count:>12} {str(dtype):>8} {iters:>6} {t * 1e6:>11.2f} "
                    f"{algbw:>12.3f} {busbw:>12.3f} {wrong:>7}",
                    flush=True,
                )
    if rank == 0 and args.plot:
        _plot(rows, args.plot, f"{args.op}, {n} ranks, {dtype} ({transport})")
    dist.destroy_process_group()
    return 1 if bad else 0


def _plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["size"] for r in rows]
    ax.plot(x, [r["algbw_gbps"] for r in rows], "o-", label="algbw")
    ax.plot(x, [r["busbw_gbps"] for r in rows], "s--", label="busbw")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"# plot written to {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
