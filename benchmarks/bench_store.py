"""Benchmark: distlaunch's store vs torch.distributed.TCPStore, side by side.

    python benchmarks/bench_store.py [--duration 3] [--clients 1,4,16] [--barrier 1000]

1. Throughput: N client processes each loop ``set(k_i, 64 bytes); get(k_i)`` for
   ``--duration`` seconds from a common start; aggregate operations/s (a set and a get
   are one operation each). Higher is better; ratio = ours / TCPStore, > 1 means ours is
   faster.
2. Store barrier: ``--barrier`` clients (threads, each with its own connection, spread
   over 4 processes) each ``add("arrived", 1)``; the one reaching the total sets "done";
   all ``wait(["done"])``. Time from the start signal until every client has returned.
   Lower is better.

Each store's server runs in its own process; clients coordinate through the store being
measured. The torch half is skipped when torch is not installed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from store_worker import arrive_all  # noqa: E402  (the barrier the store tests use too)

TOKEN = "bench-secret"
VALUE = b"v" * 64
BARRIER_PROCS = 4
BARRIER_CONNECT_TIMEOUT = 30.0


def connect(impl: str, host: str, port: int, timeout: float = 120.0):
    if impl == "ours":
        from distlaunch.store import StoreClient

        return StoreClient(host, port, token=TOKEN, timeout=timeout)
    import torch.distributed as td

    return td.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


# --- processes --------------------------------------------------------------------------------


def role_server(impl: str) -> None:
    """Run a server, print its port, serve until stdin closes."""
    if impl == "ours":
        from distlaunch.store import StoreServer

        srv = StoreServer("127.0.0.1", 0, token=TOKEN).start()
        port = srv.port
    else:
        import torch.distributed as td

        srv = td.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=300), wait_for_workers=False)
        port = srv.port
    print(port, flush=True)
    sys.stdin.read()


def role_client(impl: str, port: int, rank: int, duration: float, rounds: int) -> None:
    s = connect(impl, "127.0.0.1", port)
    key = f"k{rank}"
    s.set(key, VALUE)
    s.get(key)  # warm up
    s.add("ready", 1)
    set_, get_, now = s.set, s.get, time.time
    for r in range(rounds):
        s.wait([f"go/{r}"])
        start = float(s.get(f"go/{r}"))
        while now() < start:
            time.sleep(0.0005)
        end = start + duration
        ops = 0
        cpu0 = time.process_time()
        while now() < end:
            for _ in range(20):
                set_(key, VALUE)
                get_(key)
            ops += 40
        cpu = time.process_time() - cpu0
        s.set(f"res/{r}/{rank}", f"{ops} {now() - start} {cpu}")


def role_barrier(impl: str, port: int, threads: int, world: int) -> None:
    # Connect from parallel threads: TCPStore's client stalls ~5 s every ~30 sequential
    # connections on this machine; connection set-up is not what is measured.
    clients = [None] * threads

    def conn(i):
        clients[i] = connect(impl, "127.0.0.1", port, timeout=BARRIER_CONNECT_TIMEOUT)

    ts = [threading.Thread(target=conn, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if any(c is None for c in clients):
        sys.exit(f"{impl}: some clients failed to connect")
    clients[0].add("connected", threads)
    clients[0].wait(["go"])
    errors = arrive_all(clients, world)
    clients[0].add("finished", threads)
    if errors:
        print("errors:", errors[:3], file=sys.stderr)
        sys.exit(1)


# --- driver -----------------------------------------------------------------------------------


def spawn(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, __file__, *args], env=env, **kw)


def start_server(impl: str):
    p = spawn("--role", "server", "--impl", impl, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    return p, port


def stop_server(p: subprocess.Popen) -> None:
    p.stdin.close()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def wait_count(s, key: str, n: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while s.add(key, 0) < n:
        if time.time() > deadline:
            raise RuntimeError(f"only {s.add(key, 0)} of {n} clients arrived within {timeout:g} s")
        time.sleep(0.005)


def throughput(impls: list, nclients: int, duration: float, rounds: int) -> dict:
    """Best aggregate ops/s of each implementation over ``rounds`` rounds; the rounds of
    the implementations alternate (and alternate which goes first) so that load from
    elsewhere on the machine hits both alike."""
    servers, mains, procs = {}, {}, []
    try:
        for impl in impls:
            servers[impl], port = start_server(impl)
            mains[impl] = connect(impl, "127.0.0.1", port)
            procs += [
                spawn(
                    "--role",
                    "client",
                    "--impl",
                    impl,
                    "--port",
                    str(port),
                    "--rank",
                    str(r),
                    "--duration",
                    str(duration),
                    "--rounds",
                    str(rounds),
                )
                for r in range(nclients)
            ]
        for impl in impls:
            wait_count(mains[impl], "ready", nclients)
        best = {impl: 0.0 for impl in impls}
        for r in range(rounds):
            order = impls if r % 2 == 0 else impls[::-1]
            for impl in order:
                m = mains[impl]
                m.set(f"go/{r}", str(time.time() + 0.1))
                keys = [f"res/{r}/{i}" for i in range(nclients)]
                m.wait(keys)
                total = 0.0
                for k in keys:
                    ops, elapsed, _cpu = m.get(k).split()
                    total += int(ops) / float(elapsed)
                best[impl] = max(best[impl], total)
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"a client exited with {p.returncode}")
        return best
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for srv in servers.values():
            stop_server(srv)


def barrier(impl: str, world: int) -> float:
    server, port = start_server(impl)
    procs = []
    try:
        main = connect(impl, "127.0.0.1", port)
        per = [world // BARRIER_PROCS + (i < world % BARRIER_PROCS) for i in range(BARRIER_PROCS)]
        procs = [
            spawn(
                "--role",
                "barrier",
                "--impl",
                impl,
                "--port",
                str(port),
                "--threads",
                str(n),
                "--world",
                str(world),
            )
            for n in per
        ]
        try:
            wait_count(main, "connected", world, timeout=BARRIER_CONNECT_TIMEOUT + 10)
        except RuntimeError as e:
            raise RuntimeError(f"{e} (connection set-up, before the barrier)") from None
        t0 = time.perf_counter()
        main.set("go", b"1")
        wait_count(main, "finished", world, timeout=60)
        dt = time.perf_counter() - t0
        for p in procs:
            if p.wait(60) != 0:
                raise RuntimeError(f"{impl} barrier process exited with {p.returncode}")
        return dt
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop_server(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="driver")
    ap.add_argument("--impl", default="ours")
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--duration", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--barrier", type=int, default=1000)
    a = ap.parse_args()
    if a.role == "server":
        return role_server(a.impl)
    if a.role == "client":
        return role_client(a.impl, a.port, a.rank, a.duration, a.rounds)
    if a.role == "barrier":
        return role_barrier(a.impl, a.port, a.threads, a.world)

    try:
        import torch  # noqa: F401

        impls = ["ours", "torch"]
        torch_version = torch.__version__
    except ImportError:
        impls = ["ours"]
        torch_version = None
    print(
        f"store benchmark on {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
        f"torch {torch_version or 'not installed (TCPStore half skipped)'}"
    )
    print(
        f"set+get of 64-byte values; aggregate ops/s, best of {a.rounds} alternating "
        f"{a.duration:g}-s rounds; higher is better; ratio = ours/TCPStore (>1: ours faster)"
    )
    print(f"{'clients':>8} {'ours ops/s':>12} {'TCPStore ops/s':>15} {'ratio':>7}")
    t_start = time.time()
    for n in [int(x) for x in a.clients.split(",") if x]:
        r = throughput(impls, n, a.duration, a.rounds)
        theirs = r.get("torch")
        t_col = f"{theirs:,.0f}" if theirs else "skipped"
        ratio = f"{r['ours'] / theirs:.2f}x" if theirs else "-"
        print(f"{n:>8} {r['ours']:>12,.0f} {t_col:>15} {ratio:>7}", flush=True)
    if a.barrier:
        print(
            f"store barrier: {a.barrier} clients (threads over {BARRIER_PROCS} processes) "
            f"add() then wait(); seconds from start signal to all returned, lower is better"
        )
        b = {}
        for impl in impls:
            try:
                b[impl] = barrier(impl, a.barrier)
            except Exception as e:  # report, don't hide the other half
                print(f"  {'TCPStore' if impl == 'torch' else impl}: failed: {e}")
        if "ours" in b:
            line = f"  ours {b['ours']:.3f} s"
            if "torch" in b:
                line += (
                    f", TCPStore {b['torch']:.3f} s, ratio (TCPStore time / ours) "
                    f"{b['torch'] / b['ours']:.2f}x (>1: ours faster)"
                )
            print(line, flush=True)
    print(f"(benchmark took {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
