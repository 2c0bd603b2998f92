"""Launcher overhead, side by side: distlaunch run vs mpiexec (MPICH) vs torchrun.

    python benchmarks/bench_launch.py [--reps 10] [--nproc 4] [--before DIR]

Prints, per launcher: median wall time of a job of N no-op Python workers, the launcher
process's own peak RSS (VmHWM of the top process, sampled until it exits), and the
cost of one restart (median wall time of a run whose rank 0 fails once with
--max-restarts 1, minus the clean run). Ratios are ours / theirs (lower is better).
"click floor" is the least any click-based launcher can cost: a click command that
parses --nproc-per-node, starts the workers with RANK set and waits (no store, no
supervision, no output prefixes); distlaunch minus it is what supervision costs.
Launchers run interleaved so machine noise hits all alike. Peers that are not installed
(`pip install mpi4py mpich`, torch) are skipped.

Then the one-worker case: `distlaunch run noop.py` against `python noop.py` alone (what
the launcher adds to one interpreter's start and exit), interleaved likewise.
``--before DIR``: also run the distlaunch of another checkout (a worktree of an older
commit, put first on PYTHONPATH) as "distlaunch (before)", in both cases.
``--stages``: what the launcher's start-up imports cost, stage by stage in the order a
single-node `run` of the narrow form (``preparse.py``) loads them (fastest of --reps
fresh interpreters, ms): the interpreter, `re` (the console script's), our modules
before the first spawn, what loads after it, beside the workers, and what a command line
that goes to click adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)
NOOP = "pass\n"
CLICK_FLOOR = """import os, subprocess, sys
import click

@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--nproc-per-node", type=int, default=1)
@click.argument("script")
def run(nproc_per_node, script):
    env = lambda r: dict(os.environ, RANK=str(r), WORLD_SIZE=str(nproc_per_node))
    ps = [subprocess.Popen([sys.executable, script], env=env(r)) for r in range(nproc_per_node)]
    sys.exit(max(p.wait() for p in ps))

