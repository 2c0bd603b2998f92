"""A worker for tests/test_slurm_faults.py, started by ``distlaunch run`` in a Slurm job.

``fault_worker.py MARKS`` writes ``MARKS/pid.ATTEMPT.RANK`` ("pid node", once its
SIGUSR1 handler is installed; ATTEMPT is TORCHELASTIC_RESTART_COUNT, node is
SLURMD_NODENAME) and appends one line "node" to ``MARKS/usr1.RANK`` per SIGUSR1 it gets.
Then:

- the rank named by ``FAIL_RANK``, in attempt 0 only, exits 7 once every rank of the
  attempt wrote its pid mark (so the others are all running when it fails);
- every other worker exits 0 once ``MARKS/done`` exists or after ``WORKER_SECONDS``
  (default 0: at once) in attempt 0, at once in later attempts.
"""

import os
import signal
import sys
import time

marks = sys.argv[1]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
node = os.environ.get("SLURMD_NODENAME", "?")
usr1 = os.open(os.path.join(marks, f"usr1.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def on_usr1(signum, frame):
    os.write(usr1, f"{node}\n".encode())


signal.signal(signal.SIGUSR1, on_usr1)
mark = os.path.join(marks, f"pid.{attempt}.{rank}")
with open(mark + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {node}")
os.rename(mark + ".tmp", mark)  # readers never see a half-written mark

if attempt == 0 and str(rank) == os.environ.get("FAIL_RANK"):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(marks, f"pid.0.{r}")) for r in range(world)):
            break
        time.sleep(0.05)
    sys.exit(7)

deadline = time.monotonic() + (float(os.environ.get("WORKER_SECONDS", "0")) if attempt == 0 else 0)
while time.monotonic() < deadline and not os.path.exists(os.path.join(marks, "done")):
    time.sleep(0.05)
