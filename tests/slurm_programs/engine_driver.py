"""Runs inside a Slurm allocation (``salloc -N2 python engine_driver.py SCENARIO``):
a SlurmEngine starts tests/slurm_programs/agent.py on every node of the allocation with
per-node specs, relays their output and reports each agent's end. The scenario (JSON on
argv: nothing secret) gives each node's ``do`` and engine settings; the last stdout line
is a JSON summary: ends (node id, status, seconds since start), error (ConfigError text).
``delay_start``: seconds between connect() (which starts the step) and start()."""

import json
import os
import sys
import time

from distlaunch import __version__
from distlaunch.engine import AgentLaunch
from distlaunch.engine.slurm import SlurmEngine, allocation_nodes
from distlaunch.errors import ConfigError
from distlaunch.hosts import Host

scenario = json.loads(sys.argv[1])
here = os.path.dirname(os.path.abspath(__file__))
names = allocation_nodes()
engine = SlurmEngine.connect(
    {k: Host(n) for k, n in enumerate(names)},
    AgentLaunch(
        sys.executable,
        scenario.get("cwd", os.getcwd()),
        {"PYTHONPATH": os.environ.get("PYTHONPATH", "")} if os.environ.get("PYTHONPATH") else {},
        __version__,
    ),
    agent_argv=[os.path.join(here, "agent.py")],
)
engine.start_timeout = scenario.get("start_timeout", 30)
token = scenario["token"]
specs = {
    k: {
        "token": token,
        "dir": scenario["dir"],
        "node": {"node_id": k, "host_label": n},
        "do": scenario["do"][n],
    }
    for k, n in enumerate(names)
}
t0 = time.monotonic()
ends = []
result = {
    "nodes": names,
    "argv": engine.srun_argv(list(specs)),
    "store": engine.store_address(),
    "master": [engine.master_address(k) for k in specs],
}
# the agents' hellos (stdout) and srun's lines placing them (stderr) are both waiting
# when start() first reads: as when the head's own set-up outlasts the step's start
time.sleep(scenario.get("delay_start", 0))
try:
    engine.start(specs)
except ConfigError as e:
    result["error"] = str(e)
else:
    killed = False
    while engine.running:
        engine.pump(0.5, on_end=lambda k, s: ends.append([k, s, round(time.monotonic() - t0, 2)]))
        kill = scenario.get("kill")
        if kill is not None and not killed:
            path = os.path.join(scenario["dir"], f"pid-{names[kill]}")
            if os.path.exists(path) and os.path.getsize(path):
                with open(path) as f:
                    records = [tuple(r) for r in json.load(f)]
                engine.kill(kill, records)
                killed = True
                result["killed_at"] = round(time.monotonic() - t0, 2)
finally:
    engine.close()
result["ends"] = ends
print(json.dumps(result), flush=True)
