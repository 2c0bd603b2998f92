"""Repeat "send, then end at once" jobs (tests/workers/send_then_exit.py) with CPU-bound
processes beside them, and count the runs in which every receiver got its message.

    python benchmarks/stress_delivery.py [--runs 200] [--worlds 3,4] [--busy 2]
                                         [--api collectives] [--style tutorial]

Issue 22's acceptance: the torch.distributed tutorial's ending with its import changed
(``--api collectives --style tutorial``) passes 200 of 200 runs at worlds 3 and 4 with
two busy processes on this 2-core machine. Prints one line per world size and the first
failure's output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

PROG = Path(__file__).resolve().parent.parent / "tests" / "workers" / "send_then_exit.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="runs per world size")
    ap.add_argument("--worlds", default="3,4", help="comma-separated world sizes")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the job")
    ap.add_argument("--api", default="collectives", choices=["collectives", "torch", "mpi"])
    ap.add_argument("--style", default="tutorial", choices=["tutorial", "late"])
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for world in map(int, args.worlds.split(",")):
            ok, first, start = 0, None, time.monotonic()
            for _ in range(args.runs):
                cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", str(world)]
                res = subprocess.run(
                    [*cmd, str(PROG), args.api, args.style], capture_output=True, text=True, timeout=300
                )
                got = sum(" got [7.0, 7.0, 7.0]" in ln for ln in res.stdout.splitlines())
                if res.returncode == 0 and got == world - 1:
                    ok += 1
                elif first is None:
                    first = res.stdout[-2000:] + res.stderr[-3000:]
            took = time.monotonic() - start
            print(f"world {world}: {ok}/{args.runs} runs delivered every message ({took:.0f} s)", flush=True)
            if first is not None:
                print(f"first failure:\n{first}", flush=True)
    finally:
        for h in hogs:
            h.kill()


if __name__ == "__main__":
    main()
