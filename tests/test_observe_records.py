"""distlaunch.observe.records and .table: per-rank records sampled from real processes
(psutil), published by several nodes through a real store and read back, and drawn as a
plain table, a rich table and JSON."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time

import pytest

from distlaunch.errors import StoreAuthError
from distlaunch.observe import records as R
from distlaunch.observe import table as T
from distlaunch.store.client import StoreClient
from distlaunch.store.server import StoreServer

TOKEN = "observe-test-token"


def rec(rank, node="n0", **kw):
    base = dict(pid=1000 + rank, state="running", cpu=12.34, rss=3 << 20, line_age=1.25, line=f"step {rank}")
    base.update(kw)
    return R.RankRecord(rank, node, **base)


def test_record_round_trip_and_bad_values():
    r = rec(3, op="all_reduce #1834, waiting for ranks 5,7", op_age=3.21, line="x" * 500)
    back = R.RankRecord.decode(json.loads(json.dumps(r.encode())))
    assert back == R.RankRecord(3, "n0", 1003, "running", 12.3, 3 << 20, 1.2, "x" * R.LINE_WIDTH, r.op, 3.2)
    assert R.RankRecord.decode(rec(0, line_age=None).encode()).line_age is None
    with pytest.raises(ValueError, match="not a rank record"):
        R.RankRecord.decode([1, 2])
    with pytest.raises(ValueError, match="node n1's records are not readable"):
        R.decode_node("n1", b"garbage")
    with pytest.raises(ValueError, match="record version 9"):
        R.decode_node("n1", b'{"v":9,"t":0,"r":[]}')


def test_sampler_reads_cpu_and_rss_of_real_processes():
    busy = subprocess.Popen([sys.executable, "-c", "x = bytearray(64 << 20)\nwhile 1: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    s = R.Sampler()
    try:
        pids = {0: busy.pid, 1: idle.pid, 2: gone.pid}
        first = s.sample(pids)
        assert first[2] is None
        deadline = time.monotonic() + 20
        while True:  # the busy one's 64 MiB becomes resident once allocated, and it runs;
            # the idle one is asleep once its interpreter has started (slow under load)
            time.sleep(0.5)
            got = s.sample(pids)
            b, i = got[0], got[1]
            settled = b is not None and i is not None and b.rss > 64 << 20 and b.cpu > 1.0 > i.cpu
            if settled or time.monotonic() > deadline:
                break
        assert got[0] is not None and got[1] is not None
        assert got[0].rss > 64 << 20 > got[1].rss > 0
        # the busy one spins (its share depends on the load), the idle one sleeps
        assert got[0].cpu > 1.0 > got[1].cpu, got
        idle.kill()
        idle.wait()
        assert s.sample(pids)[1] is None
    finally:
        busy.kill()
        busy.wait()
        idle.kill()
        idle.wait()


@pytest.fixture
def store():
    with StoreServer(token=TOKEN) as server:
        host, port = server.address
        yield host, port


def test_nodes_publish_and_a_viewer_reads_every_rank(store):
    host, port = store
    with StoreClient(host, port, token=TOKEN, timeout=10) as viewer:
        assert R.read_records(viewer, "job1/top") == []
        pubs = []
        for n in range(3):
            c = StoreClient(host, port, token=TOKEN, timeout=10)
            pubs.append((c, R.Publisher(c.prefixed("job1"), "top", f"node{n}")))
        for n, (_, p) in enumerate(pubs):
            p.publish([rec(2 * n, f"node{n}"), rec(2 * n + 1, f"node{n}")], now=100.0 + n)
        pubs[1][1].publish([rec(2, "node1", state="exited 1"), rec(3, "node1")], now=200.0)
        for c, _ in pubs:
            c.ping()  # the sets are applied before the viewer reads
        nodes = R.read_records(viewer, "job1/top")
        assert [(n.node, n.time) for n in nodes] == [("node0", 100.0), ("node1", 200.0), ("node2", 102.0)]
        ranks = R.all_records(nodes)
        assert [(r.rank, r.node, r.state) for r in ranks] == [
            (0, "node0", "running"),
            (1, "node0", "running"),
            (2, "node1", "exited 1"),
            (3, "node1", "running"),
            (4, "node2", "running"),
            (5, "node2", "running"),
        ]
        assert R.read_records(viewer, "job2/top") == []
        for c, _ in pubs:
            c.close()
    with pytest.raises(StoreAuthError):
        StoreClient(host, port, token="wrong", timeout=2)  # a viewer needs the job's token
    with pytest.raises(ValueError, match="must be one non-empty line"):
        R.Publisher(None, "p", "a\nb")  # type: ignore[arg-type]


RECORDS = [
    rec(0, cpu=99.5, rss=1536 << 20, op="all_reduce #1834, waiting for ranks 5,7", op_age=3.2),
    rec(1, state="exited 1", line="[red]Traceback[/red] " + "y" * 300),
]


def test_plain_table_aligns_and_cuts_to_width():
    text = T.plain_table(RECORDS, width=140)
    lines = text.splitlines()
    assert lines[0].split() == [
        "RANK",
        "NODE",
        "PID",
        "STATE",
        "CPU%",
        "RSS",
        "OP",
        "OUT",
        "AGE",
        "LAST",
        "LINE",
    ]
    assert lines[1].split()[:6] == ["0", "n0", "1000", "running", "99.5", "1.5"]
    assert "all_reduce #1834, waiting for ranks 5,7, 3.2 s" in lines[1]
    assert lines[1].index("step 0") == lines[0].index("LAST LINE")  # columns line up
    assert lines[2].index("[red]Traceback") == lines[0].index("LAST LINE")
    assert max(len(ln) for ln in lines) == 140
    assert max(len(ln) for ln in T.plain_table(RECORDS, width=60).splitlines()) == 60
    assert T.human_bytes(512) == "512 B" and T.human_bytes(3 << 30) == "3.0 GiB"


def test_print_table_picks_rich_plain_or_json():
    plain, rich, js = io.StringIO(), io.StringIO(), io.StringIO()
    T.print_table(RECORDS, file=plain, width=120)  # a StringIO is not a terminal
    assert plain.getvalue() == T.plain_table(RECORDS, 120) + "\n"
    T.print_table(RECORDS, file=rich, terminal=True, width=200)
    out = rich.getvalue()
    assert "\x1b[" in out and "exited 1" in out
    assert "[red]Traceback[/red]" in out, "a worker's line is shown as printed, not as markup"
    for width in (200, 80):  # every column stays, and no line is wider than the terminal
        buf = io.StringIO()
        T.print_table(RECORDS, file=buf, terminal=True, width=width)
        lines = re.sub("\x1b\\[[0-9;]*m", "", buf.getvalue()).splitlines()
        assert lines[0].split() == [
            "RANK",
            "NODE",
            "PID",
            "STATE",
            "CPU%",
            "RSS",
            "OP",
            "OUT",
            "AGE",
            "LAST",
            "LINE",
        ]
        assert max(len(ln) for ln in lines) <= width
        assert lines[1].split()[:6] == ["0", "n0", "1000", "running", "99.5", "1.5"]
    T.print_table(RECORDS, file=js, as_json=True)
    data = json.loads(js.getvalue())
    assert [d["rank"] for d in data] == [0, 1] and data[0]["rss"] == 1536 << 20 and data[1]["op"] is None
