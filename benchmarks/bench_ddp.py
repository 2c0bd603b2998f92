"""The distlaunch torch backend next to gloo, in the same processes, one node.

    python benchmarks/bench_ddp.py [--worlds 2,4] [--steps 20] [--buckets]
        [--sizes 8,1KiB,64KiB,1MiB,16MiB,64MiB] [--skip-ddp] [--skip-allreduce]
        [--variant NAME=VALUE,...]

1. DDP training step (forward, backward with DDP's bucketed all_reduce, SGD step) of a
   ~25M-parameter MLP (1024 -> 4096 -> 4096 -> 1024, batch 16 per rank, one thread per
   rank), DDP over gloo, over distlaunch and over the no-op backend (3.) in the same job,
   one model each, step by step with the order rotating so background load hits every
   backend alike; a step time is the slowest rank's, the median over ``--steps`` steps
   (after 2 warm-up steps); also each backend's process CPU per step and rank. World 1
   (no DDP) gives the pure compute time. ``--buckets``: per rank, when DDP called each
   bucket's all_reduce on distlaunch, when it started and ended (the backend's helper
   thread) and that thread's CPU time meanwhile, split into the copies into shared memory,
   the waits for peers (wall and CPU: spinning) and the rest (reducing, copying out),
   medians over the steps. ``--variant NAME=VALUE,...``: a fourth model, over a second
   distlaunch group made under these environment settings (e.g. DISTLAUNCH_SHM_SLOT,
   DISTLAUNCH_SHM_SPIN), in the same rotation: a paired comparison of a setting.
2. ``dist.all_reduce`` through the backend next to ``distlaunch.collectives.all_reduce``
   on the same float32 buffer (the runtime's own API, initialised in the same
   processes): per-call time, slowest rank, median of 5 repetitions.
3. The floor of both: a no-op backend ("noop", registered here) whose operations return
   an already-completed Work without communicating (allgather copies the input into
   every output, so DDP's start-up checks pass). DDP over it is the compute-only step
   of ``world`` ranks sharing the cores (with DDP's bucket copies); ``dist.all_reduce``
   over it is torch's own cost between the call and a backend (same entry path). The
   floor ratio is (runtime + k * noop) / runtime with k = ranks per core (at least 1):
   with more ranks than cores, each core runs k ranks' torch layers one after another
   in every collective.

Targets: DDP step <= 1.1x the no-op backend's at world 2 and 4 (issue 27; issue 14: <= 0.7x
gloo's at world 2, <= 0.5x at world 4); the backend's all_reduce within 1.3x of the
runtime's. Ratios < 1: distlaunch is faster.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from distlaunch.collectives.bench import parse_size  # noqa: E402

LAYERS = (1024, 4096, 4096, 1024)
BATCH = 16


def _iters(nbytes):
    return 200 if nbytes <= 64 << 10 else 20 if nbytes <= 1 << 20 else 5 if nbytes <= 16 << 20 else 2


# --------------------------------------------------------------------- worker


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods = []
    for a, b in zip(LAYERS[:-1], LAYERS[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


class _DoneWork:
    """Factory of torch Work objects that are complete from the start."""

    cls = None

    @classmethod
    def make(cls, outputs):
        import torch.distributed as dist
        from torch.futures import Future

        if cls.cls is None:

            class Done(dist._Work):
                def __init__(self, outputs):
                    super().__init__()
                    self._outputs = outputs

                def wait(self, timeout=None):
                    return True

                def is_completed(self):
                    return True

                def get_future(self):
                    fut = Future()
                    fut.set_result(self._outputs)
                    return fut

            cls.cls = Done
        return cls.cls(outputs)


def _register_noop():
    """Register the "noop" backend: a ProcessGroup that communicates nothing."""
    import torch.distributed as dist

    if "NOOP" in dist.Backend._plugins:
        return

    class NoopGroup(dist.ProcessGroup):
        def getBackendName(self):
            return "noop"

        def allreduce(self, tensors, opts=None):
            return _DoneWork.make(tensors)

        def broadcast(self, tensors, opts=None):
            return _DoneWork.make(tensors)

        def barrier(self, opts=None):
            return _DoneWork.make([])

        def allgather(self, output_tensors, input_tensors, opts=None):
            for outs, inp in zip(output_tensors, input_tensors):
                for o in outs:
                    o.copy_(inp)
            return _DoneWork.make(output_tensors)

    dist.Backend.register_backend(
        "noop", lambda store, rank, size, timeout: NoopGroup(rank, size), devices=["cpu"]
    )


def _stepper(group):
    """A DDP training step over ``group`` (None: no DDP, world 1) after 2 warm-up steps:
    a function returning (forward end, backward end, step end) in seconds from its start
    and the process CPU seconds it used."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    net = DDP(model, process_group=group) if dist.is_initialized() else model
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, LAYERS[0]), torch.randn(BATCH, LAYERS[-1])

    def step():
        opt.zero_grad()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = torch.nn.functional.mse_loss(net(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t0, t3 - t0, time.process_time() - c0

    for _ in range(2):
        step()
    return step


class _BucketTrace:
    """Times every all_reduce the distlaunch backend runs while ``records`` is a list:
    when DDP called it, when the operation started and ended (on the backend's helper
    thread or inline), the CPU seconds of that thread meanwhile, its bytes, and of that
    time (wall ``_w`` and thread CPU ``_c``) the copies into shared memory (``copyin``)
    and the waits for peers (``wait``; the rest is reducing and copying out)."""

    def __init__(self):
        from distlaunch.collectives.transport.shm import ShmChannel
        from distlaunch.torch.group import DistlaunchProcessGroup

        self.records = None  # the current step's records while tracing
        self.current = None  # the record of the all_reduce running now
        run, need, step = DistlaunchProcessGroup._run, ShmChannel.need, ShmChannel.step
        trace = self

        def add(key, t0, c0):
            rec = trace.current
            if rec is not None:
                rec[key + "_w"] = rec.get(key + "_w", 0.0) + time.perf_counter() - t0
                rec[key + "_c"] = rec.get(key + "_c", 0.0) + time.thread_time() - c0

        def traced_need(ch, *a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return need(ch, *a, **kw)
            finally:
                add("wait", t0, c0)

        def traced_step(ch, ctx, fill, first):
            def timed_fill(buf):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    fill(buf)
                finally:
                    add("copyin", t0, c0)

            return step(ch, ctx, timed_fill, first)

        def traced(pg, fn, name, outputs, inline):
            if trace.records is None or name != "all_reduce":
                return run(pg, fn, name, outputs, inline)
            rec = {"call": time.perf_counter(), "bytes": outputs[0].numel() * outputs[0].element_size()}
            trace.records.append(rec)

            def timed():
                rec["start"], c0 = time.perf_counter(), time.thread_time()
                trace.current = rec
                try:
                    return fn()
                finally:
                    trace.current = None
                    rec["end"], rec["cpu"] = time.perf_counter(), time.thread_time() - c0

            return run(pg, timed, name, outputs, inline)

        DistlaunchProcessGroup._run = traced
        ShmChannel.need = traced_need
        ShmChannel.step = traced_step


def _variant_group(settings):
    """A second distlaunch group over every rank whose helper thread and shared-memory
    channel are made under the environment ``settings`` (DISTLAUNCH_SHM_* are read
    once per runtime: the group's channel, made by its first collective, gets them
    here), the process environment restored after."""
    import torch
    import torch.distributed as dist

    from distlaunch.collectives.transport.shm import ShmConfig
    from distlaunch.torch import _STATE

    saved = {k: os.environ.get(k) for k in settings}
    rt = _STATE["runtime"]
    config = rt.shm_config
    os.environ.update(settings)
    try:
        rt.shm_config = ShmConfig.from_env()
        group = dist.new_group(backend="distlaunch")
        dist.all_reduce(torch.zeros(1 << 20), group=group)  # its channel, with the settings
    finally:
        rt.shm_config = config
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return group


def worker_ddp(args):
    import torch
    import torch.distributed as dist

    import distlaunch.torch  # noqa: F401

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    res: dict = {"world": world}
    if world == 1:
        step = _stepper(None)
        res["compute"] = statistics.median(step()[2] for _ in range(args.steps))
        print("RESULT " + json.dumps(res), flush=True)
        return
    _register_noop()
    dist.init_process_group("distlaunch")
    gloo = dist.new_group(backend="gloo")
    groups = {"gloo": gloo, "distlaunch": None, "noop": dist.new_group(backend="noop")}
    if args.variant:
        groups["variant"] = _variant_group(dict(kv.split("=", 1) for kv in args.variant.split(",")))
    steps = {k: _stepper(g) for k, g in groups.items()}
    trace = _BucketTrace() if args.buckets else None
    names = list(groups)
    runs: dict = {k: [] for k in names}
    traced: list = []  # per distlaunch step: its all_reduce records
    starts: dict = {k: [] for k in names}
    for i in range(args.steps):
        # step by step, the order rotating: background load hits every backend alike
        for k in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier(group=gloo)
            if trace is not None and k == "distlaunch":
                traced.append([])
                trace.records = traced[-1]
            starts[k].append(time.perf_counter())
            runs[k].append(steps[k]())
            if trace is not None:
                trace.records = None
    # the slowest rank's time of every step, then the median over steps
    walls = torch.tensor([[r[2] for r in runs[k]] for k in names], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX, group=gloo)
    med = statistics.median
    for i, k in enumerate(names):
        res[k] = med(walls[i].tolist())
        res[k + "_cpu"] = med(r[3] for r in runs[k])  # this rank's process CPU per step
    cpus = [None] * world
    dist.all_gather_object(cpus, {k: res[k + "_cpu"] for k in names}, group=gloo)
    for k in names:
        res[k + "_cpu"] = statistics.mean(c[k] for c in cpus)
    if trace is not None:
        mine = {"buckets": [], "phases": {}}
        for k in ("distlaunch", "noop"):
            mine["phases"][k] = [med(r[j] for r in runs[k]) for j in range(3)]
        per_step = list(zip(traced, starts["distlaunch"]))
        for b in range(min(len(recs) for recs, _ in per_step)):
            rows = [(recs[b], t0) for recs, t0 in per_step]
            mine["buckets"].append(
                {
                    "bytes": rows[0][0]["bytes"],
                    **{f: med(r[f] - t0 for r, t0 in rows) for f in ("call", "start", "end")},
                    "cpu": med(r["cpu"] for r, _ in rows),
                    **{
                        f: med(r.get(f, 0.0) for r, _ in rows)
                        for f in ("copyin_w", "copyin_c", "wait_w", "wait_c")
                    },
                }
            )
        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=gloo)
        res["trace"] = everyone
    time.sleep(0.2)  # let gloo's thread release its last op before exit (torch 2.13)
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res), flush=True)


