"""Benchmark: rendezvous of N simulated node agents, distlaunch vs torch elastic (c10d).

    python benchmarks/bench_scale.py [--nodes 100,250,500,1000] [--scenario static,dynamic]
        [--procs 8] [--limit 120] [--no-torch] [--late 4] [--last-call 0.5]
        [--hb-interval 1] [--hb-timeout 3] [--steady 3]

Every case starts a fresh store in its own process and N simulated node agents: threads
spread over ``--procs`` processes, each with its own store connection and the real
``distlaunch.rendezvous`` calls of a per-node ``--nnodes N --rdzv-endpoint`` launch (no
workers are started). Agents connect first (not timed: "connect s"), then all start at
one wall-clock instant. Scenarios (``--scenario``, comma-separated):

* ``static``: ``join``; node 0 ``publish_master``; everyone ``master``. "ready s" = start
  until the last node knows its rank, the members and the master. Then every node runs
  the exit barrier ``finish``: "exit s" = from the last node ready until the last node
  passed it. Store CPU covers both (one whole round).
* ``dynamic``: the same with ``join_dynamic`` and ``--nnodes N:N`` (ranks by arrival;
  the round closes when all N arrived, so ``last_call`` is never waited out).
* ``late``: ``--nnodes N:N+K`` (K = ``--late``): N nodes arrive, wait ``--last-call`` s for
  more, close the round; K late nodes arrive once it closed and must get LateJoin.
  "ready s" has ``last_call`` subtracted; "late s" = a late node's arrival until its
  LateJoin (the worst).
* ``restart``: the static round 0, its exit barrier, then round 1 the same way (what
  follows a restart). "round 1 s" counts from the last node leaving round 0.
* ``lost``: after a static round every node runs the agent's Heartbeat and StopWatcher
  (``--hb-interval`` / ``--hb-timeout``), each on its own connection, and stops the round
  with ``Lost`` when it finds a node lost, as the agent does. Store CPU % is measured
  over ``--steady`` s of N heartbeats; then node N-1 stops its heartbeat; "notice s" =
  from then until the last other node's StopWatcher woke (the target is heartbeat
  timeout + 2 s). A stop naming another node counts as a client error.

torch elastic side by side (static and dynamic: both are its c10d rendezvous with
min = max = N): a ``torch.distributed.TCPStore`` server in its own process and N agents
each calling ``DynamicRendezvousHandler.next_rendezvous()`` over their own TCPStore
client (backend ``C10dRendezvousBackend``), until rank, world size and master address
are known. After a size it does not finish within ``--limit``, larger sizes are skipped.

Reported per case: wall times, store CPU seconds (user + system of the store process,
from the start signal until every agent reported), store CPU ms per node, the store's
peak RSS (VmHWM, MiB), and client errors (agents whose calls raised). A case that does
not finish within ``--limit`` s prints "did not finish" and is killed. The figures are
noisy when other work shares the machine. The distlaunch measured is the one this
script imports (set PYTHONPATH to a checkout to measure it); the output's first line
names it and its commit.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(1, str(ROOT))  # run from a checkout without PYTHONPATH: measure it
from distlaunch.config import HEARTBEAT_INTERVAL  # noqa: E402  (the agents' default)

HOST = "127.0.0.1"
RUN_ID = "bench"
TOKEN_ENV = "DISTLAUNCH_STORE_TOKEN"  # the token travels in the environment, never in argv
LOSE_KEY, HB_KEY = "bench/lose", "bench/hb"
MASTER_PORT = 29500
START_DELAY = 0.3  # seconds between the start signal being sent and the common start
RESULT_GRACE = 15.0  # seconds the driver waits past the limit for the agents' reports


def code_root() -> str:
    """The directory that holds the distlaunch package this driver imports (set
    PYTHONPATH to measure another checkout); its store and agents run the same code."""
    import distlaunch

    return str(Path(distlaunch.__file__).resolve().parent.parent)


def raise_fd_limit() -> None:
    """Thousands of connections per process: soft RLIMIT_NOFILE up to the hard limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- the store's process ----------------------------------------------------------------------


def role_store(impl: str, limit: float) -> None:
    """Serve a store on a free loopback port, print the port, serve until stdin closes."""
    raise_fd_limit()
    if impl == "ours":
        from distlaunch.store import StoreServer

        srv = StoreServer(HOST, 0, token=os.environ[TOKEN_ENV]).start()
    else:
        from datetime import timedelta

        import torch.distributed as td

        srv = td.TCPStore(HOST, 0, None, True, timeout=timedelta(seconds=limit), wait_for_workers=False)
    print(srv.port, flush=True)
    sys.stdin.read()


