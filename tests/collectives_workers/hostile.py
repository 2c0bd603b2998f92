"""Worker for tests/test_collectives_hostile.py: a rank the test can attack between
collectives. Started with the torchrun environment and COLL_INIT_METHOD (a file store)
by the test itself, TCP only (DISTLAUNCH_SHM=0).

Optional environment: COLL_NOFILE lowers the soft RLIMIT_NOFILE to that many
descriptors after init (EMFILE tests); COLL_HANDSHAKE_TIMEOUT sets the transport's
handshake timeout (seconds) so the tests need not wait the default.

Prints ``READY <rank> <pid> <host>:<port> <store prefix> <secret>`` after init, then
reads commands from stdin, one per line:

    go      all_reduce of [rank + 1] over the world; prints ``DONE <rank> <sum>`` (or
            ``FAIL <rank> <error>``)
    quit    destroy the process group and exit 0 (also on EOF)
"""

import os
import resource
import sys

import numpy as np
from common import init

import distlaunch.collectives as dist
from distlaunch.collectives.runtime import current_runtime

rank, n = init(timeout=float(os.environ.get("COLL_GROUP_TIMEOUT", "20")))
rt = current_runtime()
if os.environ.get("COLL_HANDSHAKE_TIMEOUT"):
    rt.transport.handshake_timeout = float(os.environ["COLL_HANDSHAKE_TIMEOUT"])
if os.environ.get("COLL_NOFILE"):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["COLL_NOFILE"]), hard))
host, port = rt.transport.address
print(f"READY {rank} {os.getpid()} {host}:{port} {rt.prefix} {rt.secret}", flush=True)

for line in sys.stdin:
    cmd = line.strip()
    if cmd == "go":
        x = np.array([rank + 1.0])
        try:
            dist.all_reduce(x)
            print(f"DONE {rank} {x[0]:g}", flush=True)
        except Exception as e:
            print(f"FAIL {rank} {type(e).__name__}: {e}", flush=True)
    elif cmd == "quit":
        break
dist.destroy_process_group()
