"""Head-mode start-up over SSH, side by side: ``distlaunch run -H`` vs MPICH's
``mpiexec -launcher ssh`` (hydra), at 2 to 16 hosts with one no-op Python worker each.

    python benchmarks/bench_head.py [--hosts 2,4,8,16] [--reps 5]

The hosts are loopback aliases 127.0.0.2, 127.0.0.3, ... served by one real sshd that
this script starts (tests/sshd.py, the test suite's sshd; needs root and openssh-server),
so both launchers pay for real SSH connections, key exchanges and remote interpreters.
Both use the same OpenSSH client config (port, key, known hosts); hydra reaches it
through a two-line ``ssh -F`` wrapper. Runs interleave so machine noise hits both alike.
Prints the median wall time of each and the ratio distlaunch / hydra (lower is better).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from sshd import _stop, start_sshd  # noqa: E402  (the tests' sshd helper)

BIN = os.path.dirname(sys.executable)
FIRST = 4  # 127.0.0.2 and .3 are the test sshd's own addresses


def free_port(addresses: list[str]) -> int:
    """A port free on every address."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for a in addresses[1:]:
                with socket.socket() as t:
                    t.bind((a, port))
            return port
        except OSError:
            continue
    raise SystemExit("no port free on every loopback alias")


def setup(base: Path, n: int):
    """Start sshd on 127.0.0.2 .. 127.0.0.(n+1) and write the client side (sshd listens
    on at most 16 sockets: the test helper's own two, 127.0.0.2 and .3, count)."""
    extra = [f"127.0.0.{FIRST + i}" for i in range(max(0, n - 2))]
    port = free_port(extra) if extra else 0
    server = start_sshd(base, extra=tuple(f"ListenAddress {a}:{port}" for a in extra))
    addrs = [*server.addresses, *extra][:n]
    ports = {a: server.port for a in server.addresses} | {a: port for a in extra}
    key_line = " ".join(server.host_key_pub.split()[:2])
    known = base / "bench_known_hosts"
    known.write_text("".join(f"[{a}]:{ports[a]} {key_line}\n" for a in addrs))
    config = base / "bench_ssh_config"
    port_line = f"    Port {port}\n" if extra else ""  # no aliases beyond sshd's own two
    config.write_text(
        f"Host {' '.join(server.addresses)}\n    Port {server.port}\n"
        f"Host 127.0.0.*\n{port_line}    User root\n"
        f"    IdentityFile {server.key_file}\n"
        f"    IdentitiesOnly yes\n    BatchMode yes\n    UserKnownHostsFile {known}\n"
        f"    StrictHostKeyChecking yes\n"
    )
    wrapper = base / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec ssh -F {config} "$@"\n')
    wrapper.chmod(0o755)
    for a in addrs:  # wait until every alias answers
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection((a, ports[a]), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"sshd does not answer on {a}:{port}")
            time.sleep(0.05)
    return server, addrs, config, wrapper


def commands(addrs: list[str], config: Path, wrapper: Path, script: Path) -> dict[str, list[str]]:
    return {
        "distlaunch": [
            os.path.join(BIN, "distlaunch"), "run", "-H", ",".join(f"{a}:1" for a in addrs),
            "--ssh-config", str(config), str(script),
        ],
        "hydra": [
            os.path.join(BIN, "mpiexec"), "-launcher", "ssh", "-launcher-exec", str(wrapper),
            "-hosts", ",".join(addrs), "-n", str(len(addrs)), "-ppn", "1", sys.executable, str(script),
        ],
    }  # fmt: skip


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    if res.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({res.returncode}): {res.stderr.strip()[-500:]}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="2,4,8,16", help="host counts to measure (comma-separated)")
    ap.add_argument("--reps", type=int, default=5, help="runs per launcher and host count")
    args = ap.parse_args()
    counts = [int(c) for c in args.hosts.split(",")]
    if not os.path.exists(os.path.join(BIN, "mpiexec")):
        raise SystemExit("mpiexec not found next to this interpreter: pip install mpich")
    with tempfile.TemporaryDirectory(prefix="bench_head_") as tmp:
        base = Path(tmp)
        script = base / "noop.py"
        script.write_text("pass\n")
        server, addrs, config, wrapper = setup(base / "sshd", max(counts))
        try:
            print(f"{'hosts':>5}  {'distlaunch s':>12}  {'hydra s':>8}  {'ratio':>6}")
            for n in counts:
                cmds = commands(addrs[:n], config, wrapper, script)
                times: dict[str, list[float]] = {k: [] for k in cmds}
                for _ in range(args.reps):
                    for k, c in cmds.items():
                        times[k].append(timed(c))
                ours, theirs = (statistics.median(times[k]) for k in ("distlaunch", "hydra"))
                print(f"{n:>5}  {ours:>12.3f}  {theirs:>8.3f}  {ours / theirs:>5.2f}x", flush=True)
        finally:
            _stop(server.process)


if __name__ == "__main__":
    main()
