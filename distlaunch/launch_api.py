"""``distlaunch.launch(fn, ...)``: run a function on every worker and get the per-rank
return values back (as ``torch.multiprocessing.spawn`` or Horovod's
``horovod.run`` do, but with distlaunch's supervision, restarts and hosts).

The caller hosts a small store of its own: it holds the call, pickled with cloudpickle
(so lambdas, closures and functions of ``__main__`` or a notebook travel by value, as
with torchrunx), and each worker puts back its result (or its traceback). Only the
caller and its workers, the same user's processes, hold the store's secret: nothing
unpickles data from anyone else. The job itself is an ordinary ``distlaunch run``
subprocess running this module as its worker (``python -m distlaunch.launch_api``), so
the caller's process gets no signal handlers and forks nothing. Workers on other hosts
reach this store at the head's address (the one ``distlaunch run`` announces to them);
its port and secret, and the values of ``env=``, travel as ``-x NAME`` variables (in
the environment of ``distlaunch run``, never its argv), which go to hosts over SSH stdin.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from .errors import ConfigError, WorkerFailedError

T = TypeVar("T")

PORT_VAR = "DISTLAUNCH_LAUNCH_PORT"
TOKEN_VAR = "DISTLAUNCH_LAUNCH_TOKEN"


class LaunchFailedError(WorkerFailedError):
    """A worker of ``launch()`` failed; ``rank`` and ``traceback`` tell which and why
    (``traceback`` is None when the worker died without raising, e.g. by a signal)."""

    def __init__(self, message: str, rank: int | None, traceback: str | None, exit_code: int) -> None:
        super().__init__(message, None, exit_code)
        self.rank = rank
        self.traceback = traceback


def launch(
    fn: Callable[..., T],
    args: Iterable[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    nproc_per_node: int = 1,
    hosts: str | None = None,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    options: list[str] | tuple[str, ...] = (),
    timeout: float | None = None,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on every worker; return the results as a list indexed
    by rank.

    ``fn`` and the arguments are pickled with cloudpickle: lambdas, closures and
    functions defined in ``__main__`` or a notebook work (their code travels by value;
    modules they import must be importable on the workers). Results come back the same
    way. ``hosts`` is a ``-H`` list (``"node1:2,node2:2"``);
    ``env`` sets variables for every worker (values as ``str``; they stay off command
    lines and out of the launcher's own environment: a dotenv file readable by this user
    only, passed as ``--env-file``; names are letters, digits and ``_``); ``options``
    are more ``distlaunch run`` options. Worker output
    goes to this process's stdout/stderr, prefixed by rank.

    Blocks until the job ends, at most ``timeout`` seconds (None: no limit). Raises
    TypeError if the call cannot be pickled (e.g. it holds a lock or an open socket),
    ConfigError for bad options or ``env`` names, LaunchFailedError (with the failed rank's traceback)
    when the job fails after its restarts, subprocess.TimeoutExpired on timeout (the job
    is stopped first).
    """
    import cloudpickle

    from .store import StoreClient, StoreServer

    try:
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(f"launch(): the function and its arguments must be picklable: {e}") from e
    token = os.urandom(16).hex()
    cmd = [
        sys.executable,
        "-m",
        "distlaunch",
        "run",
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        str(max_restarts),
        "-x",
        PORT_VAR,
        "-x",
        TOKEN_VAR,
    ]
    for name in env or {}:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):  # not a glob, no '='
            raise ConfigError(f"launch(env=...): {name!r} is not a variable name; use letters, digits and _")
    if hosts:
        cmd += ["-H", hosts]
    scratch = tempfile.TemporaryDirectory(prefix="distlaunch_launch_")
    if env:  # values off argv (ps shows it) and out of the launcher's own environment
        cmd += ["--env-file", _env_file(scratch.name, env)]
    root_cause = os.path.join(scratch.name, "root_cause.json")  # see cli._root_cause_to
    cmd += ["--root-cause-file", root_cause, *options, "-m", "distlaunch.launch_api"]
    with scratch, StoreServer("0.0.0.0" if hosts else "127.0.0.1", 0, token=token) as server:
        assert server.port is not None  # bound on entry
        with StoreClient(
            "127.0.0.1", server.port, token=token, timeout=30, connect=server.connect_local
        ) as store:
            store.set("payload", payload)
            job_env = {**os.environ, PORT_VAR: str(server.port), TOKEN_VAR: token}
            job = subprocess.Popen(cmd, env=job_env)
            try:
                code = job.wait(timeout)
            except subprocess.TimeoutExpired:
                job.terminate()
                job.wait()
                raise
            # attempt = the restart count (TORCHELASTIC_RESTART_COUNT), as in the log
            # directory's attempt_N; a round that is not a restart rewrites its keys
            attempt = max((a for a in range(max_restarts + 1) if store.check([f"world/{a}"])), default=None)
            if attempt is None and code == 2:  # usage error before any worker started
                raise ConfigError(f"distlaunch run rejected the options {cmd[3:]}")
            if attempt is None:
                raise LaunchFailedError(
                    f"no worker started (distlaunch run exited with {code})", None, None, code
                )
            if code == 0:
                world = int(store.get(f"world/{attempt}"))
                return [pickle.loads(store.get(f"result/{attempt}/{r}")) for r in range(world)]
            raise _failure(store, attempt, root_cause, code)


