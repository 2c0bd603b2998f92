"""``distlaunch agent``: the entry point of an agent an engine started on another machine
(``engine/``), with its job spec as one JSON line on stdin.

The agent first prints ``AGENT_HELLO <version>`` (remote.command), before its own
imports (they run while the head waits for the other hosts), and only then reads the
spec: the head's start-up check (remote.preflight.start_checked) needs no interpreter of
its own, and an agent whose head found a problem on any host reads end-of-file and ends
without starting anything. ``python -m distlaunch agent`` comes here without the
CLI's imports (``__main__``).

The line is one node's ``jobspec.JobSpec`` (``JobSpec.to_dict``), or a message of the
engine that started the agent, naming it (``{"engine": NAME, ...}``: Slurm's one line
for every node), from which the engine's plug-in picks this node's spec.

Under Slurm, before the spec, only what starting workers needs is imported: the fast
lane's spawn (``agent/lane.py``: ``os.posix_spawn``, the orphan guard, the signal relay,
``workerenv``; no dataclasses, ``socket`` or ``subprocess``). A spec with the head's
plan of round 0 (``first``: this node's seat and MASTER_PORT) has its workers started
from its dict at once (``_spawn_planned``), with the orphan guard watching them and the
signal relay in place from the first spawn; the configuration, the store client, the
rendezvous, the observer and the node agent load while their interpreters start, the
agent takes them over as its own (``specs.adopt_first_round``, which checks each was
started as it would start it) and joins round 0 with them (as the single-node
launcher's first round, ``launcher._run_single``).
"""

from __future__ import annotations

import json
import os
import sys

from .. import AGENT_HELLO, __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~3 ms before a spawn)
if TYPE_CHECKING:
    from typing import Any, NoReturn

    from ..store.client import StoreAddress
    from .guard import OrphanGuard
    from .jobspec import JobSpec
    from .lane import Started
    from .signals import SignalRelay
    from .specs import FirstRound


def run_agent(spec: dict[str, Any]) -> int:
    """Run one node's agent for ``spec`` (a JobSpec as a dict; it holds the store's
    secret). Returns the restarts taken; raises as NodeAgent.run (and ConfigError,
    SpawnError, LaunchInterrupted as ``specs.start_planned_round`` when round 0 was
    planned by the head). Records its end in the store so the head can tell a finished
    agent from a lost one; not when its planned workers could not start: it never
    joined round 0, and the head, seeing it end unrecorded, stops the round for the
    others (``HeadController.agent_gone``) instead of their waiting out the rendezvous.

    A head-planned round 0 whose workers the fast lane's spawn can start
    (``_spawn_planned``) has them started from the spec's dict, before the
    configuration, the store client and the agent's own modules are loaded (their
    dataclasses and typing are most of an agent's start), and taken over once they are
    (``specs.adopt_first_round``, which checks each was started exactly so)."""
    from ..startup import resume_gc
    from .guard import OrphanGuard
    from .jobspec import JobSpec
    from .signals import SignalRelay, parse_signals

    os.environ.update(spec.get("env", {}))  # --env-all: the agent and its workers inherit them
    base_env = dict(os.environ)
    devices = spec["node"].get("devices")
    if devices is not None:  # as NodeAgent sets it for its rounds
        base_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    guard = OrphanGuard()  # before any thread
    relay = first = early = job = None
    ran = False
    try:
        if spec.get("first") is not None:  # the head planned round 0: its workers start now
            relay = SignalRelay(lambda: (), also_stop=parse_signals(spec["config"]["signals_to_handle"]))
            early = _spawn_planned(spec, base_env, guard, relay)
        job = JobSpec.from_dict(spec)
        cfg, store = job.config, job.store
        if early is not None:
            first = _adopt_planned(job, early)
            early = None  # (its workers are the group's now)
        elif relay is not None:
            first = _start_planned(job, base_env, guard, relay)
        from .node import NodeAgent, NodeOptions

        agent = NodeAgent(cfg, store, NodeOptions(**job.node), guard, base_env, job.master_addr, first=first)
        first, ran = None, True  # the agent's now: its run() ends them
        resume_gc()  # start-up is over (main paused the collector); run() may wait long
        return agent.run()
    finally:
        if first is not None:  # the agent never got to run them: stop them now
            first.discard()
        elif early is not None:  # never taken over (a bug found by adopt_first_round)
            early.abandon()
        if relay is not None:
            relay.restore()
        guard.close()
        if ran and job is not None:
            _record_exit(job.config.run_id, job.store, job.node["node_id"])


