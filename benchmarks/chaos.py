"""The chaos suite, long form: many random trials of 2 nodes x 2 workers with one fault
each (see tests/chaos.py), with a summary of outcomes and the worst times.

    python benchmarks/chaos.py --trials 100 [--seed 1] [--json results.jsonl] [--fault F ...]

Head-mode trials use a real sshd on 127.0.0.2/127.0.0.3 (started here; needs root and
openssh-server); without it they are skipped. Target: 0 hangs, 0 survivors, 0 files
left behind.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from chaos import FAULTS, run_trial, unshare_problem  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write every trial's outcome as JSON lines here")
    ap.add_argument(
        "--fault",
        action="append",
        choices=sorted({f for fs in FAULTS.values() for f in fs}),
        help="only this fault (repeatable); default: every fault in every mode",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    sshd = proc = None
    try:
        from sshd import _stop, start_sshd

        sshd = start_sshd(Path(tempfile.mkdtemp(prefix="distlaunch-chaos-sshd-")))
        proc = sshd.process
    except Exception as e:  # no sshd / not root: head mode is left out
        print(f"head mode skipped: {e}", file=sys.stderr)
    no_unshare = unshare_problem()
    if no_unshare:
        print(f"shm_full skipped: {no_unshare}", file=sys.stderr)
    cases = [
        (m, f)
        for m, fs in FAULTS.items()
        for f in fs
        if (m != "head" or sshd)
        and (not args.fault or f in args.fault)
        and (f != "shm_full" or not no_unshare)
    ]
    outcomes = []
    try:
        for i in range(args.trials):
            mode, fault = rng.choice(cases)
            out = run_trial(mode, fault, rng, sshd)
            outcomes.append(out)
            status = "ok" if out.ok else "PROBLEM " + "; ".join(out.problems)
            print(
                f"{i + 1:3d} {mode:8s} {fault:13s} at {out.delay:4.2f}s codes {out.codes} "
                f"end {out.end_s}s  {status}",
                flush=True,
            )
    finally:
        if proc is not None:
            _stop(proc)
    if args.json:
        with open(args.json, "w") as f:
            for o in outcomes:
                f.write(json.dumps(dataclasses.asdict(o)) + "\n")
    summarize(outcomes)


def summarize(outcomes) -> None:
    def worst(os_, attr):
        vals = [getattr(o, attr) for o in os_ if getattr(o, attr) is not None]
        return f"{max(vals):.2f}" if vals else "-"

    by = collections.defaultdict(list)
    for o in outcomes:
        by[(o.mode, o.fault)].append(o)
    print(
        f"\n{'mode':8s} {'fault':13s} {'trials':>6s} {'completed':>9s} {'failed+why':>10s} "
        f"{'hangs':>5s} {'survivors':>9s} {'leftovers':>9s} {'detect s':>8s} {'recover s':>9s} "
        f"{'clean s':>7s}"
    )
    for (mode, fault), os_ in sorted(by.items()):
        done = sum(1 for o in os_ if o.ok and all(c == 0 for c in o.codes))
        print(
            f"{mode:8s} {fault:13s} {len(os_):6d} {done:9d} {sum(o.ok for o in os_) - done:10d} "
            f"{sum(o.hung for o in os_):5d} {sum(bool(o.survivors) for o in os_):9d} "
            f"{sum(bool(o.leftovers) for o in os_):9d} {worst(os_, 'detect_s'):>8s} "
            f"{worst(os_, 'recover_s'):>9s} {worst(os_, 'clean_s'):>7s}"
        )
    bad = [o for o in outcomes if not o.ok]
    print(
        f"\n{len(outcomes)} trials: {len(outcomes) - len(bad)} ended well, {len(bad)} with problems; "
        f"hangs {sum(o.hung for o in outcomes)}, survivors {sum(bool(o.survivors) for o in outcomes)}, "
        f"leftovers {sum(bool(o.leftovers) for o in outcomes)} (worst times in seconds after the fault)"
    )


if __name__ == "__main__":
    main()
