"""The launcher of one node: plans its part of a resolved single-node or per-node launch
(``modes.py``), hosts the store where the mode says (single node; node 0 of a static
launch; the launcher that binds a dynamic endpoint), runs this node's agent and returns
the result. Head mode (-H) is in ``head.py``.

Start-up order matters: the orphan guard is forked before the store's thread starts
(forking a threaded process is unsafe). A single node starts its workers before anything
they do not need is imported or built (``_run_single``): the guard, the signal relay and
the store's listening socket come first, the store's loop, the agent (rendezvous,
observer, events) and the progress readers while the workers' interpreters start.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .agent.guard import OrphanGuard
from .agent.specs import StoreFields, worker_argv, worker_env
from .config import LaunchConfig
from .env import lookup, route_source
from .errors import ConfigError
from .modes import STORE_HOST, DynamicNodes, NodeMode, SingleNode, StaticNodes
from .numa import rank_bindings
from .report import say
from .topology import WorkerSlot, node_slots
from .workerenv import omp_notice

if TYPE_CHECKING:
    from .agent.specs import FirstRound
    from .events import EventLog
    from .quick import Early
    from .store import StoreServer
    from .store.client import StoreAddress

__all__ = ["Plan", "make_plan", "run", "STORE_HOST"]


@dataclass(frozen=True, eq=False)  # never compared: no __eq__/__hash__ built at import
class Plan:
    """The resolved job as far as it is known before start: this node's workers."""

    mode: NodeMode
    slots: list[WorkerSlot]
    argv: list[str]
    master_addr: str
    master_port: int | None  # None: a free port, chosen at start (by node 0)

    @property
    def cfg(self) -> LaunchConfig:
        return self.mode.job

    def worker_env(self, slot: WorkerSlot) -> dict[str, str]:
        """The environment a worker will get (store fields filled in at start; MASTER_PORT
        is 0 where ``master_port`` is None)."""
        master = (self.master_addr, self.master_port or 0)
        return worker_env(
            self.cfg, slot, os.environ, 0, master, None, agent_store=isinstance(self.mode, StaticNodes)
        )


def _check_port_free(port: int, option: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{option} {port} is already in use on this node; "
                    f"choose another port or omit it to pick a free one"
                ) from None
            raise ConfigError(f"{option} {port} cannot be bound ({e.strerror})") from None


def make_plan(mode: NodeMode) -> Plan:
    """Resolve this node's ranks and the worker command line. Raises ConfigError when
    ``--master-port`` is taken on the node that must bind it."""
    cfg = mode.job
    if cfg.master_port is not None and mode.node_rank == 0:
        _check_port_free(cfg.master_port, "--master-port")
    slots = node_slots([cfg.nproc_per_node] * mode.nnodes, mode.node_rank)
    # this node's GPUs and CPUs, checked before anything starts (the agent decides them again)
    rank_bindings(cfg, len(slots), os.environ, os.sched_getaffinity(0))
    # as NodeAgent._master_port will choose it: a static launch's store (torchrun's one
    # port per job), a single node's --master-port, else a free port at start
    port = mode.store_endpoint()[1] if isinstance(mode, StaticNodes) else None
    if isinstance(mode, SingleNode):
        port = cfg.master_port
    return Plan(mode, slots, worker_argv(cfg), cfg.master_addr or "localhost", port)


def run(mode: NodeMode, plan: Plan | None = None) -> int:
    """Run this node's part of the job to the end; return the restarts it took.

    Single node: host the store on loopback and run the agent. Static per-node launch:
    node 0 hosts the store on ``--master-port`` for all nodes; every node runs its agent
    against it. Dynamic: see ``_run_dynamic``. Blocks. Raises WorkerFailedError,
    LaunchInterrupted, RendezvousError, SpawnError, StoreError, ConfigError.
    """
    plan = plan or make_plan(mode)
    cfg = mode.job
    if (cfg.redirects.any or cfg.tee.any) and not cfg.log_dir:
        import tempfile

        log_dir = tempfile.mkdtemp(prefix=f"distlaunch_{cfg.run_id}_")
        say(f"worker logs go to {log_dir}/{cfg.run_id}")
        cfg = dataclasses.replace(cfg, log_dir=log_dir)
    early = _early()
    if cfg.nproc_per_node > 1 and lookup("OMP_NUM_THREADS") is None and early is None:  # (it said so)
        say(omp_notice(cfg.nproc_per_node))
    if isinstance(mode, DynamicNodes):
        return _run_dynamic(mode, cfg)
    if isinstance(mode, StaticNodes):
        from .store.client import StoreAddress

        store = StoreAddress(*mode.store_endpoint(), _shared_token(cfg, mode.store_token_file))
        return _run_fixed(cfg, mode, store, "0.0.0.0", plan)
    assert isinstance(mode, SingleNode)
    return _run_single(cfg, mode, plan, early)


def _early() -> Early | None:
    """The fast lane's start (``quick.py``) in this process, not yet taken over, if any."""
    quick = sys.modules.get("distlaunch.quick")
    return quick.early if quick is not None else None


