"""The agent's publisher for ``distlaunch top`` and ``stacks``: a thread that, once a
second, samples this node's workers (psutil: CPU %, RSS), adds each rank's last output
line and operation in flight (distlaunch.progress) and publishes the records under
``<run id>/observe`` in the job's store (observe/records.py); and answers stack
requests: ``distlaunch stacks`` increments ``<prefix>/stacks_req`` to N and sets
``<prefix>/stacks_req/<N>``, which each agent waits for between publishes (a store
``wait``, so the answer comes at once); it sets ``<prefix>/stacks/<node>/<N>`` to its
ranks' stacks (JSON, ``observe.stacks.encode_stacks``).

It also keeps this agent's entry in the per-user job registry (observe/registry.py) so
viewers on this host find the job. The thread has its own store connection, so it never
competes with the agent's rendezvous calls; a store that is gone ends the
thread quietly (the agent sees it too and reports it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from ..errors import StoreError, StoreTimeoutError
from ..observe import registry
from .output import warn_once

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:
    from ..observe.records import Publisher, Sampler
    from ..store.client import StoreAddress, StoreClient
    from .group import WorkerGroup

INTERVAL = 1.0  # seconds between publishes


def prefix(run_id: str) -> str:
    return f"{run_id}/observe"


class Observer:
    """Runs the publishing thread while the agent runs (``start``/``stop``)."""

    def __init__(
        self,
        run_id: str,
        store: StoreAddress,
        node: str,
        group: Callable[[], tuple[WorkerGroup | None, int]],
    ) -> None:
        """``group()``: the round's worker group (None between rounds) and the restart count."""
        self.run_id, self.store_addr, self.node, self.group = run_id, store, node, group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distlaunch-observer", daemon=True)
        self._sampler: Sampler | None = None  # at the first publish (psutil: not at start-up)
        self._client: StoreClient | None = None
        self._world = 0
        self._started = time.time()

    def start(self) -> None:
        self._write_entry()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (it finishes its current publish: at most a store call's
        timeout) and remove the registry entry. Never raises."""
        self._stop.set()
        client = self._client
        if client is not None:
            client.close()  # wakes its wait
        if self._thread.is_alive():
            self._thread.join(10.0)
        registry.remove_entry(self.run_id, os.getpid())

    def _write_entry(self) -> None:
        a = self.store_addr
        try:
            registry.write_entry(
                registry.JobEntry(
                    self.run_id,
                    os.getpid(),
                    time.time(),
                    socket.gethostname(),
                    self._world,
                    a.host,
                    a.port,
                    a.token,
                )
            )
        except OSError:
            pass  # no registry: viewers need the run's store given another way

    def _run(self) -> None:
        req = f"{prefix(self.run_id)}/stacks_req"
        try:
            with self.store_addr.connect(10.0, connect_timeout=5.0) as client:
                self._client = client
                if self._stop.is_set():
                    return
                pub: Publisher | None = None  # made at the first publish, a second in
                seen = client.add(req, 0)  # requests before this agent started are not its own
                due = time.monotonic() + INTERVAL
                while not self._stop.is_set():
                    # the wait for the next request is the pause between publishes: a
                    # request is answered at once, not at the next publish
                    try:
                        client.wait([f"{req}/{seen + 1}"], max(0.01, due - time.monotonic()))
                    except StoreTimeoutError:
                        # a viewer that died between its add and its set would block the
                        # next requests: skip to the latest count
                        seen = max(seen, client.add(req, 0) - 1)
                        if pub is None:
                            from ..observe.records import Publisher

                            pub = Publisher(client, prefix(self.run_id), self.node)
                        self._safely(self._publish, client, pub)
                        due = time.monotonic() + INTERVAL
                        continue
                    seen += 1
                    self._safely(self._answer, client, seen, client.get(f"{req}/{seen}") == b"native")
        except StoreError:
            pass  # stopped (stop() closed the client), or the store is gone: the agent reports it

    @staticmethod
    def _safely(fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)``; anything but the store's errors is said once and the thread goes
        on (an unexpected error must not end `top` and `stacks` for the rest of the job)."""
        try:
            fn(*args)
        except StoreError:
            raise
        except Exception as e:
            warn_once("observer", f"distlaunch top/stacks: {type(e).__name__}: {e}")

    def _answer(self, client: StoreClient, n: int, native: bool) -> None:
        from ..observe.stacks import RankStack, StackError, dump_stacks, encode_stacks  # on a request only

        group, _ = self.group()
        pids = {w.slot.rank: w.pid for w in list(group.workers) if w.returncode is None} if group else {}
        try:
            stacks: dict[int, RankStack | StackError] = dump_stacks(pids, native=native) if pids else {}
        except FileNotFoundError as e:  # no py-spy: the viewer says why for each rank
            stacks = {r: StackError(r, p, str(e)) for r, p in pids.items()}
        ops = group.watchdog.ops() if group and group.watchdog else {}
        client.set(f"{prefix(self.run_id)}/stacks/{self.node}/{n}", encode_stacks(stacks, ops))

    def _publish(self, client: StoreClient, pub: Publisher) -> None:
        from ..observe.records import RankRecord, Sampler

        if self._sampler is None:
            self._sampler = Sampler()
        group, restarts = self.group()
        if group is None:
            return
        workers = list(group.workers)  # appended by the agent's thread while spawning
        pids = {w.slot.rank: w.pid for w in workers if w.returncode is None}
        if workers and workers[0].slot.world_size != self._world:
            self._world = workers[0].slot.world_size
            self._write_entry()
        samples = self._sampler.sample(pids)
        flying = group.watchdog.in_flight() if group.watchdog else {}
        now = time.monotonic()
        records = []
        for w, spec in zip(workers, group.specs):
            rc = w.returncode
            state = "running" if rc is None else f"exited {rc}"
            if restarts:
                state += f" (restarted {restarts}x)"
            s = samples.get(w.slot.rank)
            line, at = spec.stdout.last_line()
            eline, eat = spec.stderr.last_line()
            if eat is not None and (at is None or eat > at):
                line, at = eline, eat
            op, op_age = flying.get(w.slot.rank, (None, None))
            records.append(
                RankRecord(
                    w.slot.rank,
                    self.node,
                    w.pid,
                    state,
                    s.cpu if s else 0.0,
                    s.rss if s else 0,
                    None if at is None else now - at,
                    line,
                    op,
                    op_age,
                    _devices(spec.env),
                )
            )
        pub.publish(records)


def _devices(env: Mapping[str, str]) -> str:
    """The GPUs a worker sees, as its environment names them (``CUDA_VISIBLE_DEVICES=3``;
    placed by --gpus-per-rank / --virtual-local-rank, or the user's own); "" when none."""
    from ..devices import VISIBILITY_VARS  # at a publish, a second in: not at start-up

    return next((f"{v}={env[v]}" for v in VISIBILITY_VARS if v in env), "")
