"""The launch mode is decided once (distlaunch/modes.py): flags -> mode description, every
usage error of the resolution, the error hierarchy's exit codes, and `run --help`.

Options go through the real `run` command's parser (click's make_context, nothing runs),
so the defaults are the command's own.
"""

import re

import pytest
from click.testing import CliRunner
from conftest import WORKERS

from distlaunch import cli
from distlaunch.errors import (
    ConfigError,
    DistlaunchError,
    LaunchInterrupted,
    RendezvousError,
    StoreError,
    WorkerFailedError,
)
from distlaunch.launcher import make_plan
from distlaunch.modes import DynamicNodes, HeadNodes, SingleNode, StaticNodes, resolve

SCRIPT = str(WORKERS / "actor.py")


def mode_of(*args: str, env: dict[str, str] | None = None):
    """The mode of `distlaunch run ARGS SCRIPT --flag` in environment ``env`` (default
    empty: no Slurm, whatever machine the tests run on); the options given are named."""
    ctx = cli.run.make_context("run", [*args, SCRIPT, "--flag"])
    o = dict(ctx.params)
    script, script_args = o.pop("script"), o.pop("script_args")
    for action in ("print_config", "dry_run", "root_cause_file"):
        o.pop(action)
    given = frozenset(k for k in o if ctx.get_parameter_source(k).name == "COMMANDLINE")
    return resolve(script, script_args, o, given, {} if env is None else env)


def test_single_node():
    m = mode_of("--nproc-per-node", "3", "--master-port", "1234")
    assert isinstance(m, SingleNode) and (m.nnodes, m.node_rank) == (1, 0)
    assert m.job.nproc_per_node == 3 and m.job.master_port == 1234
    assert m.job.entrypoint == SCRIPT and m.job.args == ("--flag",)
    assert re.fullmatch(r"[0-9a-f]{12}", m.job.run_id)  # random


@pytest.mark.parametrize("args", [[], ["--nnodes", "1:2", "--rdzv-endpoint", "h:29400"], ["-H", "a:1"]])
def test_master_port_0_is_a_free_port_where_one_node_chooses_it(args):
    """torch's TCPStore binds a free port for port 0: the port chosen at start, as with
    no --master-port (a per-node static launch refuses it: see test_usage_errors)."""
    assert mode_of(*args, "--master-port", "0").job.master_port is None


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--nnodes", "2", "--node-rank", "1"],
            dict(nnodes=2, node_rank=1, addr="127.0.0.1", port=29500, run_id="job29500"),
        ),
        (
            ["--nnodes", "3", "--master-addr", "10.0.0.1", "--master-port", "1234"],
            dict(nnodes=3, node_rank=0, addr="10.0.0.1", port=1234, run_id="job1234"),
        ),
        (
            ["--nnodes", "2", "--rdzv-id", "shared", "--run-id", "ignored"],
            dict(nnodes=2, node_rank=0, addr="127.0.0.1", port=29500, run_id="shared"),
        ),
    ],
)
def test_static_nodes(args, expected):
    m = mode_of(*args, "--store-token-file", "/tmp/tok")
    assert isinstance(m, StaticNodes)
    assert (m.nnodes, m.node_rank, m.job.master_addr, m.job.master_port, m.job.run_id) == tuple(
        expected.values()
    )
    assert m.store_token_file == "/tmp/tok"
    assert m.store_text() == f"{expected['addr']}:{expected['port']} (hosted by node 0)"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--nnodes", "1:3", "--rdzv-endpoint", "[::1]:29400"], ("::1", 29400, 1, 3, "job----1--29400")),
        (["--nnodes", "2", "--rdzv-endpoint", "node7:29400"], ("node7", 29400, 2, 2, "job-node7-29400")),
        (["--rdzv-endpoint", "node7:1", "--run-id", "mine"], ("node7", 1, 1, 1, "mine")),
    ],
)
def test_dynamic_nodes(args, expected):
    m = mode_of(*args)
    assert isinstance(m, DynamicNodes)
    assert (m.host, m.port, m.nnodes, m.max_nodes, m.job.run_id) == expected
    assert m.job.master_addr is None and m.job.master_port is None


def test_standalone_is_single_node():
    assert isinstance(mode_of("--standalone", "--nnodes", "4"), SingleNode)


def test_head_nodes():
    m = mode_of(
        "-H",
        "a:2,user@b",
        "--nproc_per_node",
        "3",
        "--ssh-port",
        "2222",
        "--ssh-user",
        "me",
        "--ssh-accept-new-host-keys",
        "--min-nodes",
        "1",
        "--env-all",
        "--prefix-host",
        "--remote-python",
        "/py",
        "--store-addr",
        "10.0.0.9",
    )
    assert isinstance(m, HeadNodes)
    assert [(h.name, h.user, h.slots) for h in m.head.hosts] == [("a", None, 2), ("b", "user", 3)]
    assert (m.head.ssh.port, m.head.ssh.user, m.head.ssh.accept_new_host_keys) == (2222, "me", True)
    assert (
        m.head.min_nodes,
        m.head.env_all,
        m.head.prefix_host,
        m.head.remote_python,
        m.head.store_addr,
    ) == (1, True, True, "/py", "10.0.0.9")


