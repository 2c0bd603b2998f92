"""Head mode over SSH (the real sshd of tests/sshd.py on 127.0.0.2 and 127.0.0.3): round
0 planned by the head gives the workers the MASTER_PORT node 0's agent would choose."""

import json

from conftest import WORKERS, dl
from ports import free_ports
from sshd import sshd_hosts  # noqa: F401  (session fixture)
from test_head import head_args


def test_master_port_of_a_single_remote_host(sshd_hosts, tmp_path):  # noqa: F811
    """One remote host and --master-port: its workers get that port (as the node agent
    gives a single node), not a free port of the head's choosing."""
    port = free_ports(1)[0]
    res = dl(
        *head_args(sshd_hosts, "node1:2"),
        "--master-port",
        port,
        WORKERS / "actor.py",
        "--dump-env",
        tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [e["MASTER_PORT"] for e in envs] == [str(port)] * 2
