"""Head mode: many nodes started from one head (``distlaunch run -H``).

The head hosts the store, has an engine (``engine/``: the one ``head.engine`` names in
the registry, SSH or Slurm) start ``python -m distlaunch agent`` on every other host
(this machine's agent runs in-process over SSH), lets the ``HeadController`` plan each
round, relays output until every agent has ended, and stops or kills what remains when
the job ends. The remote side is ``agent/entry.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .agent.signals import SignalRelay
from .config import LaunchConfig
from .errors import ConfigError, LaunchInterrupted
from .modes import STORE_HOST, HeadOptions
from .report import say
from .startup import resume_gc

if TYPE_CHECKING:  # imported when head mode starts (run_hosts), not with this module
    from .agent.jobspec import PlannedSeat
    from .engine import AgentEngine, AgentLaunch, OnEnd
    from .head_controller import HeadController
    from .hosts import Host
    from .rendezvous import Rendezvous
    from .store import StoreServer


def run_hosts(
    cfg: LaunchConfig,
    head: HeadOptions,
) -> int:
    """Head mode: connect to every host, preflight them, host the store, start one agent
    per host (in-process for this machine), relay output, and return the restarts the
    job took. Blocks. Raises ConfigError (unreachable host, failed preflight: nothing was
    started), WorkerFailedError, LaunchInterrupted, RendezvousError.
    """
    # Only what starting the agents needs is imported before they start: the engine
    # starts them at once (the Slurm engine's step in connect()), the rest loads meanwhile.
    from .engine import plugin
    from .hosts import is_local
    from .rounds import Signal

    hosts = list(head.hosts)
    chosen = plugin(head.engine)
    # Through Slurm every node's agent runs in the agent step, this machine's too (inside
    # the job, under Slurm's accounting and scancel).
    in_process = chosen.local_agent_in_process
    if in_process:  # SSH: paramiko's connections run with the cyclic collector (startup.py)
        resume_gc()
    remote = [k for k, h in enumerate(hosts) if not (in_process and is_local(h))]
    local = [k for k in range(len(hosts)) if k not in remote]
    guard = None
    if local:
        from .agent.guard import OrphanGuard

        guard = OrphanGuard()  # forked before any thread exists
    # Until the agents run, a stop signal ends the head at once (exit 128+N), wherever
    # it waits (SSH connect, preflight, agent start); then the agents' stop path takes over.
    relay: SignalRelay | None
    relay = SignalRelay(lambda: ())
    startup = contextlib.ExitStack()
    startup.enter_context(relay.interruptible())
    server: StoreServer | None = None
    engine: AgentEngine | None = None
    controller: HeadController | None = None
    rdzv: Rendezvous | None = None
    first: dict[int, PlannedSeat] = {}
    try:
        env, launch = agent_launch(head)
        engine = chosen.engine().connect({k: hosts[k] for k in remote}, launch)
        # Only what the agents' specs need before they are sent: an agent waits for its
        # spec, and CPU the head spends meanwhile (the controller, the node agent's
        # modules) is CPU the starting agents lack where they share cores with the head.
        from .agent.jobspec import JobSpec
        from .rendezvous import Rendezvous
        from .store import StoreServer
        from .store.client import StoreAddress

        store_addr = head.store_addr or (engine.store_address() if remote else STORE_HOST)
        if store_addr is None:
            raise ConfigError(
                f"cannot tell which address {hosts[remote[0]].name} reaches this "
                f"machine at (SSH goes through a proxy); give --store-addr"
            )
        token = os.urandom(16).hex()
        server = StoreServer(store_addr, 0, token=token)
        server.start()
        assert server.port is not None  # bound by start()
        store = StoreAddress(store_addr, server.port, token)
        client = StoreAddress(store_addr, server.port, token, server.connect_local).connect(30)
        rdzv = Rendezvous(client, cfg.run_id, 0, len(hosts))

        def node_options(k: int) -> dict[str, Any]:
            """Host ``k``'s NodeOptions as keyword arguments (the agent's spec carries
            them; the agent's defaults fill in the rest)."""
            return dict(
                node_id=k,
                slots=hosts[k].slots,
                host_label=hosts[k].name,
                prefix_host=head.prefix_host,
                devices=hosts[k].devices,
                **cfg.rdzv_options(),
            )

        def kill(k: int) -> None:
            if k in engine.running:
                assert controller is not None  # called by the controller, once it exists
                engine.kill(k, controller.pgids(rdzv, k))

        # Only an engine whose agents all run through it (Slurm's step) is planned: an
        # SSH host is another machine (the local one runs in-process), whose free ports
        # the head cannot see, even through a loopback address that forwards to it.
        first = _first_round(cfg, hosts, engine) if not in_process else {}
        engine.start(
            {
                k: JobSpec(cfg, store, node_options(k), env, engine.master_address(k), first.get(k)).to_dict()
                for k in remote
            }
        )
        # The agents wait for plan 0 (rendezvous.follow_plan), which the controller
        # publishes first thing.
        from .events import EventLog
        from .head_controller import HeadController

        controller = HeadController(
            client.clone(),
            cfg,
            hosts,
            head.min_nodes or len(hosts),
            EventLog(cfg.log_dir, cfg.run_id),
            kill,
        )
        say(f"started agents on {len(hosts)} host(s): " + ", ".join(f"{h.name}:{h.slots}" for h in hosts))
        startup.close()
        relay.restore()
        relay = None
        resume_gc()  # start-up is over (startup.py): from here the head waits for the job

        def ended(k: int, status: int | None) -> None:
            if not rdzv.agent_exited(k):  # ended before the job
                controller.agent_gone(k, status)

        if guard is not None:  # an agent runs here (local)
            import threading

            from .agent.node import NodeAgent, NodeOptions

            pump = threading.Thread(target=lambda: _pump_until_done(engine, ended), daemon=True)
            pump.start()
            try:
                node = NodeOptions(**node_options(local[0]))
                NodeAgent(cfg, store, node, guard, master_addr=store_addr).run()
            finally:
                pump.join(cfg.stop_timeout + 15)
        else:
            _supervise_remote(engine, ended, rdzv, cfg, hosts, controller, kill)
        controller.thread.join(5.0)  # it reports the last round's end
        restarts, cause = rdzv.outcome()
        if cause is not None:
            from .policy import error_for

            raise error_for(cause)
        return restarts
    except LaunchInterrupted as e:
        if relay is not None and engine is not None and engine.running and rdzv is not None:
            # stopped while starting agents: stop those started (before the controller
            # published plan 0 they wait for it: the plan says the job ended)
            rdzv.request_stop(0, Signal(e.signum))
            if controller is None:
                rdzv.publish_plan(0, None)
            # agents of a planned round 0 may still be importing and connecting before
            # they read plan 0 and stop their workers with the grace of --stop-timeout
            end = time.monotonic() + cfg.stop_timeout + (35 if first else 5)
            while engine.running and time.monotonic() < end:
                engine.pump(0.5)
        raise
    finally:
        startup.close()
        if relay is not None:
            relay.restore()
        if controller is not None:
            controller.stop()
        if engine is not None:
            engine.close()
        if server is not None:
            server.stop()
        if guard:
            guard.close()