run()
"""
FAIL_ONCE = (
    "import os, sys\n"
    "if os.environ.get('RANK') == '0' and os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':\n"
    "    sys.exit(1)\n"
)


def peak_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd`` to completion; return (wall seconds, top process peak RSS in KiB)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    peak = 0
    while p.poll() is None:
        peak = max(peak, peak_rss_kib(p.pid))
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{cmd} failed with {p.returncode}")
    return wall, peak


def launchers(nproc: int, floor: str, before: dict[str, str] | None) -> dict[str, callable]:
    """name -> (script, restarts) -> (command, environment or None)."""

    def ours(script: str, restarts: int = 0) -> list[str]:
        return [
            os.path.join(BIN, "distlaunch"),
            "run",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(restarts),
            script,
        ]

    found = {"distlaunch": ours}
    if before is not None:
        found["distlaunch (before)"] = ours
    found["click floor"] = lambda script, restarts=0: [
        sys.executable,
        floor,
        "--nproc-per-node",
        str(nproc),
        script,
    ]
    if os.path.exists(os.path.join(BIN, "mpiexec")):
        found["mpiexec"] = lambda script, restarts=0: [
            os.path.join(BIN, "mpiexec"),
            "-n",
            str(nproc),
            sys.executable,
            script,
        ]
    if os.path.exists(os.path.join(BIN, "torchrun")):
        found["torchrun"] = lambda script, restarts=0: [
            os.path.join(BIN, "torchrun"),
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(restarts),
            script,
        ]
    return found


def before_env(checkout: str | None) -> dict[str, str] | None:
    """The environment that runs ``checkout``'s distlaunch (None: no --before)."""
    if checkout is None:
        return None
    import compileall

    compileall.compile_dir(os.path.join(checkout, "distlaunch"), quiet=1)
    path = os.pathsep.join(filter(None, [os.path.abspath(checkout), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


def one_worker(reps: int, noop: str, before: dict[str, str] | None) -> None:
    """`distlaunch run noop.py` (one worker) against `python noop.py` alone."""
    cmds = {
        "distlaunch": ([os.path.join(BIN, "distlaunch"), "run", noop], None),
        "python noop.py": ([sys.executable, noop], None),
    }
    if before is not None:
        cmds["distlaunch (before)"] = (cmds["distlaunch"][0], before)
    wall: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(reps):
        for name, (cmd, env) in cmds.items():
            wall[name].append(timed(cmd, env)[0])
    med = {k: statistics.median(v) for k, v in wall.items()}
    print(f"\none no-op worker, {reps} interleaved runs each, medians")
    for name in cmds:
        print(f"{name:<22}{med[name]:>10.3f} s   (fastest {min(wall[name]):.3f})")
    base = med["python noop.py"]
    for name in cmds:
        if name.startswith("distlaunch"):
            print(f"  {name} / python noop.py: {med[name] / base:.2f}x, {1e3 * (med[name] - base):+.1f} ms")


# (stage, modules imported in it), in the order `distlaunch run` on one node loads them
# (the narrow form that preparse.py takes: click is not loaded; see "click (declined
# forms)" for what a command line that goes to click adds)
STAGES = [
    ("re (console script)", "re"),
    ("pre-parser, command, report, errors", "distlaunch.preparse, distlaunch.command"),
    ("config, modes, engine, env", "distlaunch.config, distlaunch.modes"),
    ("launcher, specs, group, guard, numa", "distlaunch.launcher, distlaunch.agent.specs"),
    ("after the spawn: store server", "distlaunch.store.server"),
    ("after the spawn: agent", "distlaunch.agent.node"),
    ("click (declined forms)", "click"),
    ("cli (declined forms: its click options)", "distlaunch.cli"),
]
STAGE_PROBE = """
import time
t = [time.perf_counter()]
for mods in {mods!r}:
    exec("import " + mods)
    t.append(time.perf_counter())
print(" ".join(str(b - a) for a, b in zip(t, t[1:])))
"""


def stages(reps: int) -> None:
    """Each stage's import time, the fastest of ``reps`` fresh interpreters."""
    probe = STAGE_PROBE.format(mods=[m for _, m in STAGES])
    best = [float("inf")] * len(STAGES)
    start = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        start = min(start, time.perf_counter() - t0)
        out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
        best = [min(b, float(x)) for b, x in zip(best, out.stdout.split())]
    print(f"\nstart-up stages, fastest of {reps} fresh interpreters, ms")
    print(f"  {'interpreter (python -c pass, whole run)':<44}{1e3 * start:7.1f}")
    for (name, _), b in zip(STAGES, best):
        print(f"  {name:<44}{1e3 * b:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--before", metavar="DIR", help="also run the distlaunch of this checkout")
    ap.add_argument("--stages", action="store_true", help="only the import cost of each start-up stage")
    args = ap.parse_args()
    # An installed package has bytecode; a checkout run with PYTHONDONTWRITEBYTECODE would
    # recompile distlaunch in every launch and measure the compiler instead.
    import compileall

    compileall.compile_dir(os.path.join(os.path.dirname(__file__), "..", "distlaunch"), quiet=1)
    before = before_env(args.before)
    if args.stages:
        stages(args.reps)
        return
    tmp = tempfile.mkdtemp()
    noop, fail_once = os.path.join(tmp, "noop.py"), os.path.join(tmp, "fail_once.py")
    open(noop, "w").write(NOOP)
    open(fail_once, "w").write(FAIL_ONCE)
    floor = os.path.join(tmp, "click_floor.py")
    open(floor, "w").write(CLICK_FLOOR)
    env_note = os.environ.get("OMP_NUM_THREADS")
    found = launchers(args.nproc, floor, before)
    wall = {k: [] for k in found}
    rss = {k: [] for k in found}
    # the others do not restart
    restart = {k: [] for k in found if k.startswith("distlaunch") or k == "torchrun"}
    for _ in range(args.reps):
        for name, cmd in found.items():
            env = before if name == "distlaunch (before)" else None
            w, r = timed(cmd(noop), env)
            wall[name].append(w)
            rss[name].append(r)
            if name in restart:
                restart[name].append(timed(cmd(fail_once, restarts=1), env)[0] - w)
    print(
        f"{args.nproc} no-op Python workers, {args.reps} interleaved runs each, medians "
        f"(cores: {os.cpu_count()}, OMP_NUM_THREADS={env_note})"
    )
    print(f"{'launcher':<21}{'wall s':>10}{'peak RSS MiB':>15}{'restart s':>12}")
    med = {k: statistics.median(v) for k, v in wall.items()}
    mem = {k: max(v) / 1024 for k, v in rss.items()}
    rst = {k: statistics.median(v) for k, v in restart.items()}
    for name in found:
        r = f"{rst[name]:.3f}" if name in rst else "n/a"
        print(f"{name:<21}{med[name]:>10.3f}{mem[name]:>15.1f}{r:>12}")
    print("ratios, distlaunch / peer (lower is better):")
    for peer in found:
        if peer == "distlaunch":
            continue
        line = f"  vs {peer:<19} wall {med['distlaunch'] / med[peer]:.2f}x  RSS {mem['distlaunch'] / mem[peer]:.2f}x"  # noqa: E501
        if peer in rst:
            line += f"  restart {rst['distlaunch'] / rst[peer]:.2f}x"
        print(line)
    if "mpiexec" in med:
        print(f"  (click floor / mpiexec: wall {med['click floor'] / med['mpiexec']:.2f}x)")
        if "distlaunch (before)" in med:
            print(
                f"  (distlaunch (before) / mpiexec: wall {med['distlaunch (before)'] / med['mpiexec']:.2f}x)"
            )
    one_worker(args.reps, noop, before)


if __name__ == "__main__":
    main()
