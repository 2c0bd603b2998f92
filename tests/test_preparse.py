"""The narrow pre-parser of `distlaunch run` (distlaunch/preparse.py) against click: on
generated command lines and environments it either declines or gives `run` exactly what
click's own parsing gives it (run for real, up to the call into ``command.run_parsed``)."""

import os
import subprocess
import sys
from unittest import mock

import click
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from distlaunch import cli, preparse

PROG = "distlaunch"
RUN_ONLY = {"script", "script_args", "print_config", "dry_run", "root_cause_file"}


def click_envvars() -> set[str]:
    """Every variable click reads for `distlaunch run`: its parameters' envvars (and the
    group's), and the completion switch of the program name."""
    names = {f"_{PROG.replace('-', '_').upper()}_COMPLETE"}
    for command in (cli.cli, cli.run):
        assert not (command.context_settings or {}).get("auto_envvar_prefix")
        for p in command.params:
            if p.envvar:
                names.update([p.envvar] if isinstance(p.envvar, str) else p.envvar)
    return names


ENVVARS = sorted(click_envvars())


class Called(Exception):
    pass


def by_click(argv: list[str], env: dict[str, str]):
    """What click's parsing of ``argv`` hands on: ("run", script, args, options, given,
    keywords), or ("error", exception type, exit code) where click stops first."""

    def capture(script, script_args, options, given, **kw):
        raise Called(script, tuple(script_args), dict(options), given, kw)

    with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(cli, "run_parsed", capture):
        try:
            cli.cli.main(args=list(argv), prog_name=PROG, standalone_mode=False)
        except Called as c:
            return ("run", *c.args)
        except click.exceptions.Exit as e:
            return ("error", "Exit", e.exit_code)
        except (click.ClickException, click.Abort) as e:
            return ("error", type(e).__name__, getattr(e, "exit_code", None))
        except Exception as e:  # e.g. ConfigError of --config
            return ("error", type(e).__name__, None)
    return ("nothing",)


def check_same(argv: list[str], env: dict[str, str]) -> bool:
    """Assert that the pre-parser declines or matches click; True when it accepted."""
    fast = preparse.parse(argv, env)
    if fast is None:
        return False
    got = by_click(argv, env)
    assert got[0] == "run", (argv, env, got)
    script, args, options, given_names, kw = got[1:]
    assert (script, args) == fast[:2], argv
    assert set(options) == set(fast[2]), argv
    for name, value in options.items():  # field by field
        assert fast[2][name] == value and type(fast[2][name]) is type(value), (argv, name)
    assert given_names == fast[3], argv
    assert kw["dry_run"] is False and kw["root_cause_file"] is None, argv
    return True


BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": "/tmp"}
TOKENS = [
    "--nproc-per-node",
    "--nproc-per-node=2",
    "--nproc-per-node=",
    "--nproc-per-node=x",
    "--nproc_per_node",
    "--nproc",
    "--standalone",
    "--standalone=1",
    "--",
    "-h",
    "--help",
    "--version",
    "--dry-run",
    "--print-config",
    "--max-restarts",
    "--max-restarts=1",
    "--max-restarts=",
    "--max-restart",
    "--config",
    "-m",
    "2",
    "4",
    "0",
    "04",
    "auto",
    "\u0663",
    "-1",
    "",
    "x",
    "train.py",
    "a b.py",
    "-x.py",
    "run",
]
token = st.one_of(st.sampled_from(TOKENS), st.text(max_size=8))
count = st.one_of(
    st.sampled_from(["1", "2", "4", "04", "007"]), st.sampled_from(["1", "2", "4", "04", "007"]), token
)
option = st.one_of(
    st.tuples(st.just("--nproc-per-node"), count).map(list),
    count.map(lambda n: [f"--nproc-per-node={n}"]),
    st.tuples(st.just("--max-restarts"), count).map(list),
    count.map(lambda n: [f"--max-restarts={n}"]),
    st.just(["--standalone"]),
    token.map(lambda t: [t]),
)
script = st.one_of(st.sampled_from(["train.py", "a b.py", "dir/x.py", ".py"]), st.text(max_size=6), token)


