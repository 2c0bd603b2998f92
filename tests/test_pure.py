"""Unit tests of the pure parts: topology, config parsing, the environment contract."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distlaunch.config import (
    LaunchConfig,
    StdSpec,
    parse_nproc_per_node,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std,
)
from distlaunch.env import MPI_VARS, TORCHRUN_VARS, WorkerIdentity, build_worker_env, read_worker_env
from distlaunch.errors import ConfigError
from distlaunch.topology import assign_ranks, cpu_sets, format_cpus


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_ranks_contiguous_per_node(slots):
    nodes = assign_ranks(slots)
    flat = [w for node in nodes for w in node]
    assert [w.rank for w in flat] == list(range(sum(slots)))
    for k, node in enumerate(nodes):
        assert [w.local_rank for w in node] == list(range(slots[k]))
        assert {(w.node_rank, w.local_world_size, w.world_size, w.num_nodes) for w in node} == {
            (k, slots[k], sum(slots), len(slots))
        }


@given(st.sets(st.integers(0, 63), min_size=1, max_size=16), st.integers(1, 24))
def test_cpu_sets(cpus, n):
    auto, core, none = (cpu_sets(m, n, cpus) for m in ("auto", "core", "none"))
    assert none == [None] * n
    # core: one CPU each, every CPU used before any is reused
    assert all(len(c) == 1 and c <= cpus for c in core)
    assert len(set().union(*core)) == min(n, len(cpus))
    if n == 1:
        assert auto == [None]  # a lone worker keeps the launcher's affinity
    elif n >= len(cpus):
        assert auto == core
    else:  # disjoint, non-empty, covering every CPU, sizes within one of each other
        assert sum(len(c) for c in auto) == len(cpus) and set().union(*auto) == cpus
        assert min(map(len, auto)) >= 1 and max(map(len, auto)) - min(map(len, auto)) <= 1
        assert [min(c) for c in auto] == sorted(min(c) for c in auto)  # local rank order


def test_cpu_sets_rejects_unknown_mode_and_formats_lists():
    with pytest.raises(ValueError):
        cpu_sets("socket", 2, {0, 1})
    assert format_cpus(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert format_cpus(frozenset({3})) == "3" and format_cpus(None) == "all"


@pytest.mark.parametrize("bad", [[], [2, 0]])
def test_ranks_reject_empty_nodes(bad):
    with pytest.raises(ValueError):
        assign_ranks(bad)


def test_std_specs():
    assert parse_std("3", "--tee") == StdSpec(3)
    spec = parse_std("0:1,2:3", "--redirects")
    assert [spec.for_rank(r) for r in range(4)] == [1, 0, 3, 0]
    for bad in ("4", "a", "0:9", "1:"):
        with pytest.raises(ConfigError, match="--redirects"):
            parse_std(bad, "--redirects")


def test_nproc_and_filters():
    import os

    assert parse_nproc_per_node("cpu") == os.cpu_count()
    assert parse_nproc_per_node(" 7 ") == 7
    with pytest.raises(ConfigError, match="no GPU"):
        parse_nproc_per_node("gpu")
    assert parse_ranks_filter("0,2") == frozenset({0, 2})
    with pytest.raises(ConfigError):
        parse_ranks_filter("x")
    assert parse_rdzv_conf("join_timeout=5, heartbeat_timeout=2") == (
        ("join_timeout", "5"),
        ("heartbeat_timeout", "2"),
    )
    with pytest.raises(ConfigError, match="unknown"):
        LaunchConfig(__file__, rdzv_conf=(("bogus", "1"),)).validate()
    with pytest.raises(ConfigError, match="positive"):
        LaunchConfig(__file__, rdzv_conf=(("join_timeout", "-1"),)).validate()


def test_config_json_round_trip():
    c = LaunchConfig(
        __file__,
        ("--a", "b"),
        nproc_per_node=3,
        redirects=parse_std("0:1,1:3", "r"),
        local_ranks_filter=frozenset({1, 2}),
        rdzv_conf=parse_rdzv_conf("join_timeout=5"),
        bind_to="core",
    )
    assert LaunchConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_worker_env_round_trip_and_stale_names():
    ident = WorkerIdentity(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        num_nodes=2,
        node_id="1",
        run_id="abc",
        restart_count=2,
        max_restarts=3,
        master_addr="h0",
        master_port=1234,
        store_addr="h0",
        store_port=99,
        store_token="t",
    )
    base = {"PATH": "/bin", "SLURM_PROCID": "3", "PMIX_RANK": "1", "PMI_FD": "4", "RANK": "0"}
    env = build_worker_env(ident, base, error_file="/tmp/e.json", set_omp_threads=True)
    assert set(TORCHRUN_VARS) <= set(env) and set(MPI_VARS) <= set(env)
    assert not {"SLURM_PROCID", "PMIX_RANK", "PMI_FD"} & set(env)
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"
    assert all(env[m] == env[src] for m, src in MPI_VARS.items())
    assert read_worker_env(env) == ident


def test_read_worker_env_errors():
    with pytest.raises(ConfigError, match="RANK"):
        read_worker_env({})
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        read_worker_env({"RANK": "0", "WORLD_SIZE": "x"})
    with pytest.raises(ConfigError, match="outside"):
        read_worker_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_srun_and_mpiexec_derive_disjoint_store_ports():
    """A Slurm step and an mpiexec job on one node, neither given MASTER_PORT, never
    derive the same store port (they shared 20000-31999: a Slurm step's rank 0 found its
    port held by an mpiexec job's store in a parallel test run)."""
    from distlaunch.env import scheduler_identity

    def slurm_port(job, step):
        env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_PROCID": "0"}
        env.update(SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_STEP_NODELIST="n1")
        env.update(SLURM_STEP_TASKS_PER_NODE="1", SLURM_NTASKS="1")
        ident = scheduler_identity(env)
        assert ident is not None and ident.source == "slurm"
        return ident.store_port

    slurm = {slurm_port(job, step) for job in range(0, 1200, 7) for step in range(16)}
    mpi = scheduler_identity({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert mpi is not None and mpi.source == "mpi"
    assert max(slurm) < mpi.store_port < 32768 and min(slurm) >= 20000


def _typed_fields(module, name: str) -> list[str]:
    """The annotated fields of class ``name`` in ``module``'s source, in order (the type
    checker's copy, defined under TYPE_CHECKING and never run)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]


def test_rdzv_keys_are_node_options_fields():
    """--rdzv-conf's keys (config.RDZV_KEYS) are the type checker's RdzvOptions keys, each
    a NodeOptions field, which the head passes on by name."""
    import dataclasses

    from distlaunch import config
    from distlaunch.agent.node import NodeOptions

    assert config.RDZV_KEYS == set(_typed_fields(config, "RdzvOptions"))
    assert config.RDZV_KEYS <= {f.name for f in dataclasses.fields(NodeOptions)}


def test_records_without_typing_match_the_type_checkers():
    """The job spec's and the store fields' records are collections' namedtuples at run
    time and typing's NamedTuples for the type checker (an agent loads no typing): both
    copies name the same fields in the same order (review finding: a field added to one
    alone would pass mypy and break at run time)."""
    from distlaunch.agent import jobspec, specs

    assert list(jobspec._Seat._fields) == _typed_fields(jobspec, "_Seat")
    assert list(jobspec._Job._fields) == _typed_fields(jobspec, "_Job")
    assert jobspec._Job._field_defaults == {"first": None}
    assert list(specs.StoreFields._fields) == _typed_fields(specs, "StoreFields")


def test_a_slurm_agents_modules_load_no_typing():
    """What a Slurm agent imports (its entry, the fast lane, the job spec, the
    configuration, the store client, the worker group, the node agent) loads no typing
    (~4 ms of its CPU), in a fresh interpreter without site (whose .pth files may)."""
    import os
    import subprocess
    import sys

    modules = (
        "distlaunch.agent.entry distlaunch.agent.lane distlaunch.remote.srun distlaunch.agent.jobspec "
        "distlaunch.config distlaunch.store.client distlaunch.agent.specs distlaunch.agent.node"
    )
    code = f"import sys\nfor m in {modules.split()!r}: __import__(m)\nprint('typing' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cp = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
    )
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip() == "False"
