"""`distlaunch stacks` latency and the agent's sampling cost on a running job.

For 4 and 16 workers sleeping in tests/hang_workers/plain.py: the wall time of
`distlaunch stacks` (a CLI start, one store round trip, py-spy on every rank; median of
5), of `distlaunch ps` (the CLI's start-up alone), and the launcher's CPU time over 30 s
while the job idles (its observer thread samples and publishes once a second; an upper
bound of the sampling cost). Run: PYTHONPATH=. python benchmarks/bench_observe_live.py
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = os.path.join(ROOT, "tests", "hang_workers", "plain.py")


def dl(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "distlaunch", *args], env=env, capture_output=True, text=True
    )


def timed(*args, env):
    t = time.monotonic()
    r = dl(*args, env=env)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - t, r


def main():
    env = dict(os.environ, XDG_RUNTIME_DIR=tempfile.mkdtemp())
    for n in (4, 16):
        argv = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", str(n), PROG, "quiet"]
        p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:  # until every rank is published
                r = dl("top", "--json", env=env)
                if r.returncode == 0 and len(json.loads(r.stdout)) == n:
                    break
                time.sleep(0.5)
            times = []
            for _ in range(5):
                t, r = timed("stacks", env=env)
                assert "rank 2" in r.stdout, r.stdout
                times.append(t)
            cli, _ = timed("ps", env=env)
            lp = psutil.Process(p.pid)
            c0, t0 = sum(lp.cpu_times()[:2]), time.monotonic()
            time.sleep(30)
            c1, t1 = sum(lp.cpu_times()[:2]), time.monotonic()
            print(
                f"{n} ranks: stacks median {statistics.median(times):.2f} s (min {min(times):.2f}, "
                f"max {max(times):.2f}); ps {cli:.2f} s; launcher CPU while idle "
                f"{100 * (c1 - c0) / (t1 - t0):.2f} % of one CPU"
            )
        finally:
            p.terminate()
            p.wait()


if __name__ == "__main__":
    main()