def _run_single(cfg: LaunchConfig, mode: SingleNode, plan: Plan, early: Early | None = None) -> int:
    """A single node: its workers start first (``specs.start_first_round``) with the
    guard watching them and the signal relay in place from the first spawn; the store
    they are told of listens already (its loop starts next: their connections wait in
    the listen backlog), and the agent joins round 0 with them. ``early``: the fast
    lane started all that already (``quick.py``): taken over here."""
    from .agent.signals import SignalRelay, parse_signals
    from .agent.specs import adopt_first_round, start_first_round

    if early is not None:
        guard, relay = early.guard, early.relay
    else:
        guard = OrphanGuard()  # before any thread
        relay = SignalRelay(lambda: (), also_stop=parse_signals(cfg.signals_to_handle))
    listener = server = first = None
    try:
        if early is not None:
            listener, token = socket.socket(fileno=early.take_listener()), early.token
            fields = StoreFields(STORE_HOST, listener.getsockname()[1], token)
            first = adopt_first_round(cfg, plan.slots, plan.master_addr, fields, early)
            early.taken()
        else:
            listener = _listen(STORE_HOST)
            token = os.urandom(16).hex()
            fields = StoreFields(STORE_HOST, listener.getsockname()[1], token)
            first = start_first_round(cfg, plan.slots, plan.master_addr, fields, guard, relay)
        from .store import StoreServer

        server = StoreServer(STORE_HOST, fields.port, token=token).start(listener)
        listener = None  # the server's now
        return _run_agent(cfg, mode, server, fields, plan, guard, first)
    finally:
        if first is not None:  # stopped with grace unless the agent ran them (then a no-op)
            first.discard()
        elif early is not None:  # never taken over (a bug found by adopt_first_round)
            early.abandon()
        relay.restore()
        if listener is not None:
            listener.close()
        if server is not None:
            server.stop()
        guard.close(wait=1.0)  # the process ends next (command.leave): not held by a stopped guard


def _listen(host: str) -> socket.socket:
    """The store's listening socket on ``host``, any free port (as ``StoreServer.start``
    binds it)."""
    return socket.create_server((host, 0), backlog=4096)


def _run_agent(
    cfg: LaunchConfig,
    mode: SingleNode | StaticNodes,
    server: StoreServer | None,
    store: StoreFields | StoreAddress,
    plan: Plan,
    guard: OrphanGuard,
    first: FirstRound | None = None,
) -> int:
    """Run this node's agent against ``store`` (hosted by ``server`` here when not None)."""
    from .agent.node import NodeAgent, NodeOptions
    from .store.client import StoreAddress

    torch_store = isinstance(mode, StaticNodes)  # one port per job, as torchrun
    port = server.port if server is not None and server.port is not None else store.port
    address = StoreAddress(store.host, port, store.token, server.connect_local if server else None)
    agent = NodeAgent(
        cfg,
        address,
        NodeOptions(
            node_rank=mode.node_rank,
            num_nodes=mode.nnodes,
            hosts_store=server is not None,
            torch_store=torch_store,
            **cfg.rdzv_options(),
        ),
        guard,
        master_addr=plan.master_addr,
        events=_event_log(cfg),
        first=first,
    )
    return agent.run()


def _run_fixed(cfg: LaunchConfig, mode: StaticNodes, store: StoreAddress, bind: str, plan: Plan) -> int:
    """A fixed set of nodes whose node 0 hosts the store at ``store`` (bound on ``bind``)."""
    from .store import StoreServer  # not needed by --dry-run

    guard = OrphanGuard()
    server = None
    try:
        if mode.node_rank == 0:
            server = StoreServer(bind, store.port, token=store.token, torch_clients=True)
            server.start()
        return _run_agent(cfg, mode, server, store, plan, guard)
    finally:
        if server is not None:
            server.stop()
        guard.close()


def _event_log(cfg: LaunchConfig) -> EventLog:
    """Round lines on the console (not the trivial first round of a one-node job) and
    every event in <log-dir>/<run-id>/events.jsonl."""
    from .events import EventLog

    return EventLog(
        cfg.log_dir,
        cfg.run_id,
        lambda e: e["event"] == "round" and (e["round"] > 0 or e["nodes"] > 1),
    )


def _shared_token(cfg: LaunchConfig, token_file: str | None) -> str:
    # Per-node launches share no channel for a secret: each node reads the same one
    # (secret.py: the environment, a token file, or the per-user secret file).
    from .secret import shared_token

    return shared_token(cfg.run_id, token_file)


def _run_dynamic(mode: DynamicNodes, cfg: LaunchConfig) -> int:
    """Per-node launch with dynamic membership through the store at the endpoint; the
    launcher that can bind that address hosts the store (torchrun's c10d backend)."""
    from .agent.node import NodeAgent, NodeOptions
    from .errors import StoreError
    from .store import StoreServer
    from .store.client import StoreAddress

    host, port = mode.host, mode.port
    token = _shared_token(cfg, mode.store_token_file)
    guard = OrphanGuard()
    server = None
    note = ""
    try:
        if mode.is_host is False:
            note = "--rdzv-conf is_host=false: another launcher or `distlaunch store` hosts it"
        else:
            try:
                server = StoreServer(host, port, token=token)
                server.start()
                assert server.port is not None  # bound by start()
                port = server.port  # port 0: the free port it bound
            except StoreError as e:  # already hosted (or not an address of this machine)
                if mode.is_host or port == 0:
                    raise ConfigError(f"cannot host the rendezvous store at {mode.endpoint}: {e}") from None
                server = None
                # said only if reaching the store there takes long (normally another
                # launcher hosts it and this is no news)
                note = f"this launcher could not host the store there either ({e})"
        opts = NodeOptions(
            min_nodes=mode.nnodes,
            max_nodes=mode.max_nodes,
            hosts_store=server is not None,
            endpoint_note=note,
            **cfg.rdzv_options(),
        )
        agent = NodeAgent(
            cfg,
            StoreAddress(host, port, token, server.connect_local if server is not None else None),
            opts,
            guard,
            master_addr=mode.local_addr or route_source(host) or socket.gethostname(),
            events=_event_log(cfg),
        )
        return agent.run()
    finally:
        if server is not None:
            server.stop()
        guard.close()
