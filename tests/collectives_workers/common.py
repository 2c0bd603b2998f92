"""Helpers shared by the collectives test workers (run inside worker processes)."""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np

import distlaunch.collectives as dist

DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"]


def init(timeout=60.0, **kw):
    """init_process_group with the method the test harness chose (None under the launcher)."""
    if os.environ.get("COLL_TIMEOUT_TIMEDELTA"):
        import datetime

        timeout = datetime.timedelta(seconds=timeout)
    if os.environ.get("COLL_SKIP_INIT_RANK") == os.environ.get("RANK"):
        print("skipping init_process_group")
        sys.exit(0)
    import faulthandler

    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    if seconds >= 10:
        faulthandler.dump_traceback_later(seconds * 0.8)  # stacks, should init hang
    dist.init_process_group(init_method=os.environ.get("COLL_INIT_METHOD") or None, timeout=timeout, **kw)
    faulthandler.cancel_dump_traceback_later()
    return dist.get_rank(), dist.get_world_size()


def data(rank, dtype, size, seed=0, positive=False):
    """Deterministic input of ``rank``: small integers (exact in every dtype, so sums and
    products are order-independent) -- every rank can compute every other rank's input."""
    rng = np.random.default_rng(seed * 1009 + rank * 7919 + 17)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size).astype(bool)
    if positive:
        return rng.integers(1, 4, size).astype(dtype)
    lo = 0 if dtype.kind == "u" else -4
    return rng.integers(lo, 5 if dtype.kind != "u" else 250, size).astype(dtype)


def wrap(arr, use_torch):
    """The buffer handed to the API: the array itself or a torch tensor sharing its memory."""
    if not use_torch:
        return arr
    import torch

    return torch.from_numpy(arr)


class Failures:
    """Collects failing cases; ``exit()`` prints them and exits non-zero if any."""

    def __init__(self, rank):
        self.rank = rank
        self.items = []
        self.count = 0

    def check(self, name, got, want):
        """Arrays: same dtype, shape and values; anything else: ==."""
        self.count += 1
        if isinstance(want, np.ndarray):
            got = np.asarray(got)
            ok = got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
        else:
            ok = type(got) is type(want) and got == want
        if not ok:
            self.items.append(f"{name}: got {got!r} want {want!r}"[:600])

    def run(self, name, fn):
        try:
            fn()
        except Exception:
            self.items.append(f"{name}: raised\n{traceback.format_exc()}")
            self.exit()  # the group is unusable after a failure

    def exit(self):
        if (
            os.environ.get("COLL_EXPECT_SHM")
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and dist.GroupMember.WORLD.backend != "shm"
        ):
            self.items.append("COLL_EXPECT_SHM is set but the world group did not use shared memory")
        if self.items:
            print(f"rank {self.rank}: {len(self.items)} of {self.count} checks FAILED", file=sys.stderr)
            for item in self.items[:20]:
                print("FAILED " + item, file=sys.stderr)
            sys.stdout.flush()
            os._exit(1)
        print(f"rank {self.rank}: {self.count} checks passed")
