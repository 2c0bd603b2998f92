"""One node's agent: for each rendezvous round, agree on ranks through the store, start
this node's workers, stop them when any node fails, and restart while restarts remain
(torchrun's elastic agent). The agent's phases and their transitions are
``agent/phases.py``, what follows a round is decided by ``policy.py``; this module
executes both.

The same code serves every mode: the single-node launcher and per-node launches run it
in-process; ``distlaunch agent`` runs it on nodes the head started over SSH.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

from ..config import HEARTBEAT_INTERVAL, LaunchConfig
from ..errors import LaunchInterrupted, RendezvousError, StoreError
from ..numa import places_gpus
from ..rendezvous import SLICE, Dropped, Heartbeat, LateJoin, PlanEnded, Rendezvous, StopWatcher, WaitReport
from ..report import say
from ..rounds import Cause, Failure, Join, Lost, Over, Signal, WorkerFailure
from ..topology import WorkerSlot, seat_slots
from ..workerenv import SHM_DIR, shm_prefix
from .group import LaunchSpec, WorkerGroup
from .guard import OrphanGuard, remove_matching, remove_tree
from .kill import with_start_times
from .observer import Observer
from .phases import AgentEvent, AgentPhase, advance, spreads_signal
from .signals import SignalRelay, parse_signals
from .specs import FirstRound, StoreFields, build_specs, free_port, log_root, make_scratch
from .watch import Watchdog, nccl_trace_env

GPU_RELEASE_TIMEOUT = 30.0  # seconds a restart waits for the old workers' GPU memory

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:  # built by the launcher, the head or entry; the store client loads in run()
    from ..events import EventLog
    from ..store.client import StoreAddress


@dataclass(frozen=True, eq=False)  # never compared: no __eq__/__hash__ built at import
class NodeOptions:
    node_rank: int = 0
    num_nodes: int = 1
    slots: int | None = None  # workers on this node (None: --nproc-per-node)
    host_label: str = ""  # shown in --prefix-host prefixes and root-cause summaries
    prefix_host: bool = False
    join_timeout: float = 600.0
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = 15.0
    exit_barrier_timeout: float = 300.0
    last_call_timeout: float = 3.0  # dynamic membership: wait this long for more nodes
    min_nodes: int = 1
    max_nodes: int | None = None  # set: dynamic membership (--nnodes MIN:MAX)
    hosts_store: bool = False  # this process hosts the store: stay until all have left
    node_id: int | None = None  # head mode: membership follows the head's plan per round
    endpoint_note: str = ""  # added to "waiting for the store" lines (e.g. why not hosted here)
    # Local slot ids chosen by --include/--exclude host:0,2 (DeepSpeed): every worker of
    # this node gets them as CUDA_VISIBLE_DEVICES, as DeepSpeed's launcher sets them.
    devices: tuple[int, ...] | None = None
    # The store also serves torch's TCPStore clients: MASTER_PORT is its port (one port
    # per job, as torchrun's per-node launches)
    torch_store: bool = False


class NodeAgent:
    """Runs this node's share of the job until it ends.

    ``run()`` blocks (main thread only: it installs signal handlers) and returns the
    restart count the job needed. Raises WorkerFailedError (root cause attached: the
    first failed worker on any node), LaunchInterrupted (a stop signal, here or on
    another node), RendezvousError (a node or the store was lost, or did not arrive),
    SpawnError, StoreError.

    A stop signal ends every phase: while workers run, they are stopped first (up to
    ``stop_timeout``); while connecting, in rendezvous or at the exit barrier the agent
    stops at once, recording the signal as the round's stop cause so the other nodes
    stop too (the store's host waits briefly for them to read it). Round 0 started early
    (``first``: a single node's, or the head's plan in head mode) has its workers running
    from the start: a stop signal before their group runs reaches them through the relay,
    and the group then stops them as in any round (the grace of ``stop_timeout``); so
    does a head that ends the job before plan 0.
    """

    def __init__(
        self,
        cfg: LaunchConfig,
        store: StoreAddress,
        opts: NodeOptions,
        guard: OrphanGuard,
        base_env: dict[str, str] | None = None,
        master_addr: str | None = None,
        events: EventLog | None = None,
        first: FirstRound | None = None,
    ) -> None:
        """``first``: round 0's workers, already started (``specs.start_first_round``, a
        single node; ``specs.start_planned_round``, head mode); the agent supervises them
        as its first round's, once the rendezvous seated it as they were started (else
        RendezvousError)."""
        self.cfg, self.store_addr, self.opts = cfg, store, opts
        self.events = events  # events.EventLog, or None (a remote agent: the head reports)
        self.guard = guard
        # Agents in head mode say nothing of rounds: the head reports them once.
        self.say: Callable[[str], None] = say if opts.node_id is None else _quiet
        self.base_env = dict(os.environ) if base_env is None else base_env
        if opts.devices is not None:
            self.base_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, opts.devices))
        self.master_addr = master_addr or cfg.master_addr or "localhost"
        self.scratch: str | None = None
        self.log_root = log_root(cfg)
        self._first = first  # cleared once its group runs
        self._lost: set[int] = set()  # nodes found lost in the last round
        # Where the agent is (agent/phases.py): it starts between rounds; a stop signal
        # that ends a phase in which no workers run is spread to the round by this agent
        # (phases.spreads_signal)
        self.phase = AgentPhase.AFTER_ROUND
        self._left: int | None = None  # the last round this node left at its end
        self._last_pids: list[int] = []  # the last round's workers (for the GPU release wait)

    def run(self) -> int:
        o = self.opts
        group: WorkerGroup | None = None
        if self._first is not None:  # its relay forwards to its workers since their spawn
            group, relay = self._first.group, self._first.group.relay
            relay.targets = lambda: group.live() if group else ()
            self.scratch = self._first.scratch
        else:
            relay = SignalRelay(
                lambda: group.live() if group else (), also_stop=parse_signals(self.cfg.signals_to_handle)
            )
            self.scratch = make_scratch(self.cfg, self.guard)
        rdzv = client = observer = None
        rnd, restarts = 0, 0  # rounds also change with membership; restarts only on failure
        cause = None
        try:
            # Blocking rendezvous calls carry their own timeouts; every other call must
            # not outwait a store that stopped answering by much.
            with self._interruptible(relay):
                try:
                    client = self.store_addr.connect(60.0, o.join_timeout, self._connect_report())
                except StoreError as e:  # never reached: not "lost"
                    raise RendezvousError(str(e)) from e
            rdzv = Rendezvous(
                client, self.cfg.run_id, o.node_rank, o.num_nodes, o.join_timeout, on_wait=self.say
            )
            observer = self._observer(lambda: (group, restarts))
            while True:
                if o.node_id is not None:  # head mode: the head decides each round
                    try:
                        with self._interruptible(relay):
                            restarts = rdzv.follow_plan(rnd, o.node_id)
                    except PlanEnded:
                        # after a round that stopped, or before round 0: the head was
                        # stopped while starting the agents (it recorded the signal)
                        cause = cause or rdzv.stop_cause(rnd)
                        if cause is None:
                            raise
                        if self._first is not None:  # head-planned round 0: stop its workers
                            first, self._first = self._first.group, None
                            first.stop(cause.signum if isinstance(cause, Signal) else signal.SIGTERM)
                        raise _error_for(cause) from None
                    except Dropped:
                        return restarts
                try:
                    group, restarts = self._make_group(rdzv, rnd, restarts, relay)
                except LateJoin as late:
                    self._to(AgentEvent.LATE)  # not a member yet: leaving stops nobody
                    with self._interruptible(relay):
                        self._wait_for_next_round(rdzv, late)
                    rnd += 1
                    continue
                cause = self._run_round(rdzv, group, rnd, relay)
                if self.events is not None:
                    from ..events import round_end_event

                    self.events.emit(round_end_event(rnd, cause))
                if cause is None:
                    return restarts
                if o.node_id is None:
                    restarts = self._next_round(rdzv, cause, rnd, restarts)
                elif isinstance(cause, Signal):  # else the head's plan says what follows
                    raise _error_for(cause)
                rnd += 1
        except LaunchInterrupted as e:
            if spreads_signal(self.phase) and rdzv is not None:  # such phases come after rdzv
                self._spread_signal(rdzv, rnd, self.phase, e.signum, relay)
            raise
        except StoreError as e:  # the agent's own calls: the store died or stopped answering
            raise RendezvousError(
                f"lost the store at {self.store_addr.host}:{self.store_addr.port} ({e}); workers stopped"
            ) from e
        finally:
            self._to(AgentEvent.END)  # however it ends
            if o.hosts_store and rdzv is not None and rdzv.num_nodes > 1 and self._left == rnd:
                self._let_others_leave(rdzv, rnd, relay)
            if self._first is not None:  # never supervised: stop its workers now
                self._first.group.close()
            relay.restore()
            if observer is not None:
                observer.stop()
            if client is not None:
                client.close()
            remove_tree(self.scratch)

    def _interruptible(self, relay: SignalRelay) -> contextlib.AbstractContextManager[None]:
        """``relay.interruptible()``, except while round 0's early workers wait for their
        group to run: a stopping signal has reached them through the relay, and the agent
        goes on to the round (whose stop cause the signal becomes, so every node stops),
        where their group stops them with the grace of --stop-timeout."""
        return contextlib.nullcontext() if self._first is not None else relay.interruptible()

    def _observer(self, group: Callable[[], tuple[WorkerGroup | None, int]]) -> Observer:
        """Publishes this node's records for `distlaunch top` and answers `stacks`."""
        o = self.opts
        node = o.host_label or socket.gethostname()
        if o.num_nodes > 1 or o.max_nodes or o.node_id is not None:  # one name per agent
            node += f":{o.node_rank if o.node_id is None else o.node_id}"
        observer = Observer(self.cfg.run_id, self.store_addr, node, group)
        observer.start()
        return observer

    def _connect_report(self) -> Callable[[str, float], None]:
        """The store client's retry callback: says what is wrong with the store's endpoint
        after 2 s, then at growing intervals (never silent for ``join_timeout``)."""
        progress, a = WaitReport(2.0), self.store_addr
        note = f"; {self.opts.endpoint_note}" if self.opts.endpoint_note else ""

        def report(problem: str, waited: float) -> None:
            if progress.due() is not None:
                self.say(
                    f"waiting for the store at {a.host}:{a.port} ({waited:.0f} s of "
                    f"{self.opts.join_timeout:g} s): {problem}{note}"
                )

        return report

    def _to(self, event: AgentEvent) -> None:
        self.phase = advance(self.phase, event)

    def _spread_signal(
        self, rdzv: Rendezvous, rnd: int, phase: AgentPhase, signum: int, relay: SignalRelay
    ) -> None:
        """A stop signal (here, or recorded by another node) ended ``phase`` of round
        ``rnd`` (one where no workers run: joining, admitted, the barrier): record it as
        the round's stop cause (and the next round's, in case another cause stood first
        and the others restart) so every node stops, leave the round, and, on the store's
        host, give the others a moment to read it. Best effort, bounded: a fresh
        connection (an interrupted call closed the agent's own)."""
        try:
            with self.store_addr.connect(2.0, connect_timeout=1.0) as c:
                r = Rendezvous(c, self.cfg.run_id, rdzv.node_rank, rdzv.num_nodes)
                for k in (rnd, rnd + 1):
                    r.request_stop(k, Signal(signum))
                r.leave(rnd)
                if self.opts.hosts_store:
                    if phase is not AgentPhase.BARRIER:  # joining: the others see it at their next slice
                        count, grace = r.arrived(rnd), 2 * SLICE + 1.0
                    else:  # the others stop their workers first
                        count = rdzv.num_nodes - len(self._lost)
                        grace = self.cfg.stop_timeout + 5.0
                    r.wait_left(rnd, count, grace, abort=lambda: relay.kill_now)
        except StoreError:
            pass  # the store is gone: nobody is left to tell

    def _make_group(
        self, rdzv: Rendezvous, rnd: int, restarts: int, relay: SignalRelay
    ) -> tuple[WorkerGroup, int]:
        """Join round ``rnd`` and prepare this node's workers; returns the group and the
        job's restart count (node 0's, which a late joiner does not know)."""
        o = self.opts
        me = (o.slots or self.cfg.nproc_per_node, o.host_label or socket.gethostname(), self.master_addr)
        self._to(AgentEvent.NEXT)
        with self._interruptible(relay):
            if o.max_nodes:  # dynamic membership: node ranks by arrival, every round anew
                seat = rdzv.join_dynamic(rnd, o.min_nodes, o.max_nodes, o.last_call_timeout, *me)
            else:
                seat = rdzv.join(rnd, *me)
            self._to(AgentEvent.SEATED)
            if rdzv.node_rank == 0:
                rdzv.publish_master(rnd, self.master_addr, self._master_port(rdzv), restarts)
            addr, port, restarts = rdzv.master(rnd)
            if self.events is not None:  # (events: not imported by an agent the head reports for)
                from ..events import round_event

                # node 0 lists the members (one read of them all); the others count them,
                # so a round costs no node O(N) bytes but one
                members = rdzv.members(rnd, self.opts.join_timeout) if rdzv.node_rank == 0 else None
                self.events.emit(round_event(rnd, restarts, members, rdzv.num_nodes, seat.world_size))
        slots = seat_slots(seat.first_rank, me[0], rdzv.node_rank, seat.world_size, rdzv.num_nodes)
        if self._last_pids and places_gpus(self.cfg):  # a restart: the old attempt's GPU memory
            from ..devices import wait_gpu_release  # (GPU discovery: only here)

            wait_gpu_release(self._last_pids, GPU_RELEASE_TIMEOUT, self.say)

        def started(pids: list[int]) -> None:
            self._last_pids = list(pids)
            rdzv.publish_pgids(rnd, with_start_times([os.getpid(), *pids]))

        def failed(f: WorkerFailure) -> None:
            rdzv.request_stop(rnd, Failure(self._labelled(f)))

        if self._first is not None:  # started before: the seat planned for this node
            group = self._first.group
            env = group.specs[0].env
            if [s.slot for s in group.specs] != slots or (env["MASTER_ADDR"], int(env["MASTER_PORT"])) != (
                addr,
                port,
            ):  # the head's plan and the rendezvous agree by construction: a bug if not
                raise RendezvousError(
                    f"round {rnd}: this node's workers were started as ranks "
                    f"{[s.slot.rank for s in group.specs]} with MASTER_ADDR {env['MASTER_ADDR']}:"
                    f"{env['MASTER_PORT']}, but the rendezvous seats it as ranks "
                    f"{[s.rank for s in slots]} with {addr}:{port}"
                )
            group.on_failure = failed
            started([w.pid for w in group.workers])
        else:
            group = WorkerGroup(
                self._specs(slots, rnd, (addr, port), restarts),
                relay,
                self.guard,
                self.cfg.stop_timeout,
                on_started=started,
                on_failure=failed,
            )
        group.watchdog = self._watchdog(group.specs, restarts, rdzv.num_nodes > 1)
        return group, restarts

    def _watchdog(self, specs: list[LaunchSpec], restarts: int, several: bool) -> Watchdog:
        """One round's progress readers (`distlaunch top` shows the operations in flight
        through them), with --hang-timeout and --stacks-on-failure when they are on."""
        from .. import progress

        cfg = self.cfg
        report = os.path.join(self.log_root, f"attempt_{restarts}", "stacks.txt") if self.log_root else None
        records = {s.slot.rank: s.env[progress.ENV] for s in specs if progress.ENV in s.env}
        note = nccl_trace_env(self.base_env, self.log_root)[1] if cfg.hang_timeout > 0 else ""
        return Watchdog(cfg.hang_timeout, records, cfg.stacks_on_failure, report, note, several)

    def _next_round(self, rdzv: Rendezvous, cause: Cause, rnd: int, restarts: int) -> int:
        """After round ``rnd`` stopped for ``cause``: return the restart count of the next
        round, or raise when the job ends here (the policy decides)."""
        # Only after a round that did not succeed: not on a job's start-up path.
        from ..policy import DynamicMembership, End, FixedSize, History

        o = self.opts
        policy = (
            DynamicMembership(self.cfg.max_restarts, o.min_nodes)
            if o.max_nodes
            else FixedSize(self.cfg.max_restarts, o.heartbeat_timeout)
        )
        decision = policy.decide(History(rnd, restarts, rdzv.num_nodes, frozenset(self._lost)), cause)
        if isinstance(decision, End):
            assert decision.error is not None  # set by every per-node policy
            raise decision.error
        self.say(decision.note)
        return decision.restarts

    def _wait_for_next_round(self, rdzv: Rendezvous, late: LateJoin) -> None:
        """A late node: ask the running members to start a new round that includes it,
        and wait until they have all left the current one."""
        cause = rdzv.request_stop(late.rnd, Join())
        if isinstance(cause, Over):
            raise RendezvousError("the job finished before this node could join")
        rdzv.wait_members_done(late.rnd, late.size, self.opts.exit_barrier_timeout + self.cfg.stop_timeout)

    def _labelled(self, f: WorkerFailure) -> WorkerFailure:
        return dataclasses.replace(f, host=self.opts.host_label) if self.opts.host_label else f

    def _master_port(self, rdzv: Rendezvous) -> int:
        # --master-port is the program's port in single-node mode; in a per-node static
        # launch it is the store's, which serves torch's TCPStore clients too (torchrun);
        # otherwise the program gets a fresh free port.
        if self._first is not None:
            return self._first.master_port
        if self.opts.torch_store:
            return self.store_addr.port
        if self.cfg.master_port and rdzv.num_nodes == 1 and not self.opts.max_nodes:
            return self.cfg.master_port
        return free_port()

    def _run_round(self, rdzv: Rendezvous, group: WorkerGroup, rnd: int, relay: SignalRelay) -> Cause | None:
        """Run one round to its end; return the cause that stopped it (None: success)."""
        import threading

        o = self.opts
        wake_r, wake_w = os.pipe()
        why = []
        closing = threading.Lock()  # the watcher may wake after the pipe is closed

        def wake(reason: str) -> None:
            why.append(reason)
            with closing:
                if wake_w >= 0:
                    os.write(wake_w, b"x")

        # A store we were just talking to accepts at once; one that does not is gone.
        def store_lost() -> None:
            wake("lost")
            rdzv.store.close()  # wakes its calls

        heartbeat = None
        if rdzv.num_nodes > 1:
            heartbeat = Heartbeat(
                rdzv.store.clone(connect_timeout=5.0),
                rdzv,
                rnd,
                o.heartbeat_interval,
                o.heartbeat_timeout,
                lambda k, secs: rdzv.request_stop(rnd, Lost(k, f"no heartbeat for {secs:.0f} s")),
                store_lost,
            )
        watcher = StopWatcher(rdzv.store.clone(connect_timeout=5.0), rdzv, rnd, wake)
        group.stop_fd = wake_r
        group.stop_signal = lambda: signal.SIGTERM if why[0] == "lost" else self._signal_for(rdzv, rnd)
        try:
            with self._interruptible(relay):  # a signal since joining: do not start workers
                pass
            self._to(AgentEvent.STARTED)  # from here the group relays signals to the workers
            self._first = None  # its group runs (and ends with its workers gone)
            try:
                result = group.run()
            finally:  # every worker of the round is gone: so are their segments' users
                remove_matching(os.path.join(SHM_DIR, shm_prefix(self.cfg.run_id, os.getpid(), rnd) + "*"))
            self._to(AgentEvent.STOPPED)
            if result.stop_signal is not None:
                relay.acted()
                self._stop_everyone(rdzv, rnd, Signal(result.stop_signal))
            if why and why[0] == "lost":
                raise RendezvousError(
                    f"lost the store at {self.store_addr.host}:"
                    f"{self.store_addr.port} (its host stopped, or it stopped "
                    f"answering); workers stopped"
                )
            if relay.kill_now and result.stop_signal is not None:  # a second Ctrl-C: no exit barrier
                raise LaunchInterrupted(result.stop_signal)
            # the nodes found lost: by this node's heartbeat, or by another's (the ring)
            lost = (lambda: heartbeat.lost | rdzv.lost_nodes(rnd)) if heartbeat else set
            # Every round ends at the exit barrier, so no node leaves (or, on node 0, takes
            # the store down) while another still needs it. A (further) stop signal here
            # leaves it at once: the workers are gone already.
            self._to(AgentEvent.AT_BARRIER)
            with self._interruptible(relay):
                cause = rdzv.finish(
                    rnd,
                    self.opts.exit_barrier_timeout + self.cfg.stop_timeout,
                    lost,
                    abort=lambda: bool(why) and why[0] == "lost",
                )
            self._to(AgentEvent.PASSED)
            self._lost = set(lost())
            watcher.thread.join(5.0)  # finish() set the stop key, which releases it
        finally:
            with closing:
                os.close(wake_w)
                wake_w = -1
            os.close(wake_r)
            if heartbeat:
                heartbeat.stop()
            watcher.client.close()
        rdzv.leave(rnd)
        self._left = rnd
        if result.stop_signal is not None:
            cause = Signal(result.stop_signal)
        return cause

    def _let_others_leave(self, rdzv: Rendezvous, rnd: int, relay: SignalRelay) -> None:
        """The store's host keeps it up until every node has read how the job ended (at
        most 10 s; a new stop signal or a second Ctrl-C ends the wait)."""
        try:
            rdzv.wait_left(
                rnd,
                rdzv.num_nodes - len(self._lost),
                10.0,
                abort=lambda: relay.pending is not None or relay.kill_now,
            )
        except StoreError:
            pass

    def _signal_for(self, rdzv: Rendezvous, rnd: int) -> int:
        """A job stopped by a signal passes that signal on; anything else is SIGTERM."""
        try:
            cause = rdzv.stop_cause(rnd)
        except StoreError:
            return signal.SIGTERM
        return cause.signum if isinstance(cause, Signal) else signal.SIGTERM

    def _stop_everyone(self, rdzv: Rendezvous, rnd: int, cause: Cause) -> None:
        try:
            rdzv.request_stop(rnd, cause)
        except Exception:  # the store may be gone; stopping here matters more
            pass

    def _specs(
        self, slots: list[WorkerSlot], rnd: int, master: tuple[str, int], restarts: int
    ) -> list[LaunchSpec]:
        a, o = self.store_addr, self.opts
        assert self.scratch is not None  # made by run()
        return build_specs(
            self.cfg,
            slots,
            rnd,
            master,
            restarts,
            StoreFields(a.host, a.port, a.token),
            self.base_env,
            self.scratch,
            host_label=o.host_label,
            prefix_host=o.prefix_host,
            agent_store=o.torch_store,
        )


def _quiet(_msg: str) -> None:
    pass


def _error_for(cause: Cause) -> Exception:
    from ..policy import error_for  # only when the job ends with an error

    return error_for(cause)