def test_hostfile_with_exclude(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=2\n")
    m = mode_of("--hostfile", str(hostfile), "--exclude", "a")
    assert [(h.name, h.slots) for h in m.head.hosts] == [("b", 2)]


def test_job_fields_are_parsed(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # -x ships it along when set
    m = mode_of(
        "--nproc-per-node",
        "2",
        "--redirects",
        "0:3",
        "--tee",
        "2",
        "--local_ranks_filter",
        "0,1",
        "--no-prefix",
        "--rdzv-conf",
        "join_timeout=5",
        "-x",
        "A=1",
        "--bind-to",
        "none",
        "--role",
        "r",
    )
    j = m.job
    assert j.redirects.for_rank(0) == 3 and j.tee.default == 2
    assert j.local_ranks_filter == frozenset({0, 1}) and j.prefix is False
    assert j.rdzv_conf == (("join_timeout", "5"),) and j.env == (("A", "1"),)
    assert (j.bind_to, j.role) == ("none", "r")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nnodes", "x"], "--nnodes 'x' is invalid"),
        (["--nnodes", "0"], "give 1 to"),
        (["--nnodes", "2:99999999"], "--nnodes 2:99999999 is invalid"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is invalid with --nnodes 2"),
        (["--node-rank", "-1"], "--node-rank -1"),
        (["--nnodes", "3:2", "--rdzv-endpoint", "h:1"], "MAX must be at least MIN"),
        (["--nnodes", "1:2"], "needs --rdzv-endpoint"),
        (["--rdzv-endpoint", "nope"], "--rdzv-endpoint 'nope'"),
        (["--rdzv-endpoint", "::1:29400"], "--rdzv-endpoint '::1:29400'"),
        (["--rdzv-endpoint", "h:70000"], "--rdzv-endpoint 'h:70000'"),
        (["-H", "a", "--hostfile", "f"], "either -H/--hosts or --hostfile"),
        (["-H", "a", "--nnodes", "2"], "--nnodes 2 is for per-node launches"),
        (["-H", "a:1", "--min-nodes", "2"], "--min-nodes 2 is more than the 1 host"),
        (["-H", "a", "--include", "b"], "b"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0"),
        (["--redirects", "7"], "--redirects '7'"),
        (["--tee", "x"], "--tee 'x'"),
        (["--local-ranks-filter", "x"], "--local-ranks-filter 'x'"),
        (
            ["--nnodes", "2", "--master-port", "0"],
            "--master-port 0 picks a free port on node 0, which the other 1 node(s) cannot know; "
            "give a port, e.g. --master-port 29500",
        ),
        (["--nproc-per-node", "2", "--local-ranks-filter", "2"], "--local-ranks-filter 2: no node runs"),
        (["-H", "a:1,b:3", "--local-ranks-filter", "3"], "give local ranks from 0 to 2"),
        (["--rdzv-conf", "x"], "--rdzv-conf item 'x'"),
        (["--rdzv-conf", "bogus=1"], "'bogus' is unknown"),
        (["-x", "1BAD"], "-x '1BAD'"),
        (["-m", "--no-python"], "--module and --no-python"),
        (["--run-id", ".."], "--run-id '..'"),
        (["--max-restarts", "-1"], "--max-restarts -1"),
    ],
)
def test_usage_errors(args, needle):
    with pytest.raises(ConfigError) as err:
        mode_of(*args)
    assert needle in str(err.value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    "args, ranks, master_port",
    [
        (["--nproc-per-node", "2"], [0, 1], None),
        (["--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "2", "--master-port", "1"], [4, 5], 1),
        (["--nnodes", "2:4", "--node-rank", "1", "--rdzv-endpoint", "h:1"], [1], None),
    ],
)
def test_plan_of_each_node_mode(args, ranks, master_port):
    plan = make_plan(mode_of(*args))
    assert [s.rank for s in plan.slots] == ranks and plan.master_port == master_port


def test_exit_codes_are_attributes_of_the_errors():
    assert DistlaunchError("x").exit_code == 1
    assert ConfigError("x").exit_code == 2
    assert StoreError("x").exit_code == RendezvousError("x").exit_code == 1
    assert LaunchInterrupted(15).exit_code == 143
    assert WorkerFailedError("x", None, 7).exit_code == 7


def test_cli_reports_multi_line_errors_on_one_line():
    assert (
        cli._one_line("cannot connect to 2 of 3 hosts:\n  a (refused)\n  b (timeout)")
        == "cannot connect to 2 of 3 hosts: a (refused); b (timeout)"
    )
    assert cli._one_line("one line") == "one line"


def test_help_lists_each_option_once_by_concern():
    out = CliRunner().invoke(cli.cli, ["run", "--help"]).output
    assert "_" not in "".join(re.findall(r"--[\w-]+", out))  # no underscore spellings
    listed = re.findall(r"^  (?:-\w, )?(--[\w-]+)", out, re.M)
    options = [  # hidden: internal (--root-cause-file, for launch())
        p
        for p in cli.run.get_params(cli.run.make_context("run", ["x"]))
        if p.param_type_name == "option" and not getattr(p, "hidden", False)
    ]
    assert len(listed) == len(set(listed)) == len(options)
    sections = re.findall(r"^(\w[\w ]*):$", out, re.M)
    assert sections == [
        "Options",
        "Workers",
        "Nodes and rendezvous",
        "Hosts and SSH",
        "Output",
        "Supervision",
    ]


def test_underscore_spellings_still_parse():
    ctx = cli.run.make_context(
        "run", ["--nproc_per_node=2", "--max_restarts", "3", SCRIPT, "--not_an_option_of_run"]
    )
    assert (ctx.params["nproc_per_node"], ctx.params["max_restarts"]) == ("2", 3)
    assert ctx.params["script_args"] == ("--not_an_option_of_run",)  # the script's, untouched


# --- Slurm allocations (salloc/sbatch without a host list): the environment decides ------

ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize(
    "args, env, slots",
    [
        ([], {}, [2, 2]),  # SLURM_TASKS_PER_NODE, Slurm's own compressed form
        ([], {"SLURM_NTASKS_PER_NODE": "3"}, [3, 3]),  # --ntasks-per-node wins over it
        (["--nproc-per-node", "1"], {"SLURM_NTASKS_PER_NODE": "3"}, [1, 1]),  # ours wins
        ([], {"SLURM_TASKS_PER_NODE": "3,1"}, [3, 1]),
    ],
)
def test_allocation_is_head_mode_over_its_nodes(args, env, slots):
    m = mode_of(*args, env={**ALLOCATION, **env})
    assert isinstance(m, HeadNodes) and m.head.engine == "slurm" and m.head.ssh is None
    assert [(h.name, h.slots) for h in m.head.hosts] == list(zip(["n1", "n2"], slots))


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {"SLURM_TASKS_PER_NODE": "2"}, "gives 1 nodes, SLURM_JOB_NODELIST 2"),
        (["--min-nodes", "3"], {}, "--min-nodes 3 is more than the 2 host(s)"),
        (["--launcher", "slurm"], {"SLURM_JOB_ID": None}, "--launcher slurm needs a Slurm allocation"),
    ],
)
def test_allocation_errors(args, env, message):
    merged = {k: v for k, v in {**ALLOCATION, **env}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        mode_of(*args, env=merged)


def test_launcher_ssh_inside_an_allocation_stays_on_this_node():
    assert isinstance(mode_of("--launcher", "ssh", env=ALLOCATION), SingleNode)


# --- the engine registry and the options' checks -------------------------------------------


def test_engine_is_one_registry_lookup():
    """engine.detect walks the registry: Slurm's variables say where it puts a launch,
    --launcher limits the walk to one engine; SSH is never detected (a host list or
    --launcher ssh names it)."""
    from distlaunch import engine

    assert engine.NAMES == ("ssh", "slurm", "skypilot", "pods") and engine.entry("slurm").module == "slurm"
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    assert engine.detect("auto", {}) is None
    assert engine.detect("auto", ALLOCATION) == ("slurm", "head")
    assert engine.detect("auto", step) == ("slurm", "node")
    assert engine.detect("slurm", ALLOCATION) == ("slurm", "head")
    assert engine.detect("ssh", ALLOCATION) is None
    with pytest.raises(KeyError, match="no engine 'lsf'"):
        engine.plugin("lsf")


def test_a_plain_launch_imports_no_engine():
    """Without a scheduler's variables no engine module is imported to choose the mode."""
    import subprocess
    import sys

    code = (
        "import sys; from distlaunch import cli; from distlaunch.modes import resolve; "
        "ctx = cli.run.make_context('run', [sys.argv[1]]); o = dict(ctx.params); "
        "[o.pop(k) for k in ('script', 'script_args', 'print_config', 'dry_run', 'root_cause_file')]; "
        "resolve(sys.argv[1], (), o, frozenset(), {}); "
        "print(sorted(m for m in sys.modules if m.startswith('distlaunch.engine.')))"
    )
    out = subprocess.run([sys.executable, "-c", code, SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_run_option_is_a_field():
    """cli checks on import that each `run` option is a RunOptions field: one without
    would be dropped silently."""
    import click

    cli._check_run_options(cli.run)
    extra = click.Command("run", params=[*cli.run.params, click.Option(["--new-flag"], is_flag=True)])
    with pytest.raises(TypeError, match="new_flag"):
        cli._check_run_options(extra)


def test_environment_variables_are_read_through_the_table():
    from distlaunch.env import lookup

    assert lookup("OMP_NUM_THREADS", {"OMP_NUM_THREADS": "4"}) == "4"
    assert lookup("SLURM_JOB_ID", {}) is None
    with pytest.raises(KeyError, match="NOT_A_DISTLAUNCH_VAR is in no table"):
        lookup("NOT_A_DISTLAUNCH_VAR", {})
