"""A stand-in for ``python -m distlaunch agent`` started by the Slurm engine in tests:
says hello, reads the broadcast spec line, keeps its own (``select_spec``), reports what
it got, then does what its spec's ``do`` says: ``exit N``, ``sleep`` (records its pid
for a kill), or ``die`` (SIGKILLs itself)."""

import json
import os
import signal
import sys
import time

from distlaunch import __version__
from distlaunch.agent.kill import with_start_times
from distlaunch.engine.slurm import select_spec
from distlaunch.remote.command import AGENT_HELLO

print(AGENT_HELLO, os.environ.get("FAKE_VERSION", __version__), flush=True)
line = sys.stdin.readline()
if not line:
    sys.exit(0)  # the head started nothing
spec = select_spec(json.loads(line))
with open(os.path.join(spec["dir"], f"got-{os.environ['SLURMD_NODENAME']}"), "w") as f:
    json.dump({"spec": spec, "env": {k: v for k, v in os.environ.items() if k.startswith("SLURM")}}, f)
with open("/proc/self/cmdline", "rb") as f:
    argv = f.read().decode()
print(f"agent on {os.environ['SLURMD_NODENAME']}: node {spec['node']['node_id']}", flush=True)
print(f"agent stderr on {os.environ['SLURMD_NODENAME']}", file=sys.stderr, flush=True)
action, _, arg = spec["do"].partition(" ")
if action == "exit":
    sys.exit(int(arg))
if action == "die":
    time.sleep(float(arg or 0))
    os.kill(os.getpid(), signal.SIGKILL)
if action == "sleep":
    with open(os.path.join(spec["dir"], f"pid-{os.environ['SLURMD_NODENAME']}"), "w") as f:
        json.dump(with_start_times([os.getpid()]), f)
    time.sleep(float(arg or 60))
