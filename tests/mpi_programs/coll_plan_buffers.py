"""Repeated buffer collectives (distlaunch's plans of repeated calls) on the
byte-indexed buffer types that the plans slice without a memoryview (bytearray, mmap,
bytes as a send buffer), at block sizes around the plans' 4 KiB limit for that, as
``[buf, count, MPI.BYTE]`` and ``[buf, (count, displ), MPI.BYTE]``, every result
checked; then what must leave the plan for the general path: a bytearray grown
between calls, a closed mmap, and a read-only mmap the program made where a freed
receive mmap was (the same id: the general path refuses it before anything moves,
and the communicator stays usable). Prints one line per rank. Not an mpi4py demo:
`bytes` sends and the read-only case print distlaunch's own error names."""

import mmap

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
me, n = comm.Get_rank(), comm.Get_size()
bad = []
KINDS = ("bytearray", "mmap", "bytes")  # bytes: send buffers only (values fixed)


def make(kind, size, fill=None):
    """A buffer of ``kind`` holding ``size`` bytes (``fill``: its bytes, else zeros)."""
    data = bytes(size) if fill is None else bytes(fill)
    if kind == "bytes":
        return data
    if kind == "bytearray":
        return bytearray(data)
    m = mmap.mmap(-1, max(size, 1))
    m[:size] = data
    return m


def val(src, m, salt, dst=0):
    return ((np.arange(m) * 7 + salt * 13 + src * 31 + dst * 5) % 251).astype(np.uint8)


def got(buf, lo, m):
    return np.frombuffer(buf, np.uint8)[lo : lo + m]


for kind in KINDS:
    for m in (1, 13, 4096, 4097):
        for at in (0, 3):  # the first element of the block (3: a displaced spec)

            def spec(b, _at=at, _m=m):
                return [b, (_m, _at), MPI.BYTE] if _at else [b, _m, MPI.BYTE]

            tag = f"{kind} {m} at {at}"
            rk = "bytearray" if kind == "bytes" else kind  # receive buffers
            # each call repeats 4 times with the same buffers (the plan runs from the
            # second); bytes keep their values, the writable kinds change them
            sal = 0
            fixed = kind == "bytes"
            root = m % n
            # Bcast: the root sends from kind, the others receive into rk
            src = make(kind, at + m, np.concatenate([np.zeros(at, np.uint8), val(root, m, 1)]).tobytes())
            dst = make(rk, at + m)
            for i in range(4):
                salt = 1 if fixed else 1 + i
                if me == root and not fixed:
                    src[at : at + m] = val(root, m, salt).tobytes()
                b = src if me == root else dst
                comm.Bcast(spec(b), root)
                if (got(b, at, m) != val(root, m, salt)).any():
                    bad.append(f"bcast {tag} {i}")
            # Gather and Allgather
            s = make(kind, at + m, np.concatenate([np.zeros(at, np.uint8), val(me, m, 2)]).tobytes())
            r = make(rk, at + m * n)
            for i in range(4):
                salt = 2 if fixed else 2 + i
                if not fixed:
                    s[at : at + m] = val(me, m, salt).tobytes()
                comm.Gather(spec(s), spec(r) if me == root else None, root)
                if me == root and any((got(r, at + j * m, m) != val(j, m, salt)).any() for j in range(n)):
                    bad.append(f"gather {tag} {i}")
                r[:] = bytes(len(r))
                comm.Allgather(spec(s), spec(r))
                if any((got(r, at + j * m, m) != val(j, m, salt)).any() for j in range(n)):
                    bad.append(f"allgather {tag} {i}")
            # Scatter (the root also IN_PLACE) and Alltoall: block j for rank j
            blocks = np.concatenate([np.zeros(at, np.uint8)] + [val(me, m, 3, j) for j in range(n)]).tobytes()
            s = make(kind, at + m * n, blocks)
            r = make(rk, at + m * n)
            for i in range(4):
                salt = 3 if fixed else 3 + i
                if not fixed:
                    s[at:] = np.concatenate([val(me, m, salt, j) for j in range(n)]).tobytes()
                comm.Scatter(spec(s) if me == root else None, spec(r), root)
                if (got(r, at, m) != val(root, m, salt, me)).any():
                    bad.append(f"scatter {tag} {i}")
                if not fixed:  # IN_PLACE at the root: its own block stays where it is
                    if me == root:
                        comm.Scatter(spec(s), MPI.IN_PLACE, root)
                        mine = got(s, at + me * m, m)
                    else:
                        r[:] = bytes(len(r))
                        comm.Scatter(None, spec(r), root)
                        mine = got(r, at, m)
                    if (mine != val(root, m, salt, me)).any():
                        bad.append(f"scatter in place {tag} {i}")
                comm.Alltoall(spec(s), spec(r))
                if any((got(r, at + j * m, m) != val(j, m, salt, me)).any() for j in range(n)):
                    bad.append(f"alltoall {tag} {i}")
print(f"{me} planned {'ok' if not bad else bad[:5]}", flush=True)

# -- a bytearray grown between repeated calls: the call after it runs on its new bytes
ba = bytearray(8)
out = bytearray(8 * n)
for i in range(3):
    ba[:] = bytes([i + me]) * 8
    comm.Allgather(ba, out)
ba.extend(bytes([40 + me]) * 4)
out2 = bytearray(12 * n)
comm.Allgather(ba, out2)
grown = list(out[::8]) + list(out2[8::12])

# -- a closed mmap after repeated calls: the general path's error, before anything moves
cm = mmap.mmap(-1, 8 * n)
for _ in range(3):
    comm.Allgather([ba, 8, MPI.BYTE], [cm, 8, MPI.BYTE])
cm.close()
try:
    comm.Allgather([ba, 8, MPI.BYTE], [cm, 8, MPI.BYTE])
    closed = "no error"
except Exception as e:  # noqa: BLE001  (which error is what this prints)
    closed = type(e).__name__
comm.Barrier()

# -- a read-only mmap made where a freed receive mmap was (the same id): refused by the
# general path (MPIException) on every rank, before anything moves
for _ in range(10):  # (until every rank's new mmap has the id: CPython reuses the memory)
    rw = mmap.mmap(-1, 8 * n)
    spec_ = [rw, 8, MPI.BYTE]
    for _ in range(3):
        comm.Allgather([ba, 8, MPI.BYTE], spec_)
    old = id(rw)
    del spec_, rw
    ro = mmap.mmap(-1, 8 * n, access=mmap.ACCESS_READ)
    same = all(comm.allgather(id(ro) == old))
    if same:
        break
try:
    comm.Allgather([ba, 8, MPI.BYTE], [ro, 8, MPI.BYTE])
    readonly = "no error"
except Exception as e:  # noqa: BLE001
    readonly = type(e).__name__
comm.Barrier()
after = bytearray(n)
comm.Allgather(bytearray([me]), after)
print(
    f"{me} fallbacks grown {grown} closed {closed} readonly {readonly} same id {same} usable {list(after)}",
    flush=True,
)
