"""Run one program of tests/mpi_programs under mpiexec (mpi4py + MPICH) and under
`distlaunch run` with the import swapped; used by tests/test_mpi_programs.py and by hand:
``python tests/mpi_run.py ring 3``."""

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "mpi_programs"
MPI4PY = "from mpi4py import MPI"
OURS = "from distlaunch import mpi as MPI"
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def have_mpich() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(MPIEXEC)


def program(name: str, tmp: Path, ours: bool) -> Path:
    src = (PROGRAMS / f"{name}.py").read_text()
    assert MPI4PY in src, f"{name}.py must import MPI as `{MPI4PY}`"
    path = tmp / f"{name}_{'dl' if ours else 'mpich'}.py"
    path.write_text(src.replace(MPI4PY, OURS) if ours else src)
    return path


def run(name: str, n: int, tmp: Path, ours: bool, args: tuple = (), timeout: float = 60):
    """(returncode, sorted stdout lines, stderr) of ``name`` at world size ``n``. MPICH's
    successful runs are kept for the test session (``MPICH_CACHE``, set by conftest):
    tests that vary only distlaunch's settings compare with one MPICH run."""
    cache = os.environ.get("MPICH_CACHE")
    if ours or not cache:
        return _run(name, n, tmp, ours, args, timeout)
    key = hashlib.sha256(repr(((PROGRAMS / f"{name}.py").read_text(), n, args)).encode()).hexdigest()
    entry = Path(cache) / key
    with open(entry.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (xdist workers share the cache: one runs MPICH)
        if entry.exists():
            return 0, json.loads(entry.read_text()), ""
        rc, lines, err = _run(name, n, tmp, ours, args, timeout)
        if rc == 0:
            entry.write_text(json.dumps(lines))
        return rc, lines, err


def _run(name: str, n: int, tmp: Path, ours: bool, args: tuple, timeout: float):
    path = program(name, tmp, ours)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if ours:
        cmd = [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", str(n), str(path), *args]
    else:
        cmd = [MPIEXEC, "-n", str(n), sys.executable, str(path), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = (
        [re.sub(r"^\[\d+\]: ", "", ln) for ln in res.stdout.splitlines()] if ours else res.stdout.splitlines()
    )
    return res.returncode, sorted(lines), res.stderr


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        name, n = sys.argv[1], int(sys.argv[2])
        rc, mine, err = run(name, n, Path(d), True)
        print(f"ours rc={rc}\n" + "\n".join(mine) + ("\n" + err[-3000:] if rc else ""))
        if have_mpich():
            rc2, theirs, err2 = run(name, n, Path(d), False)
            print(f"mpich rc={rc2}" + ("\n" + err2[-2000:] if rc2 else ""))
            print("SAME" if mine == theirs else "DIFF:\n" + "\n".join(sorted(set(mine) ^ set(theirs))))