def worker_allreduce(args):
    import torch
    import torch.distributed as dist

    import distlaunch.collectives as dlc
    import distlaunch.torch  # noqa: F401

    torch.set_num_threads(1)
    _register_noop()
    dist.init_process_group("distlaunch")
    world, noop = dist.group.WORLD, dist.new_group(backend="noop")
    dlc.init_process_group()
    res = {"world": dist.get_world_size(), "sizes": {}}
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        buf = torch.ones(max(1, nbytes // 4))
        iters = _iters(nbytes)
        fns = {
            "backend": lambda: dist.all_reduce(buf, group=world),
            "runtime": lambda: dlc.all_reduce(buf),
            "noop": lambda: dist.all_reduce(buf, group=noop),
        }
        reps: dict = {k: [] for k in fns}
        for fn in fns.values():  # warm-up: shared-memory channels, first-call paths
            fn()
            fn()
        for _ in range(5):
            for k, fn in fns.items():
                dlc.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                reps[k].append((time.perf_counter() - t0) / iters)
        # slowest rank of each repetition, then the median over repetitions
        mx = torch.tensor([reps[k] for k in fns], dtype=torch.float64)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        res["sizes"][nbytes] = {k: statistics.median(mx[i].tolist()) for i, k in enumerate(fns)}
    dlc.destroy_process_group()
    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------- driver


def run(world, what, args):
    cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", str(world), __file__]
    cmd += ["--worker", what]
    cmd += ["--steps", str(args.steps), "--sizes", args.sizes] + (["--buckets"] if args.buckets else [])
    cmd += ["--variant", args.variant] if args.variant else []
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
    for line in out.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def _print_trace(rank, t):
    """One rank's median DDP step over distlaunch, ms from the step's start."""
    ms = lambda x: f"{x * 1e3:6.1f}"  # noqa: E731
    fwd, bwd, end = t["phases"]["distlaunch"]
    nfwd, nbwd, nend = t["phases"]["noop"]
    print(
        f"  rank {rank}: forward {ms(fwd)}, backward to {ms(bwd)}, step {ms(end)} ms "
        f"(noop: {ms(nfwd)}, {ms(nbwd)}, {ms(nend)})"
    )
    for i, b in enumerate(t["buckets"]):
        print(
            f"    bucket {i} {b['bytes'] / 2**20:5.1f} MiB: called {ms(b['call'])} started {ms(b['start'])} "
            f"ended {ms(b['end'])} ({ms(b['end'] - b['start'])} ms, cpu {ms(b['cpu'])} ms)"
        )
        rest = b["end"] - b["start"] - b["copyin_w"] - b["wait_w"]
        print(
            f"      copy-in {ms(b['copyin_w'])} (cpu {ms(b['copyin_c'])}), waits {ms(b['wait_w'])} "
            f"(cpu {ms(b['wait_c'])}), reduce + copy-out {ms(rest)} "
            f"(cpu {ms(b['cpu'] - b['copyin_c'] - b['wait_c'])}) ms"
        )


def _fmt(seconds):
    return f"{seconds * 1e6:9.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:9.2f} ms"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="world sizes to run, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed DDP steps per run")
    p.add_argument(
        "--buckets",
        action="store_true",
        help="split each bucket's time: copy-in, waits for peers, reduce and copy-out",
    )
    p.add_argument(
        "--sizes",
        default="8,1KiB,64KiB,1MiB,16MiB,64MiB",
        help="all_reduce sizes in bytes (KiB/MiB suffixes)",
    )
    p.add_argument(
        "--variant",
        default="",
        help="NAME=VALUE,...: also DDP over a second distlaunch group created with these "
        "environment settings (paired with the first)",
    )
    p.add_argument("--skip-ddp", action="store_true", help="run only the all_reduce sizes")
    p.add_argument("--skip-allreduce", action="store_true", help="run only the DDP step")
    p.add_argument("--worker", choices=["ddp", "allreduce"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "ddp":
        return worker_ddp(args)
    if args.worker == "allreduce":
        return worker_allreduce(args)
    worlds = [int(w) for w in args.worlds.split(",")]
    params = sum(a * b + b for a, b in zip(LAYERS[:-1], LAYERS[1:]))
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if not args.skip_ddp:
        compute = run(1, "ddp", args)["compute"]
        mlp = "-".join(map(str, LAYERS))
        print(f"\nDDP step, MLP {mlp} ({params / 1e6:.1f}M params), batch {BATCH}/rank")
        print(f"world 1 (compute only, no DDP): {compute:.3f} s/step")
        print("noop: DDP over a backend that communicates nothing (compute floor at that world)")
        print("cpu: process CPU seconds per step and rank (the helper thread's included)")
        cols = ("world", "gloo s/step", "distlaunch s/step", "/gloo", "noop s/step", "/noop")
        print(" ".join(f"{c:>{len(c) + 1}}" for c in cols) + "   cpu: gloo distlaunch noop")
        for w in worlds:
            r = run(w, "ddp", args)
            dl = r["distlaunch"]
            print(
                f"{w:>6} {r['gloo']:>12.3f} {dl:>18.3f} {dl / r['gloo']:>6.2f} {r['noop']:>12.3f} "
                f"{dl / r['noop']:>6.2f}   {r['gloo_cpu']:.3f} {r['distlaunch_cpu']:.3f} {r['noop_cpu']:.3f}"
            )
            if "variant" in r:
                v = r["variant"]
                print(
                    f"{'':>6} variant ({args.variant}): {v:.3f} s/step, /noop {v / r['noop']:.2f}, "
                    f"/distlaunch {v / dl:.2f}, cpu {r['variant_cpu']:.3f}"
                )
            for rank, t in enumerate(r.get("trace", [])):
                _print_trace(rank, t)
    if not args.skip_allreduce:
        print("\ndist.all_reduce through the backend vs distlaunch.collectives.all_reduce (float32)")
        print("noop: dist.all_reduce on a backend that communicates nothing (torch's own cost);")
        print("floor: (runtime + k * noop) / runtime, k = ranks per core (>= 1): the best a backend")
        print("       behind torch's Python layer can reach")
        cols = [("world", 5), ("bytes", 10), ("backend", 12), ("runtime", 12), ("ratio", 6)]
        print(" ".join(f"{c:>{w}}" for c, w in cols + [("noop", 12), ("floor", 6)]))
        for w in worlds:
            r = run(w, "allreduce", args)
            for nbytes, t in r["sizes"].items():
                ratio = t["backend"] / t["runtime"]
                k = max(1.0, w / (os.cpu_count() or 1))
                floor = (t["runtime"] + k * t["noop"]) / t["runtime"]
                print(
                    f"{w:>5} {int(nbytes):>10} {_fmt(t['backend'])} {_fmt(t['runtime'])} {ratio:>6.2f} "
                    f"{_fmt(t['noop'])} {floor:>6.2f}"
                )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
