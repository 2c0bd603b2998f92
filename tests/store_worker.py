"""Helper process for tests/test_store*.py and benchmarks/bench_store.py (real processes).

    python tests/store_worker.py add HOST PORT N            # N x add("count", 1); prints each result
    python tests/store_worker.py barrier HOST PORT THREADS WORLD
        # THREADS threads, each with its own connection: add("arrived", 1); the one that
        # reaches WORLD sets "done"; all wait(["done"]). Prints "ok <seconds>".

The token comes from DISTLAUNCH_STORE_TOKEN (the client's default).
"""

import sys
import threading
import time

from distlaunch.store import StoreClient


def arrive_all(clients, world: int) -> list[str]:
    """The store barrier, one thread per client (any client with c10d add/set/wait, ours
    or torch's TCPStore): add("arrived", 1); whoever reaches ``world`` sets "done"; all
    wait(["done"]). Returns the errors, as repr strings."""
    errors = []

    def arrive(c):
        try:
            if c.add("arrived", 1) == world:
                c.set("done", b"1")
            c.wait(["done"])
        except BaseException as e:  # reported by the caller; the test fails on it
            errors.append(repr(e))

    ts = [threading.Thread(target=arrive, args=(c,)) for c in clients]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def main() -> int:
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "add":
        n = int(sys.argv[4])
        with StoreClient(host, port, timeout=60) as c:
            c.wait(["go"])
            out = [c.add("count", 1) for _ in range(n)]
        sys.stdout.write(" ".join(map(str, out)) + "\n")
        return 0
    if mode == "barrier":
        threads, world = int(sys.argv[4]), int(sys.argv[5])
        clients = [StoreClient(host, port, timeout=60) for _ in range(threads)]
        clients[0].add("connected", threads)
        clients[0].wait(["go"])
        t0 = time.perf_counter()
        errors = arrive_all(clients, world)
        dt = time.perf_counter() - t0
        for c in clients:
            c.close()
        if errors:
            print("errors", errors[:3])
            return 1
        print(f"ok {dt:.3f}")
        return 0
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