# --- the agents' processes --------------------------------------------------------------------


class Node:
    """One simulated node agent: its thread, its wall-clock marks (``t``) and its error."""

    def __init__(self, node_id: int) -> None:
        self.id = node_id
        self.t: dict[str, float] = {}
        self.err: str | None = None

    def mark(self, what: str) -> None:
        self.t[what] = time.time()

    def fail(self, e: BaseException) -> None:
        """Record ``e`` (and the error it followed: e.g. a timed-out call before the call
        that found its connection dropped) and when it happened."""
        self.mark("error")
        self.err = repr(e) + (f" after {e.__context__!r}" if e.__context__ is not None else "")


def ours_round(rdzv, rnd: int, spec: dict, node: Node, phase: str) -> None:
    """One round as a per-node agent runs it (join, master), then its exit barrier."""
    me = (1, f"node{node.id}", HOST)
    if spec["scenario"] in ("dynamic", "late"):
        n = spec["nodes"]
        top = n + spec["late"] if spec["scenario"] == "late" else n
        members = rdzv.join_dynamic(rnd, n, top, spec["last_call"], *me)
    else:
        members = rdzv.join(rnd, *me)
    if rdzv.node_rank == 0:
        rdzv.publish_master(rnd, HOST, MASTER_PORT, rnd)
    rdzv.master(rnd)
    node.mark("ready" + phase)
    # join returns the members (a list) or, since issue 23, this node's seat (one slot
    # per node here: its world size is the node count)
    size = len(members) if isinstance(members, list) else members.world_size
    if size != spec["nodes"]:
        raise RuntimeError(f"round {rnd} has {size} members, not {spec['nodes']}")
    if spec["scenario"] != "lost":
        rdzv.finish(rnd, spec["limit"])
        rdzv.leave(rnd)
        node.mark("exit" + phase)


def ours_lost(c, rdzv, spec: dict, node: Node) -> None:
    """The part of an agent's round that watches for lost nodes (agent/node.py)."""
    from distlaunch.rendezvous import Heartbeat, StopWatcher
    from distlaunch.rounds import Lost

    victim, limit = spec["nodes"] - 1, spec["limit"]
    woke, closing = threading.Event(), threading.Event()

    def wake(reason: str) -> None:
        if closing.is_set():  # closing its connection below woke it
            return
        node.mark("notice")
        if reason != "stop":
            node.err = f"stop watcher woke for {reason!r}"
        woke.set()

    def store_lost() -> None:
        node.err = "heartbeat lost the store"

    watcher = StopWatcher(c.clone(connect_timeout=limit), rdzv, 0, wake)
    hb = Heartbeat(
        c.clone(connect_timeout=limit),
        rdzv,
        0,
        spec["hb_interval"],
        spec["hb_timeout"],
        lambda k, secs: rdzv.request_stop(0, Lost(k, f"no heartbeat for {secs:.0f} s")),
        store_lost,
    )
    try:
        c.add(HB_KEY, 1)
        if node.id == victim:
            c.wait([LOSE_KEY], timeout=limit)
            hb.stop()
            node.mark("loss")
            return
        if not woke.wait(limit):
            raise RuntimeError("never noticed the lost node")
        cause = rdzv.stop_cause(0)
        if not (isinstance(cause, Lost) and cause.node == victim):
            raise RuntimeError(f"round stopped for {cause!r}, not node {victim} lost")
    finally:
        hb.stop()
        closing.set()
        watcher.client.close()


def connect_then_wait(node: Node, connected, go: threading.Event, make):
    """``make()``'s result once every agent connected and the start was given (None when
    it failed: the error is the node's)."""
    try:
        made = make()
    except Exception as e:
        node.err = f"connect: {e!r}"
        connected(False)
        return None
    connected(True)
    go.wait()
    return made


