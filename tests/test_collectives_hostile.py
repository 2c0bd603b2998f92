"""The collectives TCP transport facing outsiders on the network: what a connecting rank
sends never contains the group secret, outsiders get nothing and are disconnected,
unauthenticated connections are capped and timed out, and neither idle connections nor
running out of file descriptors makes the progress thread spin.

Real worker processes (tests/collectives_workers/hostile.py, TCP only, file store); the
test plays the attacker with plain sockets, and reads/writes the file store as any
authenticated store client could (to learn or redirect a rank's transport address).
"""

import os
import queue
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402

from distlaunch.collectives.filestore import FileStore  # noqa: E402
from distlaunch.collectives.wire import MAGIC  # noqa: E402

# the header layout of wire.py, spelled out so the old-format attempts do not depend on it
_HEADER = struct.Struct("<4sBBBBIIqIiQQ")
_HELLO, _COLL = 1, 2
_TICK = os.sysconf("SC_CLK_TCK")


class World:
    """``n`` hostile.py ranks on a fresh file store; ``ready[r]`` = (pid, (host, port),
    store prefix, secret str). Kills whatever is left on exit."""

    def __init__(self, n, env=None, timeout=30.0):
        self.n = n
        self.tmp = tempfile.mkdtemp(prefix="colltest-hostile-")
        self.store_path = os.path.join(self.tmp, "store")
        self.lines = queue.Queue()
        self.procs = []
        port = launch.free_port()
        for r in range(n):
            e = launch.rank_env(r, n, port, f"file://{self.store_path}", env)
            e["DISTLAUNCH_SHM"] = "0"
            p = subprocess.Popen(
                [sys.executable, os.path.join(launch.WORKERS, "hostile.py")],
                env=e,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=launch.REPO,
            )
            self.procs.append(p)
            threading.Thread(target=self._pump, args=(r, p), daemon=True).start()
        self.ready = {}
        self.log = []
        deadline = time.monotonic() + timeout
        while len(self.ready) < n:
            line = self._line(deadline)
            if line.startswith("READY "):
                _, rank, pid, addr, prefix, secret = line.split()
                host, _, port = addr.rpartition(":")
                self.ready[int(rank)] = (int(pid), (host, int(port)), prefix, secret)

    def _pump(self, r, p):
        for line in p.stdout:
            self.lines.put(line.rstrip("\n"))

    def _line(self, deadline):
        try:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("workers silent; output so far:\n" + "\n".join(self.log)) from None
        self.log.append(line)
        return line

    def go(self, timeout=20.0):
        """One all_reduce on every rank; returns {rank: "DONE <sum>" or "FAIL ..."}."""
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.n:
            line = self._line(deadline)
            word, _, rest = line.partition(" ")
            if word in ("DONE", "FAIL"):
                rank, _, text = rest.partition(" ")
                results[int(rank)] = f"{word} {text}"
        return results

    def expect_go(self):
        want = f"DONE {self.n * (self.n + 1) // 2}"
        results = self.go()
        assert results == {r: want for r in range(self.n)}, "\n".join(self.log)

    def cpu_seconds(self, rank):
        with open(f"/proc/{self.ready[rank][0]}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime

    def open_fds(self, rank):
        return len(os.listdir(f"/proc/{self.ready[rank][0]}/fd"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _connect(addr):
    s = socket.create_connection(addr, timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT pile-up
    return s


def _read_until_closed(s, timeout):
    """Everything the peer sends until it closes the connection; None if still open
    after ``timeout`` seconds."""
    s.settimeout(timeout)
    got = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        return got


def _cpu_share(world, rank, seconds=2.0):
    """Fraction of one core the rank's process used over ``seconds``."""
    c0, t0 = world.cpu_seconds(rank), time.monotonic()
    time.sleep(seconds)
    return (world.cpu_seconds(rank) - c0) / (time.monotonic() - t0)


def test_outsiders_get_nothing_and_are_disconnected():
    with World(2) as w:
        addr, secret = w.ready[0][1], w.ready[0][3].encode()
        wrong = b"0" * len(secret)
        attempts = {
            "old hello, wrong secret": _HEADER.pack(b"DLC1", _HELLO, 0, 0, 0, 1, 0, 0, 0, -1, 0, len(wrong))
            + wrong,
            "old hello, no secret": _HEADER.pack(b"DLC1", _HELLO, 0, 0, 0, 1, 0, 0, 0, -1, 0, 0),
            "data without hello": _HEADER.pack(b"DLC1", _COLL, 11, 4, 0, 1, 0, 1, 0, -1, 1, 8) + b"\0" * 8,
            "garbage": os.urandom(200),
        }
        for name, data in attempts.items():
            with _connect(addr) as s:
                s.sendall(data)
                got = _read_until_closed(s, 5.0)
                assert got == b"", f"{name}: the rank answered {got!r}" if got else f"{name}: still open"
        # a forged collective message after a wrong hello must not have reached a receive
        w.expect_go()


class _Recorder:
    """A TCP proxy in front of ``target``: forwards both directions and records every
    byte, as anyone on the path could."""

    def __init__(self, target):
        self.target = target
        self.data = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while chunk := src.recv(65536):
                with self.lock:
                    self.data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_wrong_proof_is_disconnected():
    """An outsider that speaks the current handshake but cannot prove the secret gets a
    nonce and the acceptor's proof (useless to it), then is disconnected."""
    with World(2) as w:
        with _connect(w.ready[0][1]) as s:
            s.sendall(_HEADER.pack(MAGIC, _HELLO, 0, 0, 0, 1, 0, 0, 0, 0, 0, 16) + os.urandom(16))
            s.settimeout(5)
            reply = b""
            while len(reply) < _HEADER.size + 48:
                chunk = s.recv(4096)
                assert chunk, f"closed after {reply!r}"
                reply += chunk
            # a forged proof, then a collective message riding on it
            s.sendall(
                _HEADER.pack(MAGIC, _HELLO, 0, 0, 0, 1, 0, 0, 2, 0, 0, 32)
                + os.urandom(32)
                + _HEADER.pack(MAGIC, _COLL, 11, 4, 0, 1, 0, 1, 0, -1, 1, 8)
                + b"\0" * 8
            )
            assert _read_until_closed(s, 5.0) == b""
        w.expect_go()


def test_connector_refuses_an_impostor_listener():
    """A listener that does not know the secret (here: an address swapped in the store)
    never sees the secret nor any data: the connecting rank checks the acceptor's proof
    first and fails with PeerLostError."""
    seen = bytearray()
    impostor = socket.create_server(("127.0.0.1", 0))

    def serve():
        try:
            c, _ = impostor.accept()
        except OSError:
            return
        with c:
            c.settimeout(10)
            try:
                while len(seen) < _HEADER.size + 16:
                    seen.extend(c.recv(4096) or b"x" * 1000)
                c.sendall(_HEADER.pack(MAGIC, _HELLO, 0, 0, 0, 0, 0, 0, 1, 1, 0, 48) + os.urandom(48))
                while chunk := c.recv(4096):
                    seen.extend(chunk)
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with World(2, env={"COLL_GROUP_TIMEOUT": "3"}) as w:
            prefix, secret = w.ready[0][2], w.ready[0][3]
            store = FileStore(w.store_path)
            store.set(f"{prefix}addr/0", f"127.0.0.1:{impostor.getsockname()[1]}".encode())
            store.close()
            results = w.go()
            assert results[1].startswith("FAIL PeerLostError") and "secret" in results[1], results
            t.join(10)
    finally:
        impostor.close()
    assert len(seen) == _HEADER.size + 16, f"the rank sent more than its hello: {bytes(seen)!r}"
    assert secret.encode() not in seen


def test_secret_never_crosses_the_wire():
    with World(2) as w:
        prefix, secret = w.ready[0][2], w.ready[0][3]
        proxies = [_Recorder(w.ready[r][1]) for r in range(2)]
        try:
            # redirect both ranks' published addresses through the recorders (before the
            # first operation, which is when ranks look them up)
            store = FileStore(w.store_path)
            for r, p in enumerate(proxies):
                store.set(f"{prefix}addr/{r}", f"127.0.0.1:{p.address[1]}".encode())
            store.close()
            w.expect_go()
            wire = b"".join(bytes(p.data) for p in proxies)
        finally:
            for p in proxies:
                p.close()
        assert len(wire) > 0, "nothing went through the recorders"
        for form in (secret.encode(), bytes.fromhex(secret)):
            assert form not in wire, "the group secret travelled in clear"


def test_idle_connections_do_not_spin_the_progress_thread():
    with World(2, env={"COLL_HANDSHAKE_TIMEOUT": "30"}) as w:
        socks = [_connect(w.ready[0][1]) for _ in range(80)]
        try:
            time.sleep(0.5)
            share = _cpu_share(w, 0)
            assert share < 0.3, f"rank 0 used {share:.0%} of a core with 80 idle connections open"
            w.expect_go()
        finally:
            for s in socks:
                s.close()


def test_unfinished_handshake_is_closed_within_the_timeout():
    with World(2, env={"COLL_HANDSHAKE_TIMEOUT": "1"}) as w:
        addr = w.ready[0][1]
        silent = _connect(addr)
        partial = _connect(addr)
        partial.sendall(b"DLC")  # a few bytes of a header, then nothing
        t0 = time.monotonic()
        for s in (silent, partial):
            with s:
                assert _read_until_closed(s, 6.0) == b"", "connection still open after 6 s"
        assert time.monotonic() - t0 < 6.0
        w.expect_go()


def test_unauthenticated_connections_are_capped():
    with World(2, env={"COLL_HANDSHAKE_TIMEOUT": "30"}) as w:
        base = w.open_fds(0)
        socks = [_connect(w.ready[0][1]) for _ in range(300)]
        try:
            deadline = time.monotonic() + 5
            while w.open_fds(0) - base > 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            held = w.open_fds(0) - base
            assert held <= 200, f"rank 0 holds {held} unauthenticated connections (cap expected)"
            w.expect_go()  # the newest connections (the ranks') are the ones kept
        finally:
            for s in socks:
                s.close()


def test_out_of_descriptors_pauses_accepting_and_recovers():
    with World(2, env={"COLL_NOFILE": "40", "COLL_HANDSHAKE_TIMEOUT": "30"}) as w:
        socks = []
        try:
            for _ in range(120):  # well past rank 0's 40 descriptors (the backlog holds the rest)
                socks.append(_connect(w.ready[0][1]))
            time.sleep(0.5)
            share = _cpu_share(w, 0)
            assert share < 0.3, f"rank 0 used {share:.0%} of a core while out of file descriptors"
            w.expect_go()  # outsiders' connections make room for the ranks' own
        finally:
            for s in socks:
                s.close()
        w.expect_go()


SHM_NAMES = """\
import numpy as np
import distlaunch.collectives as dist
from distlaunch.collectives import runtime
dist.init_process_group()
dist.all_reduce(np.ones(4))
names = sorted({w for line in open("/proc/self/maps") for w in line.split() if w.startswith("/dev/shm/")})
print("SECRET", runtime._runtime.secret)
print("SHM", *names)
dist.destroy_process_group()
"""


def test_shared_memory_names_reveal_nothing_of_the_secret(tmp_path):
    """/dev/shm names are visible to every user of the machine (until the segment is
    unlinked, once every rank has mapped it): they carry a one-way hash of the group's
    transport secret, never a piece of it (they held its first 16 characters)."""
    script = tmp_path / "names.py"
    script.write_text(SHM_NAMES)
    res = subprocess.run(
        [sys.executable, "-m", "distlaunch", "run", "--nproc-per-node", "2", "--no-prefix", str(script)],
        capture_output=True, text=True, timeout=60, cwd=launch.REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    secrets = {ln.split()[1] for ln in lines if ln.startswith("SECRET ")}
    names = [n for ln in lines if ln.startswith("SHM ") for n in ln.split()[1:]]
    assert len(secrets) == 1 and names, res.stdout  # one group secret; shared memory was used
    [secret] = secrets
    windows = {secret[i : i + 8] for i in range(len(secret) - 7)}
    assert not [n for n in names if any(w in n for w in windows)], (names, secret)
