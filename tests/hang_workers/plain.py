"""Ranks in a stdlib loop: MODE says how each shows progress.

quiet: every rank sleeps, rank 2 in its own function (a hang);
beats: every rank sleeps between heartbeats (no output), for SECONDS, then exits 0;
printer: rank 0 prints every 0.3 s, the others sleep, for SECONDS, then exits 0;
crash: rank 1 exits 3 after a moment, the others sleep in wait_here;
late: every rank is silent for SECONDS (start-up), then prints and exits 0;
one_exits: rank 3 exits 0, the others sleep in wait_here (rank 2 in stuck_here; rank 1
with an operation in flight, as distlaunch's runtime marks one).
"""

import os
import sys
import time

import distlaunch

rank = int(os.environ["RANK"])
mode = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0


def stuck_here():
    time.sleep(600)  # STUCK-LINE


def wait_here():
    time.sleep(600)  # WAIT-LINE


if mode == "late":
    time.sleep(seconds)
print(f"rank {rank} up", flush=True)
end = time.monotonic() + seconds
if mode == "quiet":
    if rank == 2:
        stuck_here()
    wait_here()
elif mode == "beats":
    while time.monotonic() < end:
        distlaunch.heartbeat()
        time.sleep(0.2)
elif mode == "printer":
    while time.monotonic() < end:
        if rank == 0:
            print("tick", flush=True)
        time.sleep(0.3)
elif mode == "one_exits":
    if rank == 3:
        sys.exit(0)
    if rank == 2:
        stuck_here()
    if rank == 1:
        from distlaunch import progress

        progress.begin("all_reduce", 7, peers=[2])
    wait_here()
elif mode == "crash":
    if rank == 1:
        time.sleep(1.5)
        sys.exit(3)
    wait_here()
