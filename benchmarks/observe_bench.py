"""Figures for docs/observe.md: time to read every rank's stack with py-spy and with
pystack (N sleeping Python processes, all read at once), and the CPU cost of top's
sampling and publishing (one node's 4 workers; 32 simulated nodes on one store).

    python benchmarks/observe_bench.py [--procs 4,16] [--seconds 20]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from distlaunch.observe import records as R
from distlaunch.observe import stacks as S
from distlaunch.store.client import StoreClient
from distlaunch.store.server import StoreServer

SLEEPER = (
    "import threading, time\nthreading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
    + ("print(flush=True)\ntime.sleep(1000)")
)


def start(n: int) -> list[subprocess.Popen]:
    ps = [subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE) for _ in range(n)]
    for p in ps:
        p.stdout.readline()  # type: ignore[union-attr]
    return ps


def pystack_all(pids: list[int]) -> None:
    exe = shutil.which("pystack") or "pystack"
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: subprocess.run([exe, "remote", str(p)], capture_output=True), pids))
    assert all(o.returncode == 0 for o in outs), outs[0].stderr


def timed(fn, reps: int = 5) -> float:
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return sorted(best)[len(best) // 2]


def stacks(counts: list[int]) -> None:
    for n in counts:
        ps = start(n)
        try:
            pids = {i: p.pid for i, p in enumerate(ps)}
            row = [f"{n} processes:"]
            for native in (False, True):
                got = S.dump_stacks(pids, native=native)
                assert all(isinstance(v, S.RankStack) for v in got.values()), got
                took = timed(lambda: S.dump_stacks(pids, native=native))
                row.append(f"py-spy{' --native' if native else ''} {took:.3f} s")
            if shutil.which("pystack"):
                row.append(f"pystack {timed(lambda: pystack_all(list(pids.values()))):.3f} s")
            print("  ".join(row), flush=True)
        finally:
            for p in ps:
                p.kill()
                p.wait()


def sampling(seconds: float) -> None:
    ps = start(4)
    pids = {i: p.pid for i, p in enumerate(ps)}
    try:
        with StoreServer(token="bench") as server:
            host, port = server.address
            # one node: sample its 4 workers and publish once a second
            c = StoreClient(host, port, token="bench")
            pub, sampler = R.Publisher(c, "top", "node0"), R.Sampler()
            cpu0, t0 = time.process_time(), time.monotonic()
            n = 0
            while time.monotonic() - t0 < seconds:
                got = sampler.sample(pids)
                pub.publish(
                    [
                        R.RankRecord(r, "node0", pids[r], "running", s.cpu, s.rss, line="step 1")
                        for r, s in got.items()
                        if s
                    ]
                )
                n += 1
                time.sleep(max(0.0, t0 + n - time.monotonic()))
            cost = (time.process_time() - cpu0) / (time.monotonic() - t0)
            print(
                f"one node, 4 workers, 1 sample/s: sampler + publish {100 * cost:.3f} % of one CPU",
                flush=True,
            )
            # 32 nodes of 4 ranks publishing at 1/s (one client each, in this process) and a
            # viewer reading all of them each second: per-node publishing cost, viewer cost
            clients = [StoreClient(host, port, token="bench") for _ in range(32)]
            pubs = [R.Publisher(cl, "top32", f"node{i}") for i, cl in enumerate(clients)]
            recs = [
                [
                    R.RankRecord(4 * i + k, f"node{i}", 1000 + k, "running", 99.0, 1 << 30, 0.5, "x" * 80)
                    for k in range(4)
                ]
                for i in range(32)
            ]
            viewer = StoreClient(host, port, token="bench")
            pub_cpu = view_cpu = 0.0
            t0 = time.monotonic()
            n = 0
            while time.monotonic() - t0 < seconds:
                a = time.process_time()
                for p, r in zip(pubs, recs):
                    p.publish(r)
                b = time.process_time()
                got = R.all_records(R.read_records(viewer, "top32"))
                assert len(got) == 128
                pub_cpu += b - a
                view_cpu += time.process_time() - b
                n += 1
                time.sleep(max(0.0, t0 + n - time.monotonic()))
            wall = time.monotonic() - t0
            print(
                f"32 nodes x 4 ranks, 1/s: publishing {100 * pub_cpu / wall / 32:.4f} % of one CPU per node, "
                f"viewer reading all 128 records {100 * view_cpu / wall:.3f} %; record value "
                f"{len(R.encode_node(recs[0]))} bytes per node",
                flush=True,
            )
    finally:
        for p in ps:
            p.kill()
            p.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="4,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    stacks([int(x) for x in a.procs.split(",")])
    sampling(a.seconds)