def ours_node(spec: dict, node: Node, connected, go: threading.Event) -> None:
    from distlaunch.rendezvous import LateJoin, Rendezvous
    from distlaunch.rounds import RoundKeys
    from distlaunch.store import StoreClient

    limit = spec["limit"]

    def make():
        c = StoreClient(HOST, spec["port"], token=os.environ[TOKEN_ENV], timeout=limit, connect_timeout=limit)
        return c, Rendezvous(c, RUN_ID, node.id if node.id < spec["nodes"] else 0, spec["nodes"], limit)

    made = connect_then_wait(node, connected, go, make)
    if made is None:
        return
    c, rdzv = made
    try:
        if node.id >= spec["nodes"]:  # a late joiner: arrives once the round closed
            c.wait([RoundKeys(RUN_ID, 0).closed], timeout=limit)
            node.mark("arrive")
            try:
                rdzv.join_dynamic(
                    0, spec["nodes"], spec["nodes"] + spec["late"], spec["last_call"], 1, "late", HOST
                )
                raise RuntimeError("a late node was admitted")
            except LateJoin:
                node.mark("late")
            return
        ours_round(rdzv, 0, spec, node, "")
        if spec["scenario"] == "restart":
            ours_round(rdzv, 1, spec, node, "1")
        elif spec["scenario"] == "lost":
            ours_lost(c, rdzv, spec, node)
    except Exception as e:
        node.fail(e)
    finally:
        c.close()


def torch_node(spec: dict, node: Node, connected, go: threading.Event) -> None:
    from datetime import timedelta

    import torch.distributed as td
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    n, limit = spec["nodes"], timedelta(seconds=spec["limit"])

    def make():
        store = td.TCPStore(HOST, spec["port"], None, False, timeout=limit, wait_for_workers=False)
        backend = C10dRendezvousBackend(store, RUN_ID)
        return DynamicRendezvousHandler.from_backend(
            RUN_ID,
            store,
            backend,
            n,
            n,
            local_addr=HOST,
            timeout=RendezvousTimeout(join=limit, last_call=timedelta(seconds=spec["last_call"])),
        )

    handler = connect_then_wait(node, connected, go, make)
    if handler is None:
        return
    try:
        info = handler.next_rendezvous()
        info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port  # noqa: B018
        node.mark("ready")
        if not 0 <= info.rank < info.world_size == n:
            raise RuntimeError(f"rank {info.rank} of {info.world_size}, not of {n}")
    except Exception as e:
        node.fail(e)


def role_agents(spec: dict) -> None:
    """Run this process's share of the nodes: print "connected OK FAILED" once every
    thread connected, start at the time read from stdin ("go T"), print "result JSON"."""
    raise_fd_limit()
    threading.stack_size(512 * 1024)  # hundreds of threads per process
    nodes = [Node(i) for i in spec["ids"]]
    go = threading.Event()
    lock = threading.Lock()
    counts = [0, 0]
    all_in = threading.Event()

    def connected(ok: bool) -> None:
        with lock:
            counts[0 if ok else 1] += 1
            if sum(counts) == len(nodes):
                all_in.set()

    target = ours_node if spec["impl"] == "ours" else torch_node
    threads = [threading.Thread(target=target, args=(spec, nd, connected, go), daemon=True) for nd in nodes]
    for t in threads:
        t.start()
    all_in.wait()
    print(f"connected {counts[0]} {counts[1]}", flush=True)
    start = float(sys.stdin.readline().split()[1])
    time.sleep(max(0.0, start - time.time()))
    go.set()
    end = start + spec["limit"]
    for t in threads:
        t.join(max(0.0, end - time.time()))
    # Nodes still in a call at the limit are reported as such, not as errors.
    out = [{"id": nd.id, "t": nd.t, "err": nd.err, "running": t.is_alive()} for nd, t in zip(nodes, threads)]
    print("result " + json.dumps(out), flush=True)
    os._exit(0)  # torch's keep-alive timers and heartbeat threads need not be joined


# --- the driver -------------------------------------------------------------------------------


class Proc:
    """A child process of this script in its own session, its stdout lines on a queue."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, __file__, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, deadline: float) -> str | None:
        """The next line, or None at end of output or at ``deadline`` (time.time())."""
        try:
            return self.lines.get(timeout=max(0.0, deadline - time.time()))
        except queue.Empty:
            return None

    def send(self, text: str) -> None:
        try:
            self.p.stdin.write(text + "\n")
            self.p.stdin.flush()
        except OSError:
            pass  # it died: its missing result says so

    def kill(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.p.wait()


def store_usage(pid: int) -> tuple[float, float]:
    """The store process's CPU seconds (user + system) and its peak RSS in MiB (VmHWM)."""
    import psutil

    cpu = psutil.Process(pid).cpu_times()
    hwm = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return cpu.user + cpu.system, hwm


