"""--dedup-output with real workers: a line all ranks print at once comes out once with
their ranks; each rank's own lines come out once, with its rank, in its order."""

import time

from conftest import ROOT, dl

PROG = ROOT / "tests" / "hang_workers" / "same_lines.py"


def run(*opts):
    # the instant is far enough ahead for every worker to have started, even under load
    return dl("run", "--nproc-per-node", "4", *opts, PROG, f"{time.time() + 4:.3f}")


def ranks_of(label):
    out = []
    for part in label.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def test_identical_lines_merged_own_lines_kept():
    res = run("--dedup-output")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    # normally one line [0-3]; a rank woken over 0.2 s late (a loaded machine) gets its own
    merged = {
        i: ranks_of(ln[1 : ln.index("]")]) for i, ln in enumerate(lines) if ln.endswith("all ranks here")
    }
    assert sorted(r for rs in merged.values() for r in rs) == [0, 1, 2, 3], lines
    assert len(merged) < 4, lines  # some were merged
    for r in range(4):
        assert lines.count(f"[{r}]: rank {r} alone") == 1
        mine = next(i for i, rs in merged.items() if r in rs)
        assert mine < lines.index(f"[{r}]: rank {r} alone")  # its order kept
    assert len(lines) == len(merged) + 4


def test_off_by_default():
    res = run()
    assert res.returncode == 0, res.stderr
    assert sorted(ln for ln in res.stdout.splitlines() if "here" in ln) == [
        f"[{r}]: all ranks here" for r in range(4)
    ]