@st.composite
def near_forms(draw):
    """Mostly the narrow form, with an odd token here and there."""
    opts = draw(st.lists(option, max_size=3))
    dashes = draw(st.booleans())
    rest = draw(st.lists(token, max_size=3))
    return ["run", *(t for o in opts for t in o), *(["--"] if dashes else []), draw(script), *rest]


argvs = st.one_of(
    near_forms(),
    near_forms(),
    near_forms(),
    st.lists(token, max_size=7).map(lambda t: ["run", *t]),
    st.lists(token, max_size=5),
)
envs = st.dictionaries(
    st.one_of(
        st.sampled_from(ENVVARS),
        st.sampled_from(["DISTLAUNCH_RUN_ID", "TORCHELASTIC_X", "SLURM_JOB_ID", "LANG"]),
    ),
    st.sampled_from(["1", "2", "0", "yes", ""]),
    max_size=2,
).map(lambda extra: {**BASE_ENV, **extra})


envs = st.one_of(st.just(BASE_ENV), envs)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argvs, envs)
def test_declines_or_matches_click(argv, env):
    event("taken" if check_same(argv, env) else "declined")


def test_the_common_forms_are_taken_and_match_click():
    """The forms it exists for are taken (a parser that always declines would pass the
    property above), and each gives what click gives."""
    for argv in (
        ["run", "train.py"],
        ["run", "--nproc-per-node", "4", "train.py", "--lr", "0.1"],
        ["run", "--nproc-per-node=2", "--standalone", "--", "train.py", "--help"],
        ["run", "--standalone", "train.py", "--", "-x"],
        ["run", "--", "train.py"],
        ["run", "--max-restarts", "3", "--nproc-per-node=2", "train.py"],
        ["run", "--max-restarts=007", "train.py"],
    ):
        assert check_same(argv, BASE_ENV), argv


def test_every_variable_click_reads_makes_it_decline():
    for name in ENVVARS:
        assert preparse.parse(["run", "train.py"], {**BASE_ENV, name: "1"}) is None, name