def _env_file(directory: str, env: dict[str, Any]) -> str:
    """Write ``env`` (values as str) as a dotenv file readable by this user only, for
    ``--env-file``; returns its path."""
    path = os.path.join(directory, "env")
    quote = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n"})
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as f:
        f.writelines(f'{k}="{str(v).translate(quote)}"\n' for k, v in env.items())
    return path


def _failure(store: Any, attempt: int, root_cause: str, code: int) -> LaunchFailedError:
    """The error of a job that ended with ``code``: its root cause (the first failed
    worker, as ``distlaunch run`` named it in ``root_cause``) with its traceback if it
    raised. One line: the traceback was in the worker's output already."""
    import json

    try:
        with open(root_cause) as f:
            rank = int(json.load(f)["rank"])
    except FileNotFoundError:  # no worker failed: e.g. stopped by a signal, a lost node
        return LaunchFailedError(
            f"distlaunch run exited with code {code} (see its output above)", None, None, code
        )
    key = f"error/{attempt}/{rank}"
    if not store.check([key]):
        return LaunchFailedError(
            f"rank {rank} failed without raising (exit code {code}); see its output above", rank, None, code
        )
    tb = store.get(key).decode()
    last = next((ln for ln in reversed(tb.splitlines()) if ln.strip()), "an exception")
    return LaunchFailedError(
        f"rank {rank} raised {last} (exit code {code}); its traceback is in the worker's output "
        f"above and in LaunchFailedError.traceback",
        rank,
        tb,
        code,
    )


def _worker_main() -> None:
    import traceback

    import cloudpickle

    from .env import lookup, read_worker_env
    from .store import StoreClient

    me = read_worker_env()
    rank, attempt = me.rank, me.restart_count
    port, token = lookup(PORT_VAR), lookup(TOKEN_VAR)
    assert me.store_addr is not None and port is not None and token is not None  # launch() set them
    with StoreClient(me.store_addr, int(port), token=token, timeout=60) as store:
        # every rank: the caller finds the attempt even if rank 0 was stopped before this
        store.set(f"world/{attempt}", str(me.world_size))
        fn, args, kwargs = pickle.loads(store.get("payload"))
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            store.set(f"error/{attempt}/{rank}", traceback.format_exc())
            raise
        store.set(f"result/{attempt}/{rank}", cloudpickle.dumps(result))


if __name__ == "__main__":
    _worker_main()
