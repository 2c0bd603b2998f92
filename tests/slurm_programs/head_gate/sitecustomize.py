"""The head's ``sitecustomize`` (first on PYTHONPATH; agents and workers leave at once):
lets ``distlaunch.preparse``, the first import after ``remote.srun.start_early``, load
only once the job has its agent step (``squeue -s`` lists ``distlaunch-agents``), so a
head that imports anything more before starting the step fails with one line (at most
20 s); writes the modules the head had loaded when it started srun, beyond those the
interpreter had loaded before this file, to ``$HEAD_MODULES.srun`` (one a line), the
modules loaded by the gate to ``$HEAD_MODULES.step``, and those loaded by its exit to
``$HEAD_MODULES``; whether the cyclic collector was on when the head imported its
controller (after the specs went out) and at its exit, to ``$HEAD_MODULES.gc``. Imports
nothing itself before the gate (``time`` and ``gc`` are built in)."""

import os
import sys

if sys.orig_argv[-4:-2] == ["run", "--nproc-per-node"] and "SLURM_STEP_ID" not in os.environ:
    import time

    _before = set(sys.modules)

    def _spawned(event, args):
        if event in ("os.posix_spawn", "subprocess.Popen") and os.path.basename(str(args[1][0])) == "srun":
            path = os.environ["HEAD_MODULES"] + ".srun"
            if not os.path.exists(path):  # the first srun: the agent step's
                with open(path, "w") as f:
                    f.write("\n".join(sorted(set(sys.modules) - _before)))

    sys.addaudithook(_spawned)

    import gc

    _gc = {}

    class _Gate:  # stays in sys.meta_path: it also notes the collector at the controller's import
        def find_spec(self, name, path=None, target=None):
            if name == "distlaunch.head_controller":
                _gc["controller"] = gc.isenabled()
            if name != "distlaunch.preparse":
                return None
            loaded = sorted(sys.modules)
            import json
            import subprocess

            with open(os.environ["HEAD_MODULES"] + ".step", "w") as f:
                json.dump(loaded, f)
            job, deadline = os.environ["SLURM_JOB_ID"], time.monotonic() + 20
            while True:
                steps = subprocess.run(
                    ["squeue", "-h", "-s", "-j", job, "-o", "%j"], capture_output=True, text=True
                ).stdout.split()
                if "distlaunch-agents" in steps:
                    return None
                if time.monotonic() > deadline:
                    sys.exit("head gate: the CLI was imported before the agent step started")
                time.sleep(0.05)

    sys.meta_path.insert(0, _Gate())
    _leave = os._exit

    def _exit(code):
        import json

        with open(os.environ["HEAD_MODULES"], "w") as f:
            json.dump(sorted(sys.modules), f)
        with open(os.environ["HEAD_MODULES"] + ".gc", "w") as f:
            json.dump({**_gc, "exit": gc.isenabled()}, f)
        _leave(code)

    os._exit = _exit
