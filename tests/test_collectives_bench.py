"""`distlaunch bench` (distlaunch/collectives/bench.py): the nccl-tests-style table and
the --json lines, with a correctness check of every size."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_bench(*args, env, timeout=120):
    """``distlaunch bench ARGS`` to completion (stdout and stderr as text)."""
    return subprocess.run(
        [sys.executable, "-m", "distlaunch", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def _bench(*args, timeout=120):
    env = dict(
        os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    p = _run_bench(*args, env=env, timeout=timeout)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_bench_table():
    out = _bench("all_reduce", "--nproc-per-node", "2", "--sizes", "8B..64KiB")
    header = [line for line in out.splitlines() if "algbw" in line]
    assert header and all(
        w in header[0] for w in ("size", "count", "type", "time(us)", "busbw(GB/s)", "#wrong")
    )
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [8 << k for k in range(14)]  # 8 B .. 64 KiB, doubling
    for size, count, dtype, _iters, t, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and dtype == "float32" and wrong == "0"
        assert float(t) > 0
        # two ranks: busbw = algbw x 2(n-1)/n = algbw
        assert abs(float(busbw) - float(algbw)) <= 0.0015


@pytest.mark.parametrize(
    "op", ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"]
)
def test_bench_json(op):
    out = _bench(op, "--nproc-per-node", "2", "--sizes", "1KiB..4KiB", "--iters", "3", "--json")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["size"] for r in rows] == [1024, 2048, 4096]
    factor = {"all_reduce": 1.0, "broadcast": 1.0, "send_recv": 1.0}.get(op, 0.5)  # n = 2
    for r in rows:
        assert r["op"] == op and r["wrong"] == 0 and r["world_size"] == 2 and r["time_us"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor, abs=2e-4)


def test_bench_plot(tmp_path):
    """--plot draws a PNG of bandwidth against size (needs the `plot` extra)."""
    image = pytest.importorskip("matplotlib.image")
    out = _bench(
        "all_reduce",
        "--nproc-per-node",
        "2",
        "--sizes",
        "8B..4KiB",
        "--iters",
        "3",
        "--plot",
        tmp_path / "bw.png",
    )
    assert "plot written to" in out
    png = image.imread(tmp_path / "bw.png")
    assert png.ndim == 3 and png.shape[0] > 100 and png.shape[1] > 100
    assert len({tuple(px) for px in png.reshape(-1, png.shape[2])[::97]}) > 3  # not a blank canvas


def test_bench_plot_without_matplotlib(tmp_path):
    """Without matplotlib --plot fails at once with a one-line error, before measuring."""
    hide = tmp_path / "hide"
    hide.mkdir()  # every worker starts with matplotlib made unimportable
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), REPO]))
    args = ["all_reduce", "--nproc-per-node", "1", "--sizes", "8B", "--plot", str(tmp_path / "x.png")]
    p = _run_bench(*args, env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "needs matplotlib" in p.stderr + p.stdout and "float32" not in p.stdout  # nothing measured
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sizes", "5:1"], "--sizes '5:1' is invalid"),
        (["--sizes", "64..8"], "--sizes '64..8' is invalid"),
        (["--dtype", "foo"], "--dtype 'foo' is not an element type"),
        (["--dtype", "U4"], "give one of bool, int8"),
        (["--dtype", "i4,("], "--dtype 'i4,(' is not an element type"),
        (["--iters", "0"], "--iters 0 is invalid: give at least 1"),
        (["--iters", "-5"], "--iters -5 is invalid"),
        (["all_reduc"], "bench 'all_reduc' is not a benchmarked operation: give one of all_reduce, "),
    ],
)
def test_bad_options_exit_2_before_workers_start(tmp_path, args, needle):
    """One line, exit 2, and no worker ran (each would print its own error)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # else no line says that workers are being started
    p = _run_bench("--nproc-per-node", "2", "--sizes", "8B", *args, env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.splitlines()) == 1 and needle in p.stderr, p.stderr
    assert p.stdout == ""
