"""distlaunch.launch(fn, ...): per-rank results, failures with tracebacks, restarts, hosts."""

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from launch_fns import (
    argparse_error,
    die_by_signal,
    fail_first_attempt,
    fail_on_rank_one,
    fail_on_rank_one_then_rank_zero_raises_when_stopped,
    launcher_cmdline_and_env,
    rank_info,
)

import distlaunch
from distlaunch.errors import ConfigError
from distlaunch.launch_api import LaunchFailedError


@pytest.fixture(autouse=True, scope="module")
def workers_import_tests():
    """Workers must import launch_fns: make tests/ importable for them (this module only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")])),
        )
        yield


def test_results_indexed_by_rank():
    out = distlaunch.launch(rank_info, args=(10,), kwargs={"offset": 1}, nproc_per_node=3, env={"WHO": "api"})
    assert out == [{"rank": 10 * r + 1, "world": 3, "who": "api"} for r in range(3)]


def test_failure_carries_traceback(capfd):
    """One failed rank, one report: its traceback reaches the console once (the worker's
    output), the exception names it in one line and carries the whole traceback."""
    with pytest.raises(LaunchFailedError) as e:
        distlaunch.launch(fail_on_rank_one, nproc_per_node=2)
    assert e.value.rank == 1 and e.value.exit_code == 1
    assert "KeyError: 'rank one is broken'" in e.value.traceback and "fail_on_rank_one" in e.value.traceback
    assert str(e.value).splitlines() == [
        "rank 1 raised KeyError: 'rank one is broken' (exit code 1); its traceback is in the "
        "worker's output above and in LaunchFailedError.traceback"
    ]
    err = capfd.readouterr().err
    assert err.count("KeyError: 'rank one is broken'") == 1 and err.count("in fail_on_rank_one") == 1, err
    assert "root cause (first failed worker)" in err and "rank 1 (local rank 1)" in err


def test_failure_names_the_root_cause_not_a_later_failure(capfd):
    """Rank 0 raises too, after rank 1 failed and the group was stopped: the exception
    names rank 1, the first failed worker, as the console's root cause does."""
    with pytest.raises(LaunchFailedError) as e:
        distlaunch.launch(fail_on_rank_one_then_rank_zero_raises_when_stopped, nproc_per_node=2)
    assert e.value.rank == 1 and e.value.exit_code == 1, str(e.value)
    assert "KeyError: 'rank one is broken'" in e.value.traceback
    err = capfd.readouterr().err
    assert "rank 1 (local rank 1)" in err.split("root cause")[1]


def test_launch_failed_error_is_importable_from_the_package():
    """The README's name: `from distlaunch import LaunchFailedError` (loaded on first use)."""
    from distlaunch import LaunchFailedError as exported

    assert exported is LaunchFailedError


def test_env_values_stay_off_the_command_line():
    """env= values reach the workers through a dotenv file (--env-file), not the
    launcher's argv (which every user sees in ps) nor its own environment (where PET_*,
    PYTHONPATH ... would change the launcher itself)."""
    [(cmdline, value, in_launcher)] = distlaunch.launch(
        launcher_cmdline_and_env, args=("API_SECRET",), env={"API_SECRET": "hunter2-xyz"}
    )
    assert value == "hunter2-xyz"
    assert "distlaunch.launch_api" in cmdline and "--env-file" in cmdline  # the values' file, by path
    assert "hunter2-xyz" not in cmdline
    assert not in_launcher


def test_env_values_keep_quotes_backslashes_newlines_and_become_str():
    tricky = 'a "quoted" \\path\nnext line'
    [(_, value, _), (_, number, _)] = distlaunch.launch(
        launcher_cmdline_and_env, args=("V",), env={"V": tricky}, nproc_per_node=1
    ) + distlaunch.launch(launcher_cmdline_and_env, args=("N",), env={"N": 4}, nproc_per_node=1)
    assert value == tricky and number == "4"


@pytest.mark.parametrize("name", ["NCCL_*", "A=B", "1X"])
def test_env_names_must_be_variable_names(name):
    with pytest.raises(
        ConfigError, match=f"launch\\(env=...\\): {re.escape(repr(name))} is not a variable name"
    ):
        distlaunch.launch(rank_info, args=(1,), env={name: "v"})


def test_restart_then_results():
    assert distlaunch.launch(fail_first_attempt, nproc_per_node=2, max_restarts=1) == [1, 1]


def test_death_without_traceback():
    with pytest.raises(LaunchFailedError) as e:
        distlaunch.launch(die_by_signal, nproc_per_node=2)
    assert e.value.exit_code == 137 and e.value.traceback is None


def test_worker_exit_code_2_is_a_worker_failure_with_its_traceback():
    # argparse's exit code 2 inside a worker is not a usage error of distlaunch run
    with pytest.raises(LaunchFailedError) as e:
        distlaunch.launch(argparse_error, nproc_per_node=1)
    assert e.value.exit_code == 2 and e.value.rank == 0
    assert "SystemExit: 2" in e.value.traceback


def test_lambdas_closures_and_main_functions():
    """torchrunx users pass lambdas and closures; cloudpickle carries them by value."""
    scale = 3
    assert distlaunch.launch(lambda: int(os.environ["RANK"]) * scale, nproc_per_node=2) == [0, 3]

    def local_fn(x):
        return (x, int(os.environ["WORLD_SIZE"]), lambda y: y + x)

    [(x, world, add)] = distlaunch.launch(local_fn, (5,))
    assert (x, world, add(1)) == (5, 1, 6)  # a lambda came back too


def test_function_of_a_script_main(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(
        "import os, distlaunch\n"
        "def work(k):\n"
        "    return k * int(os.environ['RANK'])\n"
        "if __name__ == '__main__':\n"
        "    print(distlaunch.launch(work, (7,), nproc_per_node=2))\n"
    )
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[0, 7]"


def test_unpicklable_call():
    import threading

    with pytest.raises(TypeError, match="picklable"):
        distlaunch.launch(print, (threading.Lock(),))


def test_launch_on_hosts(sshd_hosts):
    out = distlaunch.launch(
        rank_info, args=(1,), hosts="node1:1,node2:2", options=["--ssh-config", sshd_hosts.ssh_config]
    )
    assert [o["rank"] for o in out] == [0, 1, 2] and {o["world"] for o in out} == {3}


from sshd import sshd_hosts  # noqa: E402,F401
