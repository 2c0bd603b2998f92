"""Every rank prints the same line at one wall-clock instant (argv[1], seconds since the
epoch), then a line of its own."""

import os
import sys
import time

rank = int(os.environ["RANK"])
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
print("all ranks here", flush=True)
print(f"rank {rank} alone", flush=True)