def test_an_allocation_is_taken_as_click_takes_it():
    """Inside a Slurm allocation (the head, after ``__main__`` started the agent step)
    the form is taken, and click, given the same variables, parses it alike."""
    env = {**BASE_ENV, "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "3"}
    assert check_same(["run", "--nproc-per-node", "2", "train.py"], env)


def test_its_defaults_are_clicks():
    got = by_click(["run", "train.py"], BASE_ENV)
    assert got[0] == "run"
    assert got[3] == preparse.DEFAULTS and got[4] == frozenset()
    assert set(preparse.DEFAULTS) == {p.name for p in cli.run.params if p.expose_value} - RUN_ONLY


def test_cli_refuses_to_load_when_the_defaults_miss_an_option():
    """cli's import-time check: an option of `run` that preparse.DEFAULTS lacks (or one
    it has that `run` lost) would make the pre-parsed path pass other options than click."""
    fewer = click.Command("run", params=[p for p in cli.run.params if p.name != "role"])
    with pytest.raises(TypeError, match="preparse.DEFAULTS differs .* role"):
        cli._check_run_options(fewer)


# --- the whole command, quick path against click's -----------------------------------


def _lane_env() -> dict[str, str]:
    """This environment without what makes the narrow form decline or the fast lane
    stand aside (a Slurm job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(preparse.DECLINE_PREFIXES)}
    env.pop("SLURM_JOB_ID", None)
    return env


def _launch(argv: list[str], extra: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m distlaunch *argv`` in _lane_env() plus ``extra``, from the project root."""
    from conftest import ROOT

    return subprocess.run(
        [sys.executable, "-m", "distlaunch", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_lane_env(), **extra},
        timeout=60,
    )


@pytest.mark.parametrize(
    "case",
    [
        ["run", "--nproc-per-node", "0", "missing.py"],  # a usage error: one line, exit 2
        ["run", "tests/no_such_script.py"],  # the script does not exist
        ["run", "--nproc-per-node", "2", "tests/workers/actor.py", "--fail-rank", "1", "--fail-code", "3"],
        ["run", "--standalone", "tests/workers/actor.py"],
        # the fast lane (quick.py) hands these over to the launcher at once
        ["run", "--nproc-per-node", "2", "tests/workers/actor.py", "--fail-rank", "0", "--fail-code", "-9"],
        [
            "run",
            "--nproc-per-node=2",
            "tests/workers/actor.py",
            "--fail-rank",
            "1",
            "--fail-code",
            "3",
            "--sleep",
            "30",
        ],
        ["run", "--max-restarts", "1", "--nproc-per-node", "2", "tests/workers/actor.py", "--fail-rank", "0"]
        + ["--fail-attempts", "1"],
        ["run", "--max-restarts=1", "--nproc-per-node", "2", "tests/workers/actor.py", "--fail-rank", "1"],
        # ended by the fast lane (or after the hand-over if it outlasts the imports)
        ["run", "--nproc-per-node", "2", "tests/workers/actor.py", "--lines", "20"],
    ],
    ids=["bad-count", "no-script", "worker-fails", "ok", "killed", "fails-others-stopped", "restarted"]
    + ["restarts-spent", "output"],
)
def test_the_quick_path_ends_as_the_click_path(case):
    """Exit code and what the user reads, through `python -m distlaunch` (the quick path
    takes these) and through click (a variable of a declined family sends the same
    command line there)."""
    import re
    import subprocess
    import sys

    from conftest import ROOT

    def run(extra):
        res = _launch(case, extra)
        # what differs from run to run: pids, run ids, times, temporary paths; the other
        # ranks' stacks at a failure (py-spy samples them as they exit)
        text = re.sub(
            r"\b(pid \d+|[0-9a-f]{12}|\d+\.\d+ s|/tmp/\S+|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)",
            "#",
            res.stdout + res.stderr,
        )
        lines = [ln for ln in text.splitlines() if not ln.startswith(" ") and "where the other" not in ln]
        return res.returncode, sorted(lines)

    assert preparse.parse(case, {}) is not None  # the quick path takes it
    quick, by_click = run({}), run({"DISTLAUNCH_FORCE_CLICK": "1"})
    assert quick == by_click


def test_the_fast_lane_gives_the_launchers_environment(tmp_path):
    """The workers the fast lane (quick.py) spawns get the environment, session, CPUs
    and command line the launcher gives them (click's path: a declined variable sends
    the same command line there); only what is drawn per run differs (run id, ports,
    the store's secret, the scratch directory, the launcher's pid)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    def dumped(extra, name):
        out = tmp_path / name
        out.mkdir()
        argv = ["run", "--nproc-per-node", "2", "tests/workers/actor.py", "--dump-env", str(out)]
        assert preparse.parse(argv, _lane_env()) is not None
        res = _launch(argv, extra)
        assert res.returncode == 0, res.stderr
        ranks = []
        for rank in (0, 1):
            e = json.loads((out / f"{rank}.json").read_text())
            assert e["_sid"] == e["_pid"]  # its own session
            drawn = [e["TORCHELASTIC_RUN_ID"], os.path.dirname(e["TORCHELASTIC_ERROR_FILE"])]
            drawn += [e["DISTLAUNCH_SHM_PREFIX"].split("_")[2], str(out)]  # the launcher's pid
            for k in ("MASTER_PORT", "DISTLAUNCH_STORE_PORT", "DISTLAUNCH_STORE_TOKEN", "_pid", "_sid"):
                assert e.pop(k)
            e.pop("DISTLAUNCH_FORCE_CLICK", None)
            text = json.dumps(e, sort_keys=True)
            for value in sorted(drawn, key=len, reverse=True):  # the scratch dir holds the run id
                text = text.replace(value, "#")
            ranks.append(json.loads(text))
        return ranks

    assert dumped({}, "fast") == dumped({"DISTLAUNCH_FORCE_CLICK": "1"}, "click")


@pytest.mark.parametrize("extra", [{"SLURM_JOB_ID": "7"}, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}])
def test_the_fast_lane_declines_where_the_head_does_not_load_it(tmp_path, extra):
    """preparse.in_slurm_job, the rule by which a Slurm head does not load the fast lane,
    holds wherever the lane declines for Slurm (quick.start: None, nothing started)."""
    from distlaunch import quick

    script = tmp_path / "train.py"
    script.write_text("")
    env = {**BASE_ENV, **extra}
    parsed = preparse.parse(["run", str(script)], env)
    assert parsed is not None and preparse.in_slurm_job(env) and not preparse.in_slurm_job(BASE_ENV)
    with mock.patch.dict(os.environ, extra):
        assert quick.start(parsed) is None and quick.early is None