def _first_round(cfg: LaunchConfig, hosts: list[Host], engine: AgentEngine) -> dict[int, PlannedSeat]:
    """Round 0 planned by the head (host id -> seat), so that each agent starts its
    workers on receiving its spec, before its rendezvous: plan 0 has every host in host
    order, so the ranks are known here; MASTER_PORT is the one node 0's agent would
    choose (``NodeAgent._master_port``: --master-port for a single host, else a port
    free on node 0's machine, which only a head on that machine can choose: free now,
    bound later by rank 0's program). Empty (each agent waits for the rendezvous, as
    before) when node 0's address is not one of this machine's."""
    import socket

    from .agent.jobspec import plan_first_round
    from .env import resolver_name
    from .hosts import slots_of

    addr = engine.master_address(0)
    try:
        family = socket.getaddrinfo(resolver_name(addr), None, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family) as s:
            s.bind((addr, 0))  # fails unless the address is this machine's
        port = cfg.master_port if cfg.master_port and len(hosts) == 1 else 0
        if not port:
            with socket.socket() as s:
                s.bind(("", 0))  # free on every interface, as NodeAgent's free_port
                port = s.getsockname()[1]
    except OSError:  # not resolvable, not an address of this machine, not bindable
        return {}
    return plan_first_round([slots_of(h) for h in hosts], addr, port)


def agent_launch(head: HeadOptions) -> tuple[dict[str, str], AgentLaunch]:
    """The variables shipped to every agent (--env-all) and how the agents start. Every
    shipped value travels inside the spec on the agent's stdin (-x values in cfg.env,
    --env-all in the spec's env); the command line, which the host's ps and audit logs
    show, carries only PYTHONPATH, which the agent's interpreter needs."""
    from . import __version__
    from .engine import AgentLaunch
    from .remote.command import shipped_env

    env = shipped_env(os.environ, [], head.env_all)
    cmd_env = {k: v for k, v in env.items() if k == "PYTHONPATH"}
    python, cwd = head.remote_python or sys.executable, head.remote_cwd or os.getcwd()
    return env, AgentLaunch(python, cwd, cmd_env, __version__, head.ssh)


def _pump_until_done(engine: AgentEngine, on_end: OnEnd) -> None:
    while engine.running:
        engine.pump(1.0, on_end=on_end)


def _supervise_remote(
    engine: AgentEngine,
    on_end: OnEnd,
    rdzv: Rendezvous,
    cfg: LaunchConfig,
    hosts: list[Host],
    controller: HeadController,
    kill: Callable[[int], None],
) -> None:
    """The head's loop when it runs no workers itself: relay output until every agent has
    ended; a stop signal stops every round; agents that do not end within the grace
    period (or at a second Ctrl-C) are killed by their recorded process groups."""
    from .rounds import Signal

    # SIGUSR1/SIGUSR2 sent to the head alone go on to the agents where the engine can
    # (engine.signal_group: Slurm's step; not SSH yet); stop signals stop every round.
    relay = SignalRelay(lambda: [engine], forward_all=True)
    deadline = None
    try:
        while engine.running:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if engine.pump(timeout, [relay.wakeup_fd], on_end):
                relay.drain()
            if relay.stop_signal is not None and deadline is None:
                # the round running and any the controller may still plan
                rdzv.stop_rounds(
                    controller.rnd, controller.policy.max_rounds(len(hosts)), Signal(relay.stop_signal)
                )
                deadline = time.monotonic() + cfg.stop_timeout + 10
            if relay.kill_now or (deadline is not None and time.monotonic() >= deadline):
                for k in engine.running:
                    say(f"agent on {hosts[k].name} did not stop; killing its processes")
                    kill(k)
                    engine.abandon(k)
    finally:
        relay.restore()