# LaunchConfig's fields (as ``to_dict`` has them) under which ``specs.build_specs`` starts
# a worker as the fast lane's spawn does (``python SCRIPT ARGS``, the environment of
# ``workerenv.slot_env`` alone, ``--bind-to``'s CPUs without devices, stdin for rank 0);
# with no --signals-to-handle or --hang-timeout (--env is applied as worker_env does),
# the rest changes only what the agent builds at the take-over (sinks, log files, watchdog).
_LANE_CONFIG = {
    "no_python": False,
    "module": False,
    "run_path": False,
    "gpus_per_rank": None,
    "virtual_local_rank": False,
    "numa_binding": None,
    "stdin": "0",
}


def _spawn_planned(
    spec: dict[str, Any], base_env: dict[str, str], guard: OrphanGuard, relay: SignalRelay
) -> Started | None:
    """Round 0's workers of a head-planned ``spec`` (a dict) started by the fast lane's
    spawn (``lane.spawn``: guard watching, ``relay`` forwarding from each spawn,
    scratch directory the guard's to clean up), or None where its configuration starts
    them otherwise (``_LANE_CONFIG``) or the lane cannot (no absolute interpreter, no
    pidfd, no usable temporary directory, a posix_spawn without setsid): then nothing
    was started and ``specs.start_planned_round`` starts them.
    Raises LaunchInterrupted (a stop signal before the first spawn) or SpawnError, with
    nothing left running."""
    from ..workerenv import make_scratch
    from .guard import remove_tree
    from .lane import Started, seat_slots, spawn, usable_python

    cfg, node, seat = spec["config"], spec["node"], spec["first"]
    python = usable_python()
    if (
        any(cfg.get(k) != v for k, v in _LANE_CONFIG.items())
        or cfg.get("signals_to_handle")  # (worker_env: --signals-to-handle, --hang-timeout)
        or cfg.get("hang_timeout", 0) > 0
        or python is None
    ):
        return None
    e = Started(cfg["run_id"], guard, relay, base_env)
    e.master_port = seat["master_port"]
    try:
        e.scratch = make_scratch(e.run_id, guard)
    except OSError:  # specs.make_scratch raises it, as before
        return None
    try:  # (from here a malformed spec leaves no scratch directory behind: abandon)
        count = node.get("slots") or cfg["nproc_per_node"]  # as NodeAgent counts them
        slots = seat_slots(
            seat["first_rank"], count, seat["node_rank"], seat["world_size"], seat["num_nodes"]
        )
        host, port = spec["store"]
        spawn(
            e,
            slots,
            [python, cfg["entrypoint"], *cfg["args"]],
            cfg,
            (seat["master_addr"], seat["master_port"]),
            (host, port, spec["token"]),
            {**base_env, **dict(cfg["env"])},  # (specs.worker_env's; the head passes PYTHONPATH)
        )
    except NotImplementedError:  # posix_spawn without setsid (an old libc): nothing started
        remove_tree(e.scratch)
        return None
    except BaseException:
        e.abandon()
        raise
    return e


def _adopt_planned(job: JobSpec, early: Started) -> FirstRound:
    """``_spawn_planned``'s workers of ``job`` taken over (``specs.adopt_first_round``)."""
    from .specs import StoreFields, adopt_first_round

    assert job.first is not None
    node, store = job.node, job.store
    count = node.get("slots") or job.config.nproc_per_node
    return adopt_first_round(
        job.config,
        job.first.slots(count),
        job.first.master_addr,
        StoreFields(store.host, store.port, store.token),
        early,
        host_label=node.get("host_label", ""),
        prefix_host=node.get("prefix_host", False),
    )


