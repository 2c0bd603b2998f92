"""Windows of Irecv posted before their messages came, as osu_bw posts them, and what
must stop a receive from taking the next message of its sender's ring: receives of
another tag first (the messages of each tag in order), ANY_TAG, a too small buffer in
the middle of a window (ERR_TRUNCATE for that one only), a cancelled receive, Test /
Testany / Waitany / Waitsome over a window, a blocking Recv behind posted receives, and
receives of one sender posted before ANY_SOURCE ones; a window taken as one run while
messages of another tag or sender sit between its messages (posted before and after
they came), a cancelled receive inside a Waitall's run, Waitall over sends and
receives mixed, one window of receives from the senders in turn, rounds of windows
whose runs cross a small ring's end (ANY_TAG or a tag, Statuses or none). 2 or 3 ranks: rank 0
receives and prints, the others send; every window is posted before the senders are
let go (a Barrier) unless said otherwise."""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
senders = list(range(1, size))


def show(*what):
    print(*what, flush=True)


def go():
    """Let the senders send what rank 0 has posted receives for."""
    comm.Barrier()


def sent(k, tag, n):
    return np.full(n, (7 * k + tag) & 0xFF, np.uint8)


def got(buf, st):
    n = st.Get_count(MPI.BYTE)
    return f"src {st.Get_source()} tag {st.Get_tag()} n {n} first {int(buf[0]) if n else None}"


# 1. tags 1, 2, 1, 2, ...: posted in that order, sent as all of tag 2 then all of tag 1
K = 6
if rank == 0:
    bufs = [np.zeros(32, np.uint8) for _ in range(K)]
    reqs = [comm.Irecv([b, 32, MPI.BYTE], 1, 1 + k % 2) for k, b in enumerate(bufs)]
    go()
    sts = [MPI.Status() for _ in range(K)]
    MPI.Request.Waitall(reqs, sts)
    for k in range(K):
        show("mixed", k, got(bufs[k], sts[k]))
