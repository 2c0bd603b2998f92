"""Start a world of worker processes for the collectives tests.

``launch(script, n, ...)`` runs ``python -m distlaunch run --nproc-per-node n script``
(the test fails when `distlaunch run` is broken), or, with ``COLL_TEST_SPAWNER=popen``,
one subprocess per rank with the torchrun environment and a ``file://`` init method in
``COLL_INIT_METHOD``. Returns (exit code, stdout, stderr) with every line of worker
output (the launcher prefixes ``[<rank>]: ``; the fallback does the same).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

from ports import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.dirname(os.path.abspath(__file__))


def _base_env(extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


_probe = None


def use_transport(monkeypatch, mode):
    """Run the launched workers with the shared-memory path on ("shm": workers must
    actually use it, checked by common.Failures.exit) or off ("tcp": DISTLAUNCH_SHM=0)."""
    monkeypatch.setenv("DISTLAUNCH_SHM", "1" if mode == "shm" else "0")
    if mode == "shm":
        monkeypatch.setenv("COLL_EXPECT_SHM", "1")
    else:
        monkeypatch.delenv("COLL_EXPECT_SHM", raising=False)


def _launcher_available() -> bool:
    """Use `distlaunch run` unless COLL_TEST_SPAWNER=popen. The launcher is probed once
    with a trivial script; when it is broken every test that needs it fails (with the
    probe's output) instead of quietly testing something else."""
    global _probe
    if os.environ.get("COLL_TEST_SPAWNER") == "popen":
        return False
    if _probe is None:
        cmd = [
            sys.executable,
            "-m",
            "distlaunch",
            "run",
            "--nproc-per-node",
            "1",
            os.path.join(WORKERS, "probe.py"),
        ]
        try:
            p = subprocess.run(cmd, env=_base_env(None), capture_output=True, text=True, timeout=60, cwd=REPO)
            ok = p.returncode == 0 and "probe ok" in p.stdout
            why = f"exit code {p.returncode}\n--- stdout ---\n{p.stdout[-2000:]}\n--- stderr ---\n{p.stderr[-2000:]}"  # noqa: E501
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, why = False, str(e)
        _probe = True if ok else f"`{' '.join(cmd)}` does not work ({why})"
    if _probe is not True:
        raise AssertionError(f"{_probe}; set COLL_TEST_SPAWNER=popen to test without the launcher")
    return True


def launch(script, n, args=(), env=None, timeout=120, spawner=None, launcher_args=()):
    script = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    use_launcher = spawner == "distlaunch" or (spawner is None and _launcher_available())
    if use_launcher:
        cmd = [
            sys.executable,
            "-m",
            "distlaunch",
            "run",
            "--nproc-per-node",
            str(n),
            *launcher_args,
            script,
            *args,
        ]
        try:
            p = subprocess.run(
                cmd, env=_base_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO
            )
        except subprocess.TimeoutExpired as e:  # show where it hung instead of a bare timeout

            def tail(b):
                return (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-4000:]

            raise AssertionError(
                f"{' '.join(cmd)} still ran after {timeout} s\n--- stdout ---\n"
                f"{tail(e.stdout)}\n--- stderr ---\n{tail(e.stderr)}"
            ) from None
        return p.returncode, p.stdout, p.stderr
    return spawn(script, n, args, env, timeout)


def rank_env(r, n, port, init_method, env=None):
    """The environment of rank ``r`` of ``n`` started without a launcher (torchrun's names;
    the launcher's store variables removed) that initialises from ``init_method``."""
    e = _base_env(env)
    for k in ("DISTLAUNCH_STORE_PORT", "DISTLAUNCH_STORE_ADDR", "DISTLAUNCH_STORE_TOKEN"):
        e.pop(k, None)
    e.update(
        RANK=str(r),
        WORLD_SIZE=str(n),
        LOCAL_RANK=str(r),
        LOCAL_WORLD_SIZE=str(n),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_RUN_ID="test",
        COLL_INIT_METHOD=init_method,
    )
    return e


def spawn(script, n, args=(), env=None, timeout=120, init_method=None):
    """One subprocess per rank; first failing rank's exit code (or 0)."""
    script = script if os.path.isabs(script) else os.path.join(WORKERS, script)
    tmp = tempfile.mkdtemp(prefix="colltest-")
    init_method = init_method or f"file://{tmp}/store"
    port = free_port()
    procs = []
    for r in range(n):
        e = rank_env(r, n, port, init_method, env)
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
        )
    out = {r: ([], []) for r in range(n)}

    def pump(r, stream, sink):
        for line in stream:
            sink.append(f"[{r}]: {line}")

    threads = [
        threading.Thread(target=pump, args=(r, s, out[r][i]))
        for r, p in enumerate(procs)
        for i, s in enumerate((p.stdout, p.stderr))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    codes = [None] * n
    first_fail = None
    while any(c is None for c in codes):
        for r, p in enumerate(procs):
            if codes[r] is None and p.poll() is not None:
                codes[r] = p.returncode
                if p.returncode != 0 and first_fail is None:
                    first_fail = p.returncode
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            first_fail = first_fail or -9
            break
        time.sleep(0.01)
    for p in procs:
        p.wait()
    for t in threads:
        t.join()
    stdout = "".join(line for r in range(n) for line in out[r][0])
    stderr = "".join(line for r in range(n) for line in out[r][1])
    return (first_fail or 0), stdout, stderr
