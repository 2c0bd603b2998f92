"""A worker for tests/test_supervision_faults.py: each flag is one behaviour."""

import argparse
import os
import resource
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--lines", type=int, default=0, help="print this many numbered 100-byte lines")
p.add_argument("--nofile", action="store_true", help="print this worker's RLIMIT_NOFILE")
p.add_argument(
    "--escape",
    choices=("setsid", "daemon"),
    help="leave a process that calls setsid: a child (setsid) or, after a double "
    "fork, an orphan (daemon); its pid goes to DIR/escaped.<rank>",
)
p.add_argument("--mark-dir", help="where --escape writes, and DIR/pid.<rank> at start")
p.add_argument("--fail-rank", type=int, help="this rank exits 3 once every rank has started (and escaped)")
p.add_argument("--ranks", type=int, default=1, help="how many ranks --fail-rank waits for")
p.add_argument("--sleep", type=float, default=0.0)
args = p.parse_args()
rank = int(os.environ["RANK"])


def write(name: str, text: str) -> None:
    tmp = os.path.join(args.mark_dir, f".{name}")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(args.mark_dir, name))  # readers never see a partial pid


if args.mark_dir:
    write(f"pid.{rank}", str(os.getpid()))

if args.nofile:
    print(f"nofile {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}", flush=True)

for i in range(args.lines):
    print(f"line {i:06d} " + "x" * 88, flush=i % 100 == 99)
sys.stdout.flush()

if args.escape:
    if os.fork() == 0:
        if args.escape == "daemon" and os.fork() != 0:
            os._exit(0)  # the intermediate parent: its child becomes an orphan
        os.setsid()
        write(f"escaped.{rank}", str(os.getpid()))
        time.sleep(120)
        os._exit(0)

if args.fail_rank == rank:
    # wait for the others' marks, so that a test's count of pids cannot race the stop
    names = [f"pid.{r}" for r in range(args.ranks)] if args.mark_dir else []
    names += [f"escaped.{r}" for r in range(args.ranks)] if args.escape else []
    while not all(os.path.exists(os.path.join(args.mark_dir, n)) for n in names):
        time.sleep(0.01)
    print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)

time.sleep(args.sleep)
