"""Head mode: many nodes started from one head over SSH (``distlaunch run -H``).

The head connects to every host and checks it (preflight), hosts the store, starts
``python -m distlaunch agent`` on each host (this machine's agent runs in-process),
relays their output, decides each rendezvous round (``_HeadController``), and stops or
kills what remains when the job ends. ``run_agent`` is the remote side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from .agent.guard import OrphanGuard
from .agent.node import NodeAgent, NodeOptions, StoreAddress, raise_for_cause
from .agent.signals import SignalRelay
from .config import LaunchConfig
from .errors import ConfigError, DistlaunchError, LaunchInterrupted
from .launcher import STORE_HOST


@dataclass(frozen=True)
class HeadOptions:
    """What only head mode (-H / --hostfile) needs."""

    hosts: tuple  # hosts.Host, slots resolved, in node-rank order
    ssh: object  # remote.ssh.SSHOptions
    store_addr: str | None = None
    remote_python: str | None = None
    remote_cwd: str | None = None
    env_all: bool = False
    prefix_host: bool = False
    min_nodes: int | None = None  # drop failing/lost hosts while this many remain


class _RemoteAgents:
    """The agents the head started over SSH: relays their output (already prefixed by the
    agent) as whole lines, and notices agents that end without finishing the job."""

    def __init__(self, procs: dict, on_lost):
        from .agent.output import StreamSink

        self.procs = procs  # node_rank -> RemoteProcess
        self.sinks = {k: (StreamSink(b"", 1, None, False), StreamSink(b"", 2, None, True))
                      for k in procs}
        self.status: dict[int, int] = {}
        self.on_lost = on_lost

    @property
    def running(self) -> list[int]:
        return [k for k in self.procs if k not in self.status]

    def pump(self, timeout: float | None, extra_fds=()) -> list[int]:
        """Wait up to ``timeout`` s for output or exits; returns the ready ``extra_fds``."""
        import select

        poller = select.poll()  # not select(): fds above 1024 with many hosts
        draining = []  # exited, output not closed yet: their fd stays readable, so look
        for k in self.running:  # again shortly instead of spinning on it
            proc = self.procs[k]
            if proc.exited():
                draining.append(k)
            else:
                poller.register(proc.fileno(), select.POLLIN)
        for fd in extra_fds:
            poller.register(fd, select.POLLIN)
        if draining:
            timeout = 0.05 if timeout is None else min(timeout, 0.05)
        ready = {fd for fd, _ in poller.poll(None if timeout is None else timeout * 1000)}
        for k in self.running:
            proc = self.procs[k]
            if k not in draining and proc.fileno() not in ready:
                continue
            out, err = self.sinks[k]
            out.feed(proc.read_stdout())
            err.feed(proc.read_stderr())
            if proc.exited() and proc.eof():
                out.close()
                err.close()
                self.status[k] = proc.exit_status()
                self.on_lost(k, self.status[k])
        return [fd for fd in extra_fds if fd in ready]


def _outcome(client, run_id: str) -> tuple[int, dict | None]:
    """(restart count, cause) of the last round the agents started; cause None means
    success. Head-mode membership is static, so rounds and restarts coincide."""
    rnd, last = 0, {"kind": "lost", "node": 0, "why": "no agent joined the job"}
    while client.check([f"{run_id}/r{rnd}/stop"]):
        cause = json.loads(client.get(f"{run_id}/r{rnd}/stop"))
        last = None if cause["kind"] == "over" else cause
        rnd += 1
    return max(rnd - 1, 0), last


class _HeadController:
    """Head mode, on its own thread and store connection: shows the start-up status
    ("starting W workers on N hosts: k/W ready" through ``on_progress(text, final)``),
    reports each round and its end (events), and plans each next round, as Horovod's
    elastic mode does: after a worker failure, the same hosts with the restart count + 1
    while restarts remain; a host whose agent was lost, or whose workers failed in two
    consecutive rounds, is dropped while at least ``min_nodes`` hosts remain (a drop for
    a lost agent is no restart). Otherwise the job ends.

    ``agent_gone(id, status)`` (any thread): an agent ended before the job; its round is
    stopped and its part of the round's barriers is filled in, so the others go on.
    """

    def __init__(self, client, cfg: LaunchConfig, hosts: list, min_nodes: int, events,
                 on_progress, kill: Callable[[int], None]):
        import queue
        import threading

        from .rendezvous import Rendezvous

        self.client, self.cfg, self.hosts, self.min_nodes = client, cfg, hosts, min_nodes
        self.events, self.on_progress, self.kill = events, on_progress, kill
        self.rdzv = Rendezvous(client, cfg.run_id, 0, len(hosts))
        self.rnd = 0
        self.plans = {0: (list(range(len(hosts))), 0)}  # round -> (member ids, restarts)
        self.rdzv.publish_plan(0, *self.plans[0])
        self.dead: set[int] = set()
        self.streak = (None, 0)  # (host id, consecutive rounds its workers failed)
        self._gone = queue.SimpleQueue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="head-controller", daemon=True)
        self.thread.start()

    def agent_gone(self, node_id: int, status) -> None:
        self._gone.put((node_id, status))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(2.0)

    def _wait(self, key: str) -> bool:
        from .errors import StoreTimeoutError

        while not self._stop.is_set():
            self._handle_gone()
            try:
                self.client.wait([key], timeout=0.1)
                return True
            except StoreTimeoutError:
                pass
        return False

    def _handle_gone(self) -> None:
        import queue

        while True:
            try:
                node_id, status = self._gone.get_nowait()
            except queue.Empty:
                return
            self.dead.add(node_id)
            members = self.plans[self.rnd][0]
            if node_id in members:
                rank, r = members.index(node_id), self.rdzv
                r.request_stop(self.rnd, {"kind": "lost", "node": rank, "why": (
                    f"agent on {self.hosts[node_id].name} ended with status {status}")})
                h = self.hosts[node_id]
                self.client.compare_set(r.key(self.rnd, f"node/{rank}"), b"", json.dumps(
                    {"slots": h.slots, "host": h.name, "addr": ""}))
                self.client.set(r.key(self.rnd, f"done/{rank}"), b"1")

    def _startup(self) -> None:
        total = sum(h.slots for h in self.hosts)
        ready: set[int] = set()
        while not self._stop.is_set():
            ready |= {k for k in range(len(self.hosts)) if k not in ready
                      and self.client.check([self.rdzv.key(0, f"pgids/{k}")])}
            done = len(ready) == len(self.hosts)
            self.on_progress(f"starting {total} workers on {len(self.hosts)} hosts: "
                             f"{sum(self.hosts[k].slots for k in ready)}/{total} ready", done)
            if done:
                return
            self._stop.wait(0.1)
            self._handle_gone()

    def _run(self) -> None:
        from .agent.node import round_event

        r = self.rdzv
        try:
            if self.on_progress:
                self._startup()
            while self._wait(r.key(self.rnd, "master")):
                members = self.plans[self.rnd][0]
                r.num_nodes = len(members)
                _, _, restarts = r.master(self.rnd)
                self.events.emit(round_event(self.rnd, restarts, r.members(self.rnd, 30.0)))
                if not self._wait(r.key(self.rnd, "stop")):
                    return
                cause = r.stop_cause(self.rnd)
                cause = None if cause["kind"] == "over" else cause
                self.events.emit({"event": "round_end", "round": self.rnd, "cause": cause})
                if cause is None:
                    return
                plan = self._plan_after(cause)
                r.publish_plan(self.rnd + 1, *(plan or (None,)))
                if plan is None:
                    return
                self.rnd += 1
                self.plans[self.rnd] = plan
        except DistlaunchError:
            pass  # the store went away: the job is over
        finally:
            self.client.close()

    def _plan_after(self, cause: dict) -> tuple[list[int], int] | None:
        members, restarts = self.plans[self.rnd]
        drop = set(self.dead)
        if cause["kind"] == "failure":
            if restarts >= self.cfg.max_restarts:
                return None
            restarts += 1
            bad = members[cause["failure"]["node_rank"]]
            self.streak = (bad, self.streak[1] + 1 if self.streak[0] == bad else 1)
            if self.streak[1] >= 2 and len(members) - 1 >= self.min_nodes:
                drop.add(bad)
                self._drop(bad, f"its workers failed in {self.streak[1]} consecutive rounds")
        elif cause["kind"] == "lost":
            lost = members[cause["node"]]
            drop.add(lost)
            self.dead.add(lost)
            self.kill(lost)  # it may still run (e.g. stopped, or cut off from the store)
            self._drop(lost, cause["why"])
        else:  # a stop signal
            return None
        left = [m for m in members if m not in drop]
        if len(left) < self.min_nodes:
            self.events.emit({"event": "end", "why": f"{len(left)} host(s) left, fewer than "
                              f"--min-nodes {self.min_nodes}"})
            return None
        return left, restarts

    def _drop(self, node_id: int, why: str) -> None:
        self.events.emit({"event": "drop", "host": self.hosts[node_id].name, "why": why})

    def pgids(self, client, node_id: int) -> list[tuple[int, int]]:
        """The agent pid and worker process groups a host recorded most recently, as
        validated ``(pid, start time)`` records (agent.kill); [] when none is valid."""
        from .agent.kill import parse_records

        for rnd in range(self.rnd, -1, -1):
            members = self.plans.get(rnd, ([], 0))[0]
            key = self.rdzv.key(rnd, f"pgids/{members.index(node_id)}") if node_id in members else None
            if key and client.check([key]):
                try:
                    return parse_records(client.get(key))
                except ValueError:
                    return []  # malformed or hostile: act on nothing
        return []


def run_hosts(cfg: LaunchConfig, head: HeadOptions, on_event: Callable[[str], None],
              on_progress: Callable[[str, bool], None] | None = None) -> int:
    """Head mode: connect to every host, preflight them, host the store, start one agent
    per host (in-process for this machine), relay output, and return the restarts the
    job took. Blocks. Raises ConfigError (unreachable host, failed preflight: nothing was
    started), WorkerFailedError, LaunchInterrupted, RendezvousError.
    """
    from . import __version__
    from .hosts import is_local
    from .remote import RemoteError
    from .remote.command import remote_command, shipped_env
    from .remote.preflight import preflight
    from .remote.ssh import connect_all
    from .store import StoreClient, StoreServer

    hosts = list(head.hosts)
    remote = [k for k, h in enumerate(hosts) if not is_local(h)]
    local = [k for k, h in enumerate(hosts) if is_local(h)]
    guard = OrphanGuard() if local else None  # forked before any thread exists
    # Until the agents run, a stop signal ends the head at once (exit 128+N), wherever
    # it waits (SSH connect, preflight, agent start); then the agents' stop path takes over.
    relay: SignalRelay | None = SignalRelay(lambda: ())
    startup = contextlib.ExitStack()
    startup.enter_context(relay.interruptible())
    server = agents = controller = None
    conns: dict = {}
    procs: dict = {}
    try:
        if on_progress:
            on_progress(f"connecting to {len(remote)} host(s)", False)
        try:
            conns = dict(zip(remote, connect_all([hosts[k] for k in remote], head.ssh)))
        except RemoteError as e:
            raise ConfigError(str(e).replace("\n", "; ")) from e
        python = head.remote_python or sys.executable
        cwd = head.remote_cwd or os.getcwd()
        if on_progress:
            on_progress(f"checking {len(conns)} host(s)", False)
        reports = preflight(list(conns.values()), python, cwd, __version__)
        for r in reports:
            on_event(f"preflight {r.host.name}: {'ok' if r.ok else r.problem}")
        bad = [r for r in reports if not r.ok]
        if bad:
            raise ConfigError(f"preflight failed on {len(bad)} of {len(reports)} host(s) "
                              f"({', '.join(r.host.name for r in bad)}); nothing was started")
        store_addr = head.store_addr or (conns[remote[0]].local_address if remote else STORE_HOST)
        if store_addr is None:
            raise ConfigError(f"cannot tell which address {hosts[remote[0]].name} reaches this "
                              f"machine at (SSH goes through a proxy); give --store-addr")
        token = os.urandom(16).hex()
        server = StoreServer(store_addr, 0, token=token)
        server.start()
        store = StoreAddress(store_addr, server.port, token)
        # Every shipped value travels inside the spec on SSH stdin (-x values in cfg.env,
        # --env-all in spec["env"]); the command line, which the host's ps and audit logs
        # show, carries only PYTHONPATH, which the agent's interpreter needs to start.
        env = shipped_env(os.environ, [], head.env_all)
        cmd_env = {k: v for k, v in env.items() if k == "PYTHONPATH"}
        client = StoreClient(store_addr, server.port, token=token, timeout=30)

        def node_options(k: int) -> NodeOptions:
            return NodeOptions(node_id=k, slots=hosts[k].slots, host_label=hosts[k].name,
                               prefix_host=head.prefix_host, **cfg.rdzv_options())

        def kill(k: int) -> None:
            records = controller.pgids(client, k) if k in conns and agents is not None \
                and k in agents.running else []
            if records:
                _kill_remote(conns[k], kill_command(python, cwd, cmd_env, records))

        from .events import EventLog
        controller = _HeadController(client.clone(), cfg, hosts, head.min_nodes or len(hosts),
                                     EventLog(cfg.log_dir, cfg.run_id, on_event), on_progress, kill)
        for k in remote:
            spec = {"config": cfg.to_dict(), "store": [store_addr, server.port], "token": token,
                    "node": dataclasses.asdict(node_options(k)), "env": env,
                    "master_addr": conns[k].peer_address}  # MASTER_ADDR if it is node 0
            cmd = remote_command(python, cwd, ["-m", "distlaunch", "agent"], cmd_env)
            procs[k] = conns[k].exec(cmd, stdin_data=(json.dumps(spec) + "\n").encode())
        on_event(f"started agents on {len(hosts)} host(s): "
                 + ", ".join(f"{h.name}:{h.slots}" for h in hosts))
        startup.close()
        relay.restore()
        relay = None

        def lost(k: int, status: int | None) -> None:
            if not client.check([f"{cfg.run_id}/agent_exit/{k}"]):  # ended before the job
                controller.agent_gone(k, status)

        agents = _RemoteAgents(procs, lost)
        if local:
            import threading

            relay = threading.Thread(target=lambda: _pump_until_done(agents), daemon=True)
            relay.start()
            try:
                NodeAgent(cfg, store, node_options(local[0]), guard, _quiet,
                          master_addr=store_addr).run()
            finally:
                relay.join(cfg.stop_timeout + 15)
        else:
            _supervise_remote(agents, client, cfg, conns, controller, on_event, kill)
        controller.thread.join(5.0)  # it reports the last round's end
        rnd, cause = _outcome(client, cfg.run_id)
        if cause is not None:
            raise_for_cause(cause)
        return rnd
    except LaunchInterrupted as e:
        if relay is not None and procs:  # stopped while starting agents: stop those started
            controller.rdzv.request_stop(0, {"kind": "signal", "signum": e.signum})
            agents = _RemoteAgents(procs, lambda k, status: None)
            end = time.monotonic() + cfg.stop_timeout + 5
            while agents.running and time.monotonic() < end:
                agents.pump(0.5)
        raise
    finally:
        startup.close()
        if relay is not None:
            relay.restore()
        if controller is not None:
            controller.stop()
        if agents is not None:
            for p in agents.procs.values():
                p.close()
        for c in conns.values():
            c.close()
        if server is not None:
            server.stop()
        if guard:
            guard.close()


def _pump_until_done(agents: _RemoteAgents) -> None:
    while agents.running:
        agents.pump(1.0)


def _supervise_remote(agents: _RemoteAgents, client, cfg: LaunchConfig, conns: dict,
                      controller: _HeadController, on_event: Callable[[str], None],
                      kill: Callable[[int], None]) -> None:
    """The head's loop when it runs no workers itself: relay output until every agent has
    ended; a stop signal stops every round; agents that do not end within the grace
    period (or at a second Ctrl-C) are killed over SSH by their recorded process groups."""
    relay = SignalRelay(lambda: ())
    deadline = None
    try:
        while agents.running:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if agents.pump(timeout, [relay.wakeup_fd]):
                relay.drain()
            if relay.stop_signal is not None and deadline is None:
                cause = json.dumps({"kind": "signal", "signum": relay.stop_signal})
                for rnd in range(controller.rnd, cfg.max_restarts + len(conns) + 2):
                    client.compare_set(f"{cfg.run_id}/r{rnd}/stop", b"", cause)
                deadline = time.monotonic() + cfg.stop_timeout + 10
            if relay.kill_now or (deadline is not None and time.monotonic() >= deadline):
                for k in agents.running:
                    on_event(f"agent on {conns[k].host.name} did not stop; killing its processes")
                    kill(k)
                    agents.procs[k].close()
                    agents.status[k] = -1
    finally:
        relay.restore()


def kill_command(python: str, cwd: str, env: dict[str, str], records: list[tuple[int, int]]) -> str:
    """The command that kills a host's recorded processes (``agent.kill``; ``records``
    validated by ``parse_records``), run like the agent: same interpreter, directory and
    command-line environment. Pure."""
    from .remote.command import remote_command

    return remote_command(python, cwd, ["-m", "distlaunch.agent.kill",
                                        *(f"{p}:{t}" for p, t in records)], env)


def _kill_remote(conn, cmd: str) -> None:
    """Run ``cmd`` (``python -m distlaunch.agent.kill``: SIGKILL an agent's recorded
    processes) on ``conn``'s host, over a fresh SSH connection if that one is broken."""
    from .remote import RemoteError
    from .remote.ssh import SSHConnection

    try:
        conn.run(cmd, timeout=10)
    except RemoteError:
        try:
            with SSHConnection(conn.host, conn.opts) as fresh:
                fresh.run(cmd, timeout=10)
        except RemoteError:
            pass  # the host is unreachable: nothing more can be done from here


def _quiet(_msg: str) -> None:
    """Agents in head mode say nothing of rounds: the head reports them once."""


def run_agent(spec: dict) -> int:
    """`distlaunch agent`: one node's agent, started by the head over SSH with ``spec``
    (JSON, read from stdin: it holds the store's secret). Returns the restarts taken;
    raises as NodeAgent.run. Records its end in the store so the head can tell a
    finished agent from a lost one."""
    from .store import StoreClient

    cfg = LaunchConfig.from_dict(spec["config"])
    os.environ.update(spec.get("env", {}))  # --env-all: the agent and its workers inherit them
    host, port = spec["store"]
    store = StoreAddress(host, port, spec["token"])
    guard = OrphanGuard()
    try:
        return NodeAgent(cfg, store, NodeOptions(**spec["node"]), guard, _quiet,
                         master_addr=spec["master_addr"]).run()
    finally:
        guard.close()
        try:
            # short: when the head (and its store) is gone, nobody is left to tell
            with StoreClient(host, port, token=store.token, timeout=5, connect_timeout=0.5) as c:
                c.set(f"{cfg.run_id}/agent_exit/{spec['node']['node_id']}", b"1")
        except Exception:  # the store is gone; the head (if alive) sees the channel close
            pass
