"""A configurable worker for the launcher tests: each flag is one behaviour."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--dump-env", help="write this worker's environment to DIR/RANK.json")
p.add_argument("--fail-rank", type=int, help="this rank fails")
p.add_argument(
    "--fail-code",
    type=int,
    default=1,
    help="exit code of the failing rank; negative: kill itself with that signal",
)
p.add_argument(
    "--fail-attempts", type=int, default=1 << 30, help="fail only while TORCHELASTIC_RESTART_COUNT < this"
)
p.add_argument("--fail-delay", type=float, default=0.0)
p.add_argument("--sleep", type=float, default=0.0, help="others sleep this long, then exit 0")
p.add_argument(
    "--mark-dir",
    help="write DIR/<signal>.<rank> when a signal arrives, and DIR/started.<rank>.<attempt> at start",
)
p.add_argument("--ignore", action="append", default=[], help="signal names to ignore")
p.add_argument("--spawn-child", help="start a grandchild (sleep) and write its pid to DIR/child.<rank>")
p.add_argument("--lines", type=int, default=0, help="print this many lines, written in pieces")
args = p.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

if args.dump_env:
    with open(os.path.join(args.dump_env, f"{rank}.json"), "w") as f:
        json.dump(
            {
                **dict(os.environ),
                "_argv": sys.argv[1:],
                "_sid": os.getsid(0),
                "_pid": os.getpid(),
                "_cpus": sorted(os.sched_getaffinity(0)),
            },
            f,
        )

for name in args.ignore:
    signal.signal(getattr(signal, name), signal.SIG_IGN)

if args.mark_dir:

    def mark(signum, _frame):
        open(os.path.join(args.mark_dir, f"{signal.Signals(signum).name}.{rank}"), "w").close()
        if signum not in (signal.SIGUSR1, signal.SIGUSR2):
            sys.exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        if s.name not in args.ignore:
            signal.signal(s, mark)
    open(os.path.join(args.mark_dir, f"started.{rank}.{attempt}"), "w").close()

if args.spawn_child:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    path = os.path.join(args.spawn_child, f"child.{rank}")
    with open(path + ".tmp", "w") as f:  # then renamed: a test that sees the file sees the pid
        f.write(str(child.pid))
    os.replace(path + ".tmp", path)

for i in range(args.lines):
    # A line in three writes with pauses: the launcher must never split or mix it.
    for part in (f"line {i} of rank {rank} ", "x" * (i % 50), f" end {i}\n"):
        sys.stdout.write(part)
        sys.stdout.flush()
    sys.stderr.write(f"err {i} of rank {rank}\n")

if args.fail_rank == rank and attempt < args.fail_attempts:
    time.sleep(args.fail_delay)
    print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
    if args.fail_code < 0:
        os.kill(os.getpid(), -args.fail_code)
    raise SystemExit(args.fail_code) if args.fail_code else RuntimeError("never")

deadline = time.monotonic() + args.sleep
while time.monotonic() < deadline:
    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
