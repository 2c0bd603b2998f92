"""Stands in for click in the head (first on PYTHONPATH): lets the real click load only
once the job has its agent step (``squeue -s`` lists ``distlaunch-agents``), so a head
that imports its CLI before starting the step fails with one line. At most 20 s."""

import os
import subprocess
import sys
import time

_job = os.environ["SLURM_JOB_ID"]
_deadline = time.monotonic() + 20
while True:
    _steps = subprocess.run(
        ["squeue", "-h", "-s", "-j", _job, "-o", "%j"], capture_output=True, text=True
    ).stdout.split()
    if "distlaunch-agents" in _steps:
        break
    if time.monotonic() > _deadline:
        sys.exit("click gate: the CLI was imported before the agent step started")
    time.sleep(0.05)

# the real click in this module's place (the import system returns sys.modules["click"])
_here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["click"]
import click as _click  # noqa: E402

sys.modules["click"] = _click
