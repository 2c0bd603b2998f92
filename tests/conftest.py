"""Shared helpers: run `python -m distlaunch` as a real subprocess."""

import atexit
import compileall
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Per-node launches and env:// create the per-user secret file on first use
# (distlaunch/secret.py): keep the tests' one out of the real home directory.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="distlaunch-test-config-")
atexit.register(shutil.rmtree, os.environ["XDG_CONFIG_HOME"], True)
# numpy's OpenBLAS starts a thread per core at import, and the threads spin before they
# sleep: ~0.1 s of CPU (measured) in each interpreter the suite starts that imports
# numpy outside `distlaunch run` (workers started by hand or under mpiexec; the launcher
# sets OMP_NUM_THREADS=1 for its workers, which OpenBLAS also reads). The tests' BLAS
# work is small: one thread is enough.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.pop("DISTLAUNCH_STORE_TOKEN", None)
os.environ.pop("DISTLAUNCH_STORE_TOKEN_FILE", None)
WORKERS = ROOT / "tests" / "workers"


def dl_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "distlaunch", *map(str, args)]


def dl(*args, timeout: float = 60, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run distlaunch to completion; stdout/stderr as text. A run past ``timeout`` is
    killed and fails the test with the tail of what it printed (to see where it hung)."""
    try:
        return subprocess.run(
            dl_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or ROOT
        )
    except subprocess.TimeoutExpired as e:

        def tail(b):
            return (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-3000:]

        raise AssertionError(
            f"distlaunch {' '.join(map(str, args))} still ran after {timeout} s\n"
            f"--- stdout tail ---\n{tail(e.stdout)}\n--- stderr tail ---\n"
            f"{tail(e.stderr)}"
        ) from None


def dl_popen(*args, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        dl_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kw
    )


def line_of(path, marker):
    """The line number (from 1) of the first line of file ``path`` containing ``marker``."""
    return next(i for i, ln in enumerate(pathlib.Path(path).read_text().splitlines(), 1) if marker in ln)


@pytest.fixture
def actor():
    return str(WORKERS / "actor.py")


def pytest_configure(config):
    # The suite starts thousands of interpreters that import distlaunch. Where bytecode
    # is not written (PYTHONDONTWRITEBYTECODE=1, as on this project's CI machines) each
    # one would compile the package from source, ~0.2 s of CPU per process: compile it
    # once, in the controller (.pyc files are written atomically; checked against the
    # source's hash, not its mtime, so an edit within the same second is never missed)
    if not hasattr(config, "workerinput"):
        # MPICH's output of a program is the same whatever distlaunch setting a test
        # varies: one run per program, world size and arguments (tests/mpi_run.py)
        os.environ["MPICH_CACHE"] = config._mpich_cache = tempfile.mkdtemp(prefix="dltest-mpich-")
        for d in ("distlaunch", "tests"):
            compileall.compile_dir(
                ROOT / d, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
            )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`-n N --dist loadgroup`, the README's command) every test that
    # shares the session's Slurm cluster, or its sshd, runs in one worker: each is started
    # once, as in a serial run (tests/slurm.py, tests/sshd.py). First: xdist's own hook
    # reads the marks into the node ids it schedules by.
    for item in items:
        for fixture in ("slurm_cluster", "sshd_hosts"):
            if fixture in item.fixturenames:
                item.add_marker(pytest.mark.xdist_group(fixture))
                break


def pytest_unconfigure(config):
    cache = getattr(config, "_mpich_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