else:
    go()
    if rank == 1:
        for tag in (2, 1):
            for k in range(K // 2):
                comm.Send(sent(k, tag, 8 + k), 0, tag)

# 2. ANY_TAG window, then a too small buffer in the middle of a window
if rank == 0:
    bufs = [np.zeros(16, np.uint8) for _ in range(4)]
    reqs = [comm.Irecv([b, 16, MPI.BYTE], 1, MPI.ANY_TAG) for b in bufs]
    go()
    sts = [MPI.Status() for _ in range(4)]
    MPI.Request.Waitall(reqs, sts)
    for k in range(4):
        show("anytag", k, got(bufs[k], sts[k]))
    sizes = [16, 16, 4, 16]
    bufs = [np.zeros(16, np.uint8) for _ in range(4)]
    reqs = [comm.Irecv([b, n, MPI.BYTE], 1, 3) for b, n in zip(bufs, sizes)]
    go()
    for k, r in enumerate(reqs):
        st = MPI.Status()
        try:
            r.Wait(st)
            show("trunc", k, got(bufs[k], st))
        except MPI.Exception as e:
            show("trunc", k, "error class", e.Get_error_class() == MPI.ERR_TRUNCATE)
else:
    go()
    if rank == 1:
        for k in range(4):
            comm.Send(sent(k, 10 + k, 4 + k), 0, 10 + k)
    go()
    if rank == 1:
        for k in range(4):
            comm.Send(sent(k, 3, 12), 0, 3)

# 3. a cancelled receive in the middle; Test, Testany, Waitany, Waitsome over a window
if rank == 0:
    bufs = [np.zeros(8, np.uint8) for _ in range(5)]
    reqs = [comm.Irecv([b, 8, MPI.BYTE], 1, 4) for b in bufs]
    reqs[1].Cancel()
    st = MPI.Status()
    show("cancelled status", reqs[1].Get_status(st), st.Is_cancelled())
    reqs[1].Wait(st)
    show("cancelled", st.Is_cancelled())
    go()
    while not reqs[0].Test():
        pass
    show("test", int(bufs[0][0]))
    idx, flag = MPI.Request.Testany(reqs[2:])
    while not flag:
        idx, flag = MPI.Request.Testany(reqs[2:])
    show("testany", idx, int(bufs[2 + idx][0]))
    done = []
    while len(done) < 2:
        i = MPI.Request.Waitany(reqs[2:])
        if i != MPI.UNDEFINED:
            done.append(int(bufs[2 + i][0]))
    show("waitany", sorted(done))
    bufs = [np.zeros(8, np.uint8) for _ in range(3)]
    reqs = [comm.Irecv([b, 8, MPI.BYTE], 1, 5) for b in bufs]
    go()
    seen = []
    while len(seen) < 3:
        seen += MPI.Request.Waitsome(reqs) or []
    show("waitsome", sorted(seen), [int(b[0]) for b in bufs])
else:
    go()
    if rank == 1:
        for k in range(4):
            comm.Send(sent(k, 4, 8), 0, 4)
    go()
    if rank == 1:
        for k in range(3):
            comm.Send(sent(k, 5, 8), 0, 5)

# 4. a blocking Recv behind posted receives of the same sender and tag, and of another
if rank == 0:
    bufs = [np.zeros(8, np.uint8) for _ in range(3)]
    reqs = [comm.Irecv([b, 8, MPI.BYTE], 1, 6) for b in bufs[:2]]
    go()
    r = np.zeros(8, np.uint8)
    st = MPI.Status()
    comm.Recv([r, 8, MPI.BYTE], 1, 6, st)  # the third message of tag 6
    show("blocking behind", got(r, st))
    comm.Recv([r, 8, MPI.BYTE], 1, 8, st)
    show("blocking other tag", got(r, st))
    MPI.Request.Waitall(reqs)
    show("window before it", [int(b[0]) for b in bufs[:2]])
else:
    go()
    if rank == 1:
        for k in range(3):
            comm.Send(sent(k, 6, 8), 0, 6)
        comm.Send(sent(9, 8, 8), 0, 8)

# 5. receives of the last sender posted first, then ANY_SOURCE ones for the rest
if rank == 0:
    n = 4 * len(senders)
    bufs = [np.zeros(8, np.uint8) for _ in range(n)]
    srcs = [senders[-1]] * 4 + [MPI.ANY_SOURCE] * (n - 4)
    reqs = [comm.Irecv([b, 8, MPI.BYTE], src, 9) for b, src in zip(bufs, srcs)]
    go()
    sts = [MPI.Status() for _ in range(n)]
    MPI.Request.Waitall(reqs, sts)
    per = {}
    for k, (b, st) in enumerate(zip(bufs, sts)):
        per.setdefault(st.Get_source(), []).append((k < 4, int(b[0])))
    for s in sorted(per):
        show("anysource from", s, per[s])
else:
    go()
    for k in range(4):
        comm.Send(sent(10 * rank + k, 9, 8), 0, 9)

# 6. a window of one sender and tag taken as a run while messages of another tag (same
# sender) and of another sender sit between its messages: posted before they came, and
# posted after they all arrived
for when in ("before", "after"):
    if rank == 0:
        bufs = [np.zeros(16, np.uint8) for _ in range(6)]
        if when == "before":
            reqs = [comm.Irecv([b, 16, MPI.BYTE], 1, 11) for b in bufs]
        go()
        go()  # every message is in place
        if when == "after":
            reqs = [comm.Irecv([b, 16, MPI.BYTE], 1, 11) for b in bufs]
        sts = [MPI.Status() for _ in range(6)]
        MPI.Request.Waitall(reqs, sts)
        show("interleaved", when, [got(b, st) for b, st in zip(bufs, sts)])
        r = np.zeros(16, np.uint8)
        st = MPI.Status()
        for _ in range(2):
            comm.Recv([r, 16, MPI.BYTE], 1, 12, st)
            show("interleaved", when, "other tag", got(r, st))
        for s in senders[1:]:
            for _ in range(3):
                comm.Recv([r, 16, MPI.BYTE], s, 11, st)
                show("interleaved", when, "other sender", got(r, st))
    else:
        go()
        for k in range(6):
            if rank == 1:
                comm.Send(sent(k, 11, 4 + k), 0, 11)
                if k in (1, 3):
                    comm.Send(sent(k, 12, 5), 0, 12)
            elif k < 3:
                comm.Send(sent(10 * rank + k, 11, 6), 0, 11)
        go()

# 7. a cancelled receive inside a window that one Waitall completes (with Statuses)
if rank == 0:
    bufs = [np.zeros(8, np.uint8) for _ in range(5)]
    reqs = [comm.Irecv([b, 8, MPI.BYTE], 1, 13) for b in bufs]
    reqs[2].Cancel()
    go()
    sts = [MPI.Status() for _ in range(5)]
    MPI.Request.Waitall(reqs, sts)
    show("cancelled in run", [st.Is_cancelled() for st in sts], [int(b[0]) for b in bufs])
else:
    go()
    if rank == 1:
        for k in range(4):
            comm.Send(sent(k, 13, 8), 0, 13)

# 8. Waitall over sends and receives mixed (ranks 0 and 1 exchange windows), with and
# without Statuses
for with_status in (False, True):
    if rank in (0, 1):
        peer = 1 - rank
        bufs = [np.zeros(8, np.uint8) for _ in range(4)]
        reqs = []
        for k in range(4):
            reqs.append(comm.Irecv([bufs[k], 8, MPI.BYTE], peer, 14))
            reqs.append(comm.Isend(sent(10 * rank + k, 14, 3 + k), peer, 14))
        if with_status:
            sts = [MPI.Status() for _ in reqs]
            MPI.Request.Waitall(reqs, sts)
            show("mixed waitall", rank, [got(bufs[k], sts[2 * k]) for k in range(4)])
        else:
            MPI.Request.Waitall(reqs)
            show("mixed waitall", rank, [int(b[0]) for b in bufs], all(not r for r in reqs))
    go()

# 9. one window of receives from the senders in turn (1, 2, 1, 2, ...; 1 only with 2
# ranks), Waitall without Statuses: a run of one sender's ring stops at the next
# sender's receive, whether that sender's message is there yet or not
for when in ("before", "after"):
    if rank == 0:
        srcs = [senders[k % len(senders)] for k in range(6)]
        bufs = [np.zeros(8, np.uint8) for _ in srcs]
        if when == "before":
            reqs = [comm.Irecv([b, 8, MPI.BYTE], s, 15) for b, s in zip(bufs, srcs)]
        go()
        go()  # every message is in place
        if when == "after":
            reqs = [comm.Irecv([b, 8, MPI.BYTE], s, 15) for b, s in zip(bufs, srcs)]
        MPI.Request.Waitall(reqs)
        show("senders in turn", when, [int(b[0]) for b in bufs], all(not r for r in reqs))
    else:
        go()
        for k in range(6 // len(senders)):
            comm.Send(sent(10 * rank + k, 15, 8), 0, 15)
        go()

# 10. rounds of a window of 16 from rank 1, sizes 1-128 bytes changing each round (with
# a 4 KiB ring, runs taken as the messages come cross its end), ANY_TAG or a tag,
# Waitall with Statuses or without: every payload, count and tag in place
ok = 0
for r in range(24):
    n, tag = 1 + (37 * r) % 128, 16 + r % 2
    if rank == 0:
        bufs = [np.zeros(130, np.uint8) for _ in range(16)]
        reqs = [comm.Irecv([b, 130, MPI.BYTE], 1, MPI.ANY_TAG if r % 3 == 0 else tag) for b in bufs]
        go()
        sts = [MPI.Status() for _ in reqs] if r % 2 else None
        MPI.Request.Waitall(reqs, sts)
        good = all((b[:n] == sent(r + k, tag, n)).all() and not b[n:].any() for k, b in enumerate(bufs))
        if sts:
            good = good and all(st.Get_count(MPI.BYTE) == n and st.Get_tag() == tag for st in sts)
        ok += good and all(not q for q in reqs)
    else:
        go()
        if rank == 1:
            MPI.Request.Waitall([comm.Isend(sent(r + k, tag, n), 0, tag) for k in range(16)])
if rank == 0:
    show("rounds across the ring's end", ok, "of 24")
