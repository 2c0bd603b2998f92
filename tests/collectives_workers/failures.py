"""Failure behaviours; usage: failures.py MODE. Every rank prints "RESULT <text>" and
exits 0 when it saw the expected behaviour, 1 otherwise.

skip      rank n-1 skips an all_reduce (timeout 1.5 s): the others raise
          CollectiveTimeoutError naming rank n-1, within the timeout + 3 s
mismatch-{shape,dtype,op,root,kind}
          rank 1 disagrees: every rank raises CollectiveMismatchError, in the call or,
          for ranks that had already completed it, in the next call on the group
kill      rank 2 kills itself (SIGKILL) during large all_reduces: the survivors raise
          PeerLostError well within the timeout (20 s)
stopped   rank 2 stops (SIGSTOP) before an all_reduce; rank 0 times out (2 s) and finds
          it unreachable: PeerLostError; rank 1 (timeout 30 s) gets rank 0's ABORT first
          and raises PeerLostError too
recv-timeout  rank 0 receives from rank 1, which never sends: CollectiveTimeoutError
destroy-early  a new group's first call is a small broadcast, rank 1 makes it 0.5 s
          late, then the group is destroyed: rank 1 gets the data at once
destroy-last  the last call on a new group is a broadcast whose root the ranks disagree
          on, then the group is destroyed: CollectiveMismatchError from destroy
reuse-{size,dtype,root}-{broadcast,all_gather,reduce_scatter,gather,scatter,
      all_to_all,all_to_all_single}
          small calls on the same arrays, every rank agreeing, with the results checked
          (varied counts, dtypes and roots, revisited; all_to_all: rank 2 asynchronous
          every other call, and, once each count was met, rank 1's block to rank 2
          longer than a phase); each operation's plans were made; then rank 1 changes
          its array in place (resize, dtype) or its root: every rank raises
          CollectiveMismatchError (the small-call plans are keyed on the call, never on
          the array object)
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
from common import init

import distlaunch.collectives as dist
from distlaunch.collectives.api import resolve_group

mode = sys.argv[1]
timeout = {"skip": 1.5, "recv-timeout": 1.5}.get(mode, 20.0)
if mode == "stopped":  # rank 0 times out first; the others hear of it from its ABORT
    timeout = 2.0 if os.environ.get("RANK") == "0" else 30.0
rank, n = init(timeout=timeout)
SLOT = int(os.environ.get("DISTLAUNCH_SHM_SLOT", 4 << 20))  # (bytes per shared-memory phase buffer)


def result(ok, text):
    print(f"RESULT {'ok' if ok else 'BAD'} rank {rank}: {text}", flush=True)
    sys.stdout.flush()
    time.sleep(1.0 if mode == "skip" else 0.3)  # let slower ranks finish their diagnosis
    os._exit(0 if ok else 1)


t0 = time.monotonic()
if mode == "skip":
    if rank == n - 1:
        time.sleep(timeout + 3)  # stay alive: the others must time out, not see a death
        result(True, "skipped")
    try:
        dist.all_reduce(np.ones(10))
        result(False, "all_reduce returned")
    except dist.CollectiveTimeoutError as e:
        took = time.monotonic() - t0
        ok = e.missing_ranks == [n - 1] and f"ranks [{n - 1}] did not arrive" in str(e) and took < timeout + 3
        result(ok, f"{type(e).__name__} after {took:.2f}s: {e}")

elif mode.startswith("mismatch-"):
    what = mode.split("-", 1)[1]
    odd = rank == 1
    x = np.ones(6 if odd and what == "shape" else 5, np.int64 if odd and what == "dtype" else np.float64)

    def op():
        if what == "root":
            dist.broadcast(x, src=1 if odd else 0)
        elif what == "kind" and odd:
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x, op=dist.ReduceOp.MAX if odd and what == "op" else dist.ReduceOp.SUM)

    where = "call"
    try:
        op()
        where = "next call"
        dist.barrier()
        result(False, "no error in the call nor in the next one")
    except dist.CollectiveMismatchError as e:
        took = time.monotonic() - t0
        result(took < 10, f"CollectiveMismatchError in the {where} after {took:.2f}s: {e}")
    except Exception as e:
        result(
            False,
            f"{type(e).__name__} instead of CollectiveMismatchError after {time.monotonic() - t0:.2f}s: {e}",
        )

elif mode == "kill":
    big = np.ones(4 << 20, np.float32)  # 16 MiB: ring all-reduce
    if rank == 2:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        for _ in range(1000):
            dist.all_reduce(big)
        result(False, "survived 1000 all_reduces")
    except dist.PeerLostError as e:
        took = time.monotonic() - t0
        result(took < 10, f"PeerLostError after {took:.2f}s: {e}")
    except Exception as e:
        result(False, f"{type(e).__name__} instead of PeerLostError: {e}")

elif mode == "stopped":
    x = np.ones(4, np.float32)
    dist.all_reduce(x)  # (every rank connected)
    if rank == 2:  # alive but unreachable; killed 10 s later (a stopped process can be)
        watchdog = f"sleep 10; kill -9 {os.getpid()}"  # (its own session: no signal to
        # the group can take it and leave rank 2 stopped; not holding the output pipes)
        subprocess.Popen(
            ["sh", "-c", watchdog],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.kill(os.getpid(), signal.SIGSTOP)
    try:
        dist.all_reduce(x)
        result(False, "all_reduce returned")
    except dist.PeerLostError as e:
        # rank 0 diagnosed it (rank 1 may also be slow to answer on a loaded machine);
        # rank 1's comes from rank 0's ABORT (over shared memory its woken wait's, when
        # the TCP ABORT and its text come late)
        ok = rank != 0 or (2 in e.unreachable_ranks and not e.missing_ranks)
        result(ok, f"PeerLostError: {e}")
    except Exception as e:
        result(False, f"{type(e).__name__} instead of PeerLostError: {e}")

elif mode == "recv-timeout":
    if rank == 1:
        time.sleep(timeout + 2)
        result(True, "never sent")
    if rank == 0:
        try:
            dist.recv(np.zeros(3), src=1)
            result(False, "recv returned")
        except dist.CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            result(timeout <= took < timeout + 2, f"CollectiveTimeoutError after {took:.2f}s: {e}")
    result(True, "bystander")
elif mode == "destroy-early":
    for i in range(2):
        g = dist.new_group([0, 1])
        if rank == 1:
            time.sleep(0.5)
        x = np.full(4, 7 + i if rank == 0 else 0, np.int32)
        dist.broadcast(x, src=0, group=g)
        dist.destroy_process_group(g)
    took = time.monotonic() - t0
    result(x.tolist() == [8] * 4 and took < 10, f"{x.tolist()} after {took:.2f}s")

elif mode == "destroy-last":
    g = dist.new_group([0, 1])
    dist.broadcast(np.zeros(2, np.uint8), src=0, group=g)
    dist.broadcast(np.zeros(2, np.uint8), src=rank % 2, group=g)
    try:
        dist.destroy_process_group(g)
        result(False, "destroy_process_group raised nothing")
    except dist.CollectiveMismatchError as e:
        result("broadcast #2 on" in str(e) and "on destroy" in str(e), f"in destroy: {e}")
elif mode.startswith("reuse-"):
    _, what, opname = mode.split("-", 2)
    x = np.zeros(4, np.float32)  # the input (all_gather, reduce_scatter) or the buffer
    out = np.zeros(4 * n, np.float32)  # all_gather's output

    calls = 0

    def call(root=0, long=False):
        """One ``opname`` on x (and out); returns what every rank must get."""
        global calls
        calls += 1
        m = x.size
        if opname.startswith("all_to_all"):  # x: n blocks, out: what comes back
            b = m // n
            sizes = [[b] * n for _ in range(n)]  # elements rank i sends rank j
            if long:
                sizes[1][2] = SLOT // n // x.itemsize + 3  # (longer than a phase's block: slot / n)
            x[:] = np.repeat(rank * 10 + np.arange(n), b)
            async_op = rank == 2 and calls % 3 == 0  # (rank 2 receives the long block: both ways)
            want = np.concatenate([np.full(sizes[j][rank], j * 10 + rank) for j in range(n)])
            if opname == "all_to_all":
                ins = [x[j * b : (j + 1) * b] for j in range(n)]
                if long and rank == 1:
                    ins[2] = np.full(sizes[1][2], 12, x.dtype)
                outs = [np.zeros(sizes[j][rank], x.dtype) for j in range(n)]
                w = dist.all_to_all(outs, ins, async_op=async_op)
                got = outs
            else:
                got = [out[:m]] if not long or rank == 0 else [np.zeros(want.size, x.dtype)]
                inp = x
                if long and rank == 1:
                    inp = np.concatenate([x[: 2 * b], np.full(sizes[1][2], 12, x.dtype)])
                splits = [sizes[rank][j] for j in range(n)], [sizes[j][rank] for j in range(n)]
                w = dist.all_to_all_single(
                    got[0], inp, *(reversed(splits) if long else (None, None)), async_op=async_op
                )
            if w is not None:
                w.wait()
            return np.concatenate(got), want
        if opname == "broadcast":
            if rank == root:
                x[:] = np.arange(m) + root
            dist.broadcast(x, src=root)
            return x, np.arange(m) + root
        if opname == "gather":
            x[:] = rank + 1
            outs = [np.zeros(m, x.dtype) for _ in range(n)] if rank == root else None
            dist.gather(x, outs, dst=root)
            return (np.concatenate(outs), np.repeat(np.arange(1, n + 1), m)) if outs else (x, x)
        if opname == "scatter":
            ins = [np.full(m, i + root, x.dtype) for i in range(n)] if rank == root else None
            dist.scatter(x, ins, src=root)
            return x, np.full(m, rank + root)
        if opname == "all_gather":
            x[:] = rank + 1
            dist.all_gather_into_tensor(out, x)
            return out, np.repeat(np.arange(1, n + 1), m)
        x[:] = np.arange(m)  # reduce_scatter: x holds n blocks
        got = np.zeros(m // n, x.dtype)
        dist.reduce_scatter_tensor(got, x)
        return got, n * np.arange(m)[rank * (m // n) : (rank + 1) * (m // n)]

    def reshape(size, dtype):
        """x (and out) changed in place: the same objects, another size or dtype."""
        x.resize(size, refcheck=False)
        out.resize(size * n, refcheck=False)
        x.dtype = out.dtype = dtype

    bad = []
    for size, dtype, root in [(4, "float32", 0), (4, "int32", 1), (8, "float32", 0)] * 3 + [
        (4, "float32", 1)
    ]:
        reshape(size * n, dtype)
        for long in [False, True] if opname.startswith("all_to_all") and calls >= 6 else [False]:
            got, want = call(root % n, long)
            if not np.array_equal(got, want.astype(got.dtype)):
                got, want = got[:64], want[:64]
                bad.append(f"{size} x {dtype} root {root} long {long}: {got.tolist()} != {want.tolist()}")
    # the calls repeated, so every operation made plans (all_gather and reduce_scatter
    # run as their *_tensor forms)
    plans = [key[0] for key in resolve_group(None).fast_channel._small]
    if not {opname, opname + "_tensor", opname + "_into_tensor"} & set(plans):
        bad.append(f"no plan of {opname} was made (plans: {plans})")
    if bad:
        result(False, "; ".join(bad))
    if rank == 1:
        if what == "size":
            reshape(x.size + n, x.dtype)
        elif what == "dtype":
            reshape(x.size, np.int32)
    where = "call"
    try:
        call(1 if rank == 1 and what == "root" else 0)
        where = "next call"
        dist.barrier()
        result(False, "no error in the call nor in the next one")
    except dist.CollectiveMismatchError as e:
        result(True, f"CollectiveMismatchError in the {where}: {e}")
    except Exception as e:
        result(False, f"{type(e).__name__} instead of CollectiveMismatchError: {e}")
else:
    raise SystemExit(f"unknown mode {mode}")
