"""Start-up on a two-node Slurm allocation, side by side: distlaunch vs srun vs srun+torchrun.

    python benchmarks/bench_slurm.py [--reps 7] [--python /work/venv-bench/bin/python]

Brings up the test cluster of tests/slurm.py (slurmctld and two slurmd, n1 and n2, on
this machine; root, ``apt-get install -y slurm-wlm munge``) and times, interleaved so
machine noise hits all alike, the wall time of a whole job of 4 no-op Python workers,
2 per node, allocation included (each in ``salloc -N2 --ntasks-per-node=2``):

- ours: ``distlaunch run --nproc-per-node 2 noop.py``
- srun: ``srun --ntasks-per-node=2 python noop.py`` (no launcher at all)
- torchrun: ``srun --ntasks=2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 2
  --rdzv-backend c10d --rdzv-endpoint FIRST_NODE:PORT --rdzv-id $SLURM_JOB_ID noop.py``,
  the recipe users write today (FIRST_NODE: the first node's address, 127.0.0.1 here)

Each run starts once the previous job has left both nodes (squeue empty, sinfo idle).
Prints the medians and the ratios ours/srun (target <= 1.3) and ours/torchrun (target
<= 0.3), with the load averages before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import slurm  # noqa: E402  (tests/slurm.py: the cluster, started outside pytest)


def commands(noop: Path, port: int, py: str) -> dict[str, list[str]]:
    return {
        "ours": [
            "salloc",
            "-N2",
            "--ntasks-per-node=2",
            py,
            "-m",
            "distlaunch",
            "run",
            "--nproc-per-node",
            "2",
            str(noop),
        ],
        "srun": ["salloc", "-N2", "--ntasks-per-node=2", "srun", "--ntasks-per-node=2", py, str(noop)],
        "torchrun": [
            "salloc",
            "-N2",
            "--ntasks-per-node=2",
            "srun",
            "--ntasks=2",
            "--ntasks-per-node=1",
            "sh",
            "-c",
            f"exec {py} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
            f'--rdzv-endpoint 127.0.0.1:{port} --rdzv-id "$SLURM_JOB_ID" {noop}',
        ],
    }


def wait_idle(cluster: slurm.SlurmCluster) -> None:
    """Until no job is left and both nodes are idle: the previous job's end (step and
    job completion, epilog) is not timed, and the next salloc does not wait for it."""
    while True:
        jobs = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=cluster.env()).stdout
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=cluster.env()
        ).stdout.split()
        if not jobs.strip() and states and all(s == "idle" for s in states):
            return
        time.sleep(0.02)


def timed(cluster: slurm.SlurmCluster, cmd: list[str], env: dict[str, str], cwd: str) -> float:
    """Wall seconds of ``cmd`` (run in ``cwd``) to its end, once the cluster is idle;
    exits the benchmark when it fails."""
    wait_idle(cluster)
    t0 = time.perf_counter()
    cp = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if cp.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {cp.returncode}:\n{cp.stderr[-3000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter of every timed command (e.g. a fresh venv's; this script needs pytest)",
    )
    ap.add_argument("--only", default="ours,srun,torchrun", help="commands to time, comma-separated")
    ap.add_argument(
        "--before",
        metavar="CHECKOUT",
        help="also time `ours` with the distlaunch of this checkout (e.g. a worktree of an older commit)",
    )
    args = ap.parse_args()
    if slurm.skip_reason():
        raise SystemExit(slurm.skip_reason())
    # Byte-compile the package as pip does at install: under PYTHONDONTWRITEBYTECODE (set
    # in some sandboxes) an editable install recompiles ~40 modules in every interpreter.
    here = Path(__file__).resolve().parent.parent
    for root in (here, *([Path(args.before)] if args.before else [])):
        subprocess.run(
            [args.python, "-m", "compileall", "-q", str(root / "distlaunch")],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    with tempfile.TemporaryDirectory(prefix="bench_slurm_") as tmp:
        noop = Path(tmp) / "noop.py"
        noop.write_text("pass\n")
        cluster = slurm.start(Path(tmp) / "cluster")
        try:
            load0 = os.getloadavg()
            times: dict[str, list[float]] = {}
            for rep in range(args.reps + 1):  # the first round warms caches and is dropped
                port = slurm.free_ports(1)[0]
                # PYTHONPATH picks the checkout; the commands run in the temporary
                # directory (``python -m`` puts the working directory first on sys.path:
                # run from a checkout, that checkout's distlaunch would win)
                ours = cluster.env(PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
                runs = [(name, cmd, ours) for name, cmd in commands(noop, port, args.python).items()]
                if args.before:
                    env = cluster.env(
                        PYTHONPATH=os.pathsep.join([args.before, os.environ.get("PYTHONPATH", "")])
                    )
                    runs.insert(1, ("before", runs[0][1], env))
                for name, cmd, env in runs:
                    if name not in args.only.split(",") and name != "before":
                        continue
                    if not rep and name in ("ours", "before"):  # which checkout it times
                        where = subprocess.run(
                            [args.python, "-c", "import distlaunch; print(distlaunch.__file__)"],
                            env=env,
                            cwd=tmp,
                            capture_output=True,
                            text=True,
                        ).stdout.strip()
                        print(f"{name}: {where}")
                    t = timed(cluster, cmd, env, tmp)
                    if rep:
                        times.setdefault(name, []).append(t)
            load1 = os.getloadavg()
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"Slurm {cluster.version}, 2 nodes on one machine ({os.cpu_count()} CPUs), 4 no-op workers")
            print(f"reps {args.reps} (interleaved, after one warm-up round; each on an idle cluster)")
            print(f"load average before {load0[0]:.2f} {load0[1]:.2f}, after {load1[0]:.2f} {load1[1]:.2f}")
            print(f"{'command':10} {'median s':>9} {'min s':>7} {'max s':>7}")
            for k, v in times.items():
                print(f"{k:10} {med[k]:9.3f} {min(v):7.3f} {max(v):7.3f}")
            print(f"ours/srun      {med['ours'] / med['srun']:.2f}  (target <= 1.3)")
            if "before" in med:
                print(f"before/srun    {med['before'] / med['srun']:.2f}")
            if "torchrun" in med:
                print(f"ours/torchrun  {med['ours'] / med['torchrun']:.2f}  (target <= 0.3)")
        finally:
            slurm.stop(cluster)


if __name__ == "__main__":
    main()