def _start_planned(
    job: JobSpec, base_env: dict[str, str], guard: OrphanGuard, relay: SignalRelay
) -> FirstRound:
    """Round 0's workers of ``job`` from the head's plan (``specs.start_planned_round``)."""
    from .specs import StoreFields, start_planned_round

    assert job.first is not None
    node, store = job.node, job.store
    count = node.get("slots") or job.config.nproc_per_node  # as NodeAgent counts them
    return start_planned_round(
        job.config,
        job.first,
        count,
        StoreFields(store.host, store.port, store.token),
        guard,
        relay,
        base_env,
        host_label=node.get("host_label", ""),
        prefix_host=node.get("prefix_host", False),
    )


def _record_exit(run_id: str, store: StoreAddress, node_id: int) -> None:
    """Record this agent's end in the store (the head tells a finished agent from a lost
    one by it). Short and best effort: when the head (and its store) is gone, nobody is
    left to tell; the head, if alive, sees the channel close."""
    try:
        from ..rendezvous import Rendezvous

        with store.connect(5, connect_timeout=0.5) as c:
            Rendezvous(c, run_id, 0, 1).record_agent_exit(node_id)
    except Exception:
        pass


def _engine_spec(message: dict[str, Any]) -> dict[str, Any]:
    """This node's spec out of an engine's own message (``EnginePlugin.agent_spec``).
    Slurm's, the one engine that sends one line for every node, is picked without the
    engine registry and the Slurm engine's imports (``remote.srun.select_spec``, which
    the plug-in's ``agent_spec`` is). Raises ConfigError."""
    if message["engine"] == "slurm":
        from ..remote.srun import select_spec

        return select_spec(message)
    from ..engine import plugin

    return plugin(message["engine"]).agent_spec(message, os.environ)


def main() -> NoReturn:
    """``python -m distlaunch agent``: say hello, read the spec, run; exits with the
    workers' failure or stop signal code (the head reports those), a DistlaunchError's
    code (said here), or 0 when stdin ends before a spec (the head started nothing)."""
    print(AGENT_HELLO, __version__, flush=True)
    # Without the cyclic collector until the node agent runs (startup.py: the imports
    # and set-up make next to no cycles, yet some 25 collections, ~4 ms of CPU here).
    from ..startup import pause_gc

    pause_gc()
    # the imports run while the head waits for the other hosts' hellos (SSH) or starts
    # up (Slurm); the version in the hello matched, so only a broken install fails here.
    # Under Slurm only what starting workers needs (specs): the rest loads once a
    # head-planned round 0's workers are starting.
    try:
        from ..errors import DistlaunchError, LaunchInterrupted, WorkerFailedError
        from ..report import say

        if "SLURM_STEP_ID" in os.environ:  # the Slurm engine's one line for every node
            from ..remote import srun  # noqa: F401  (its select_spec picks this node's spec)
            from . import lane  # noqa: F401  (its spawn starts a head-planned round 0)
        else:  # SSH: the head sends specs once every host said hello; the node agent loads meanwhile
            from ..store.client import StoreAddress  # noqa: F401  (the spec's store)
            from . import node, specs  # noqa: F401
    except ImportError as e:
        print(f"distlaunch agent: cannot start here: {e} (reinstall distlaunch)", file=sys.stderr)
        os._exit(1)

    line = sys.stdin.readline()
    code = 0
    if line:
        try:
            spec = json.loads(line)
            if "engine" in spec:  # an engine's own message (Slurm: one line for every node)
                spec = _engine_spec(spec)
            run_agent(spec)
        except (WorkerFailedError, LaunchInterrupted) as e:
            code = e.exit_code
        except DistlaunchError as e:
            say(f"error: {e}")
            code = e.exit_code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the CLI: every process of this node ended; skip the teardown
