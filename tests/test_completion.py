"""Shell completions: the committed scripts are what the CLI generates, and they work."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, dl


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_committed_completion_matches_cli(shell):
    res = dl("completion", shell)
    assert res.returncode == 0, res.stderr
    committed = (ROOT / "completions" / f"distlaunch.{shell}").read_text()
    assert res.stdout == committed, (
        f"regenerate: distlaunch completion {shell} > completions/distlaunch.{shell}"
    )


def test_completion_completes_run_options():
    env = dict(
        os.environ, _DISTLAUNCH_COMPLETE="bash_complete", COMP_WORDS="distlaunch run --nproc", COMP_CWORD="2"
    )
    out = subprocess.run(
        [sys.executable, "-m", "distlaunch"], env=env, capture_output=True, text=True, cwd=ROOT
    ).stdout
    assert "plain,--nproc-per-node" in out.splitlines()


def test_bash_script_loads_in_bash(tmp_path):
    script = ROOT / "completions" / "distlaunch.bash"
    res = subprocess.run(
        ["bash", "-c", f"source {script} && complete -p distlaunch"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "_distlaunch_completion" in res.stdout, res.stderr
