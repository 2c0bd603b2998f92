"""Elastic membership with --nnodes MIN:MAX (per-node launches on this machine): a node
that joins mid-run triggers a new round (not a restart); a lost node is dropped while at
least MIN remain."""

import json
import socket
import time

from conftest import WORKERS, dl_popen
from test_pernode import finish, free_port
from test_supervision import wait_for

CONF = "last_call_timeout=0.5,heartbeat_timeout=3,heartbeat_interval=0.2"


def node(endpoint, nnodes, *args):
    return dl_popen(
        "run",
        "--nnodes",
        nnodes,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "el",
        "--rdzv-conf",
        CONF,
        "--nproc-per-node",
        1,
        WORKERS / "actor.py",
        *args,
    )


def test_late_joiner_starts_a_new_round_not_a_restart(tmp_path):
    ep = f"127.0.0.1:{free_port()}"
    first = [node(ep, "2:3", "--dump-env", tmp_path, "--mark-dir", tmp_path, "--sleep", "6")]
    time.sleep(0.2)
    first.append(node(ep, "2:3", "--dump-env", tmp_path, "--mark-dir", tmp_path, "--sleep", "6"))
    assert wait_for(lambda: (tmp_path / "started.0.0").exists() and (tmp_path / "started.1.0").exists(), 30)
    late = node(ep, "2:3", "--dump-env", tmp_path, "--sleep", "6")
    results = finish([*first, late], timeout=90)
    assert [r[2] for r in results] == [0, 0, 0], results
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
    assert "a node joined: new rendezvous round 1 (not a restart)" in results[0][1]


def _listening(endpoint: str) -> bool:
    """Whether something accepts connections at ``endpoint`` (host:port)."""
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def test_lost_node_dropped_while_min_remain(tmp_path):
    ep = f"127.0.0.1:{free_port()}"
    procs = []
    for _ in range(3):
        procs.append(node(ep, "2:3", "--dump-env", tmp_path, "--mark-dir", tmp_path, "--sleep", "8"))
        assert wait_for(lambda: _listening(ep), 30)  # the first one hosts the store
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(3)), 30)
    procs[2].kill()  # not the first launcher, which hosts the store
    results = finish(procs[:2], timeout=90)
    assert [r[2] for r in results] == [0, 0], results
    assert "continuing with 2 node(s)" in results[0][1]
    assert {json.loads((tmp_path / f"{r}.json").read_text())["WORLD_SIZE"] for r in range(2)} == {"2"}


def test_lost_node_below_min_stops_with_clear_error(tmp_path):
    ep = f"127.0.0.1:{free_port()}"
    procs = [node(ep, "2:3", "--mark-dir", tmp_path, "--sleep", "60")]
    # the first one hosts the store (a fixed head start lost to the second under load:
    # killing that one then lost the store, not a node)
    assert wait_for(lambda: _listening(ep), 30)
    procs.append(node(ep, "2:3", "--mark-dir", tmp_path, "--sleep", "60"))
    assert wait_for(lambda: all((tmp_path / f"started.{r}.0").exists() for r in range(2)), 30)
    procs[1].kill()
    out, err, code = finish(procs[:1], timeout=60)[0]
    assert code == 1
    assert "1 node(s) remain, fewer than the minimum 2" in err


def test_events_file_and_round_lines(tmp_path):
    from conftest import dl

    logs = tmp_path / "logs"
    res = dl(
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--run-id",
        "ev",
        "--log-dir",
        logs,
        WORKERS / "actor.py",
        "--fail-rank",
        "1",
        "--fail-code",
        "3",
        "--fail-attempts",
        "1",
    )
    assert res.returncode == 0, res.stderr
    events = [json.loads(ln) for ln in (logs / "ev" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["round"]) for e in events] == [
        ("round", 0),
        ("round_end", 0),
        ("round", 1),
        ("round_end", 1),
    ]
    assert [e["restart_count"] for e in events if e["event"] == "round"] == [0, 1]
    first_end = events[1]["cause"]
    assert first_end["kind"] == "failure" and first_end["failure"]["rank"] == 1
    assert first_end["failure"]["returncode"] == 3 and events[3]["cause"] is None
    assert "round 1: 1 node(s) [" in res.stderr and "restart count 1" in res.stderr
