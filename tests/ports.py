"""Ports for tests to give the programs they start (``--master-port``, sshd, slurmctld).

A port found free here is bound later by another process, so something else may take it
in between. Under pytest-xdist (``-n N``) that something is most often a test in another
worker. There each worker takes its ports from a block of its own below Linux's ephemeral
range (32768-60999 by default, /proc/sys/net/ipv4/ip_local_port_range), where neither a
connect() nor a bind to port 0 ever lands, and below the ports distlaunch derives itself
(env.SLURM_PORTS and MPI_PORTS, 20000-31999, under srun and mpiexec): only a test of the
same worker could take one, and those run one at a time. Without xdist the kernel picks, as before.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Sequence

_BASE, _BLOCK = 10000, 1000  # worker gwK: ports 10000 + K*1000 ... + 999 (10 workers fit)
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
# successive picks walk the block; processes of one worker (a test's helper scripts)
# start at different places in it
_turn = itertools.count((os.getpid() * 7919) % _BLOCK)


def _bindable(port: int, hosts: Sequence[str]) -> bool:
    for host in hosts:
        try:
            with socket.socket() as s:
                s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(hosts: Sequence[str], taken: set[int]) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        if port not in taken and _bindable(port, hosts[1:]):
            return port
    raise RuntimeError(f"no port free on all of {', '.join(hosts)}")


def free_ports(n: int = 1, hosts: Sequence[str] = ("127.0.0.1",)) -> list[int]:
    """``n`` distinct ports that can be bound on every address of ``hosts`` right now."""
    taken: set[int] = set()
    if not _WORKER.startswith("gw"):
        for _ in range(n):
            taken.add(_kernel_port(hosts, taken))
        return sorted(taken)
    base = _BASE + int(_WORKER[2:]) * _BLOCK
    for _ in range(_BLOCK):
        port = base + next(_turn) % _BLOCK
        if port not in taken and _bindable(port, hosts):
            taken.add(port)
            if len(taken) == n:
                return sorted(taken)
    raise RuntimeError(f"fewer than {n} ports free in {base}-{base + _BLOCK - 1} on {', '.join(hosts)}")


def free_port(host: str = "127.0.0.1") -> int:
    """One port that can be bound on ``host`` right now."""
    return free_ports(1, (host,))[0]