def run_case(impl: str, scenario: str, n: int, a: argparse.Namespace) -> dict:
    """One case; returns its figures, with "dnf" set (a reason) when it did not finish."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [code_root(), os.environ.get("PYTHONPATH")]))
    )
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # its server warns once per connection otherwise
    env[TOKEN_ENV] = os.urandom(16).hex()
    store = Proc(["--role", "store", "--impl", impl, "--limit", str(a.limit)], env)
    procs: list[Proc] = [store]
    res: dict = {"impl": impl, "scenario": scenario, "n": n}
    try:
        port_line = store.line(time.time() + 30)
        if port_line is None:
            return {**res, "dnf": "store did not start"}
        port = int(port_line)
        late = a.late if scenario == "late" else 0
        total = n + late
        spec = {
            "impl": impl,
            "scenario": scenario,
            "port": port,
            "nodes": n,
            "late": late,
            "last_call": a.last_call,
            "limit": a.limit,
            "hb_interval": a.hb_interval,
            "hb_timeout": a.hb_timeout,
        }
        nprocs = min(a.procs, total)
        t_spawn = time.time()
        workers = [
            Proc(
                ["--role", "agents", "--spec", json.dumps({**spec, "ids": list(range(w, total, nprocs))})],
                env,
            )
            for w in range(nprocs)
        ]
        procs += workers
        deadline = t_spawn + a.limit
        failed = 0
        for w in workers:
            line = w.line(deadline)
            if line is None or not line.startswith("connected"):
                return {**res, "dnf": f"agents did not connect within {a.limit:g} s"}
            failed += int(line.split()[2])
        res["connect"] = time.time() - t_spawn
        cpu0, _ = store_usage(store.p.pid)
        t0 = time.time() + START_DELAY
        for w in workers:
            w.send(f"go {t0}")
        deadline = t0 + a.limit + RESULT_GRACE
        if scenario == "lost":
            steady = lost_steady(port, n, env[TOKEN_ENV], store.p.pid, deadline, a.steady)
            if isinstance(steady, str):
                return {**res, "dnf": steady}
            res["steady_pct"] = steady
        nodes = []
        for w in workers:
            line = w.line(deadline)
            if line is None or not line.startswith("result "):
                return {**res, "dnf": f"agents gave no result within {a.limit + RESULT_GRACE:g} s"}
            nodes += json.loads(line[len("result ") :])
        cpu1, hwm = store_usage(store.p.pid)
        res.update(cpu=cpu1 - cpu0, rss=hwm, errors=sum(1 for nd in nodes if nd["err"]) + failed)
        failed_at = sorted((nd["t"]["error"], nd["err"]) for nd in nodes if "error" in nd["t"])
        if failed_at:  # the earliest error, and when (seconds after the start)
            res["first_error"] = f"at {failed_at[0][0] - t0:.1f} s: {failed_at[0][1]}"
        else:  # only connection failures, if any
            res["first_error"] = next((nd["err"] for nd in nodes if nd["err"]), None)
        if running := sum(1 for nd in nodes if nd["running"]):
            return {**res, "dnf": f"did not finish in {a.limit:g} s ({running} nodes still waiting)"}
        res.update(figures(scenario, nodes, n, t0, a))
        return res
    finally:
        for p in reversed(procs):
            p.kill()


def lost_steady(port: int, n: int, token: str, pid: int, deadline: float, seconds: float) -> float | str:
    """Once every node's heartbeat runs: the store's CPU % over ``seconds``; then tell the
    victim to stop its heartbeat. Why not, if the heartbeats do not all start by
    ``deadline`` or the store does not answer this driver."""
    from distlaunch.errors import StoreError
    from distlaunch.store import StoreClient

    try:
        with StoreClient(HOST, port, token=token, timeout=max(1.0, deadline - time.time())) as c:
            while (started := c.add(HB_KEY, 0)) < n:
                if time.time() > deadline:
                    return f"only {started} of {n} heartbeats started by the limit"
                time.sleep(0.05)
            cpu0, _ = store_usage(pid)
            time.sleep(seconds)
            cpu1, _ = store_usage(pid)
            c.set(LOSE_KEY, b"1")
    except StoreError as e:
        return f"the store did not answer the driver ({type(e).__name__})"
    return 100.0 * (cpu1 - cpu0) / seconds


def figures(scenario: str, nodes: list[dict], n: int, t0: float, a: argparse.Namespace) -> dict:
    """The scenario's times from every node's marks (None where a mark is missing)."""

    def last(mark: str, members=None) -> float | None:
        ts = [nd["t"].get(mark) for nd in nodes if nd["id"] < n and (members is None or members(nd))]
        return None if not ts or None in ts else max(ts)

    out: dict = {}
    ready = last("ready")
    if ready is None:
        return {"dnf": "not every node got ready (see errors)"}
    out["ready"] = ready - t0
    if scenario == "late":
        out["ready"] -= a.last_call
        lates = [nd["t"]["late"] - nd["t"]["arrive"] for nd in nodes if "late" in nd["t"]]
        out["late_s"] = max(lates) if len(lates) == a.late else None
    if scenario != "lost" and (exit_ := last("exit")) is not None:
        out["exit"] = exit_ - ready
    if scenario == "restart":
        r1 = last("ready1")
        out["round1"] = None if r1 is None or exit_ is None else r1 - exit_
        if (exit1 := last("exit1")) is not None and r1 is not None:
            out["exit1"] = exit1 - r1
    if scenario == "lost":
        victim = n - 1
        loss = next((nd["t"].get("loss") for nd in nodes if nd["id"] == victim), None)
        notice = last("notice", lambda nd: nd["id"] != victim)
        wrong = any(nd["err"] for nd in nodes if nd["id"] != victim)  # e.g. another node found lost
        out["notice"] = None if loss is None or notice is None or wrong else notice - loss
        out["hb_timeout"] = a.hb_timeout
    return out


# --- output -----------------------------------------------------------------------------------


def f2(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def f3(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def f1(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def per_node_ms(r: dict, rounds: int = 1) -> float | None:
    return None if "cpu" not in r else 1000 * r["cpu"] / r["n"] / rounds


COMMON = [
    ("store CPU s", lambda r: f2(r.get("cpu"))),
    ("CPU ms/node", lambda r: f2(per_node_ms(r, 2 if r["scenario"] == "restart" else 1))),
    ("peak RSS MiB", lambda r: f1(r.get("rss"))),
    ("errors", lambda r: str(r.get("errors", "-"))),
]


def torch_cols() -> list:
    def ratio(r: dict) -> str:
        t = r.get("torch") or {}
        if r.get("ready") is None or t.get("ready") is None:
            return "-"
        return f"{r['ready'] / t['ready']:.3f}x"

    def ready(t: dict | None) -> str:
        if not t:
            return "not run"
        return t["dnf"] if "dnf" in t else f3(t.get("ready"))

    return [
        ("torch ready s", lambda r: ready(r.get("torch"))),
        ("torch store CPU s", lambda r: f2((r.get("torch") or {}).get("cpu"))),
        ("torch RSS MiB", lambda r: f1((r.get("torch") or {}).get("rss"))),
        ("torch errors", lambda r: str((r.get("torch") or {}).get("errors", "-"))),
        ("ours/torch", ratio),
    ]


def columns(scenario: str) -> list:
    first = [("N", lambda r: str(r["n"])), ("connect s", lambda r: f2(r.get("connect")))]
    if scenario in ("static", "dynamic"):
        return (
            first
            + [("ready s", lambda r: f3(r.get("ready"))), ("exit s", lambda r: f3(r.get("exit")))]
            + COMMON
            + torch_cols()
        )
    if scenario == "late":
        return (
            first
            + [
                ("ready s - last_call", lambda r: f3(r.get("ready"))),
                ("LateJoin s", lambda r: f3(r.get("late_s"))),
                ("exit s", lambda r: f3(r.get("exit"))),
            ]
            + COMMON
        )
    if scenario == "restart":
        return (
            first
            + [
                ("round 0 s", lambda r: f3(r.get("ready"))),
                ("exit 0 s", lambda r: f3(r.get("exit"))),
                ("round 1 s", lambda r: f3(r.get("round1"))),
                ("exit 1 s", lambda r: f3(r.get("exit1"))),
            ]
            + COMMON
        )
    return first + [
        ("ready s", lambda r: f3(r.get("ready"))),
        ("steady store CPU %", lambda r: f1(r.get("steady_pct"))),
        ("notice s", lambda r: f2(r.get("notice"))),
        ("hb timeout s", lambda r: f1(r.get("hb_timeout"))),
        ("peak RSS MiB", lambda r: f1(r.get("rss"))),
        ("errors", lambda r: str(r.get("errors", "-"))),
    ]


def cells(scenario: str, r: dict) -> list[str]:
    row = [fn(r) for _, fn in columns(scenario)]
    if "dnf" in r:  # why, in its first time column; what was measured stays
        row[2] = r["dnf"]
    return row


def plain_table(scenario: str, rows: list[dict]) -> str:
    head = [h for h, _ in columns(scenario)]
    body = [cells(scenario, r) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [head, *body]]
    return "\n".join(lines)


def markdown_table(scenario: str, rows: list[dict]) -> str:
    head = [h for h, _ in columns(scenario)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells(scenario, r)) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["driver", "store", "agents"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", default="100,250,500,1000", help="comma-separated node counts")
    ap.add_argument("--scenario", default="static,dynamic", help="static,dynamic,late,restart,lost")
    ap.add_argument("--procs", type=int, default=8, help="agent processes (threads spread over them)")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds a case may take")
    ap.add_argument("--no-torch", action="store_true", help="skip torch elastic")
    ap.add_argument("--late", type=int, default=4, help="late joiners in the late scenario")
    ap.add_argument("--last-call", type=float, default=0.5, help="dynamic last_call seconds")
    ap.add_argument(
        "--hb-interval", type=float, default=HEARTBEAT_INTERVAL, help="heartbeat interval s (lost)"
    )
    ap.add_argument("--hb-timeout", type=float, default=3.0, help="heartbeat timeout s (lost)")
    ap.add_argument("--steady", type=float, default=3.0, help="seconds of steady heartbeats measured")
    a = ap.parse_args()
    if a.role == "store":
        role_store(a.impl, a.limit)
        return 0
    if a.role == "agents":
        role_agents(json.loads(a.spec))
        return 0
    try:
        sizes = [int(x) for x in a.nodes.split(",")]
    except ValueError:
        ap.error(f"--nodes {a.nodes!r}: give comma-separated integers, e.g. 100,1000")
    scenarios = a.scenario.split(",")
    if bad := [s for s in scenarios if s not in ("static", "dynamic", "late", "restart", "lost")]:
        ap.error(f"--scenario {bad[0]!r}: choose among static, dynamic, late, restart, lost")
    if any(n < 2 for n in sizes):
        ap.error(f"--nodes {a.nodes!r}: every size must be >= 2")
    for name, v in (("--procs", a.procs), ("--limit", a.limit), ("--hb-interval", a.hb_interval)):
        if v <= 0:
            ap.error(f"{name} {v:g}: must be > 0")
    if "late" in scenarios and a.late < 1:
        ap.error(f"--late {a.late}: the late scenario needs at least 1 late node")
    raise_fd_limit()
    root = code_root()
    head = subprocess.run(
        ["git", "-C", root, "log", "-1", "--format=%h %cs %s"], capture_output=True, text=True
    )
    print(f"distlaunch from {root}: {head.stdout.strip()[:100] or 'not a git checkout'}", flush=True)
    torch_ok = not a.no_torch and any(s in ("static", "dynamic") for s in scenarios)
    torch_res: dict[int, dict] = {}
    torch_dnf_at: int | None = None
    results: dict[str, list[dict]] = {s: [] for s in scenarios}
    for n in sizes:
        if torch_ok:
            if torch_dnf_at is not None:
                torch_res[n] = {"dnf": f"skipped (dnf at {torch_dnf_at})"}
            else:
                torch_res[n] = run_case("torch", "static", n, a)
                if "dnf" in torch_res[n]:
                    torch_dnf_at = n
            print(f"torch elastic N={n}: {json.dumps(torch_res[n])}", flush=True)
        for s in scenarios:
            r = run_case("ours", s, n, a)
            if s in ("static", "dynamic"):
                r["torch"] = torch_res.get(n)
            results[s].append(r)
            print(
                f"distlaunch {s} N={n}: {json.dumps({k: v for k, v in r.items() if k != 'torch'})}",
                flush=True,
            )
    for s in scenarios:
        print(f"\n== {s} ==\n{plain_table(s, results[s])}")
        for r in results[s]:
            for who, x in (("distlaunch", r), ("torch", r.get("torch") or {})):
                if x.get("first_error"):
                    print(f"  N={r['n']} {who}: {x['errors']} client errors, first: {x['first_error']}")
    print("\nMarkdown:")
    for s in scenarios:
        print(f"\n{s}:\n\n{markdown_table(s, results[s])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
