"""Stop signals end every phase of a launcher, not only the one where workers run:
waiting for other nodes to join, for the store to come up, for the head's plan, and at
the exit barrier. And a launcher that cannot reach its rendezvous endpoint says why
within seconds, and keeps saying it, instead of waiting silently for join_timeout.

Per-node launches run as real `distlaunch run --nnodes N --node-rank K` processes on
this machine (each a separate node), against real sockets.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import WORKERS, dl_cmd, dl_popen
from ports import free_port
from test_supervision import started, wait_for

TOKEN = "signals-phases-secret"
ENV = dict(os.environ, DISTLAUNCH_STORE_TOKEN=TOKEN)
# How long a stopped launcher may take to exit: the target is 1 s; the machine is shared.
PROMPT = 5.0


class Launcher:
    """A launcher process whose stderr is collected line by line as it comes."""

    def __init__(self, *args, env=None):
        self.proc = dl_popen(*args, env=env or ENV)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def said(self, *parts) -> list[str]:
        return [ln for ln in self.lines if all(p in ln for p in parts)]

    def signal(self, *sigs):
        for s in sigs:
            self.proc.send_signal(s)
            time.sleep(0.1)

    def exits_within(self, seconds: float) -> int:
        """The exit code, which must come within ``seconds``."""
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {seconds} s later; it said: {self.lines[-5:]}") from None
        self._reader.join(5)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def launchers():
    started = []

    def start(*args, **kw):
        started.append(Launcher(*args, **kw))
        return started[-1]

    yield start
    for la in started:
        la.kill()


def node(start, rank, port, *worker_args, nnodes=2, run_id="sig", conf="join_timeout=60", env=None):
    return start(
        "run",
        "--nnodes",
        nnodes,
        "--node-rank",
        rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--nproc-per-node",
        1,
        "--run-id",
        run_id,
        "--stop-timeout",
        2,
        "--rdzv-conf",
        conf,
        *(worker_args or (WORKERS / "actor.py",)),
        env=env,
    )


def accepts(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def joined(port, run_id, *ranks, rnd=0) -> bool:
    from distlaunch.store import StoreClient

    with StoreClient("127.0.0.1", port, token=TOKEN, timeout=5, connect_timeout=5) as c:
        return c.check([f"{run_id}/r{rnd}/node/{k}" for k in ranks])


def assert_stopped_by(la, signum, seconds=PROMPT):
    rc = la.exits_within(seconds)
    assert rc == 128 + signum, la.lines
    assert la.said(f"stopped by signal {signum}"), la.lines


# --- workers that ignore the stop signal ----------------------------------------------


@pytest.mark.parametrize(
    "signum, stop_timeout, line",
    [
        (signal.SIGINT, 60, "stopping 2 workers (up to 60 s; Ctrl-C again to kill now)"),
        (signal.SIGTERM, 1, "stopping 2 workers (up to 1 s)"),  # no Ctrl-C hint after SIGTERM
    ],
)
def test_stopping_workers_that_ignore_the_signal_is_said_once(
    launchers, tmp_path, signum, stop_timeout, line
):
    """They keep the launcher waiting up to --stop-timeout: half a second after the first
    stop signal the launcher says so, and how to cut it short; nothing more until the end."""
    la = launchers(
        "run",
        "--nproc-per-node",
        2,
        "--stop-timeout",
        stop_timeout,
        WORKERS / "actor.py",
        "--mark-dir",
        tmp_path,
        "--ignore",
        signum.name,
        "--sleep",
        60,
    )
    assert wait_for(started(tmp_path, 2))
    la.signal(signum)
    assert wait_for(lambda: la.said("stopping"), PROMPT), la.lines
    assert la.proc.poll() is None  # still waiting for the workers
    if signum == signal.SIGINT:
        la.signal(signal.SIGINT)  # kills at once
    assert_stopped_by(la, signum)
    assert la.said("stopping") == [f"distlaunch: {line}"], la.lines


def test_workers_that_obey_the_stop_signal_are_not_announced(launchers, tmp_path):
    la = launchers("run", "--nproc-per-node", 2, WORKERS / "actor.py", "--mark-dir", tmp_path, "--sleep", 60)
    assert wait_for(started(tmp_path, 2))
    la.signal(signal.SIGINT)
    assert_stopped_by(la, signal.SIGINT)
    assert not la.said("stopping"), la.lines


# --- (a) waiting for other nodes to join -------------------------------------------------


@pytest.mark.parametrize(
    "sigs",
    [(signal.SIGTERM,), (signal.SIGINT,), (signal.SIGHUP,), (signal.SIGINT, signal.SIGINT)],
    ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGINT-twice"],
)
def test_signal_while_waiting_for_a_node_to_join(launchers, sigs):
    port = free_port()
    n0 = node(launchers, 0, port)
    assert wait_for(lambda: accepts(port) and joined(port, "sig", 0), 30), n0.lines
    t0 = time.monotonic()
    n0.signal(*sigs)
    assert_stopped_by(n0, sigs[0])
    assert time.monotonic() - t0 < PROMPT


SIGINT_AT_RESTORE = """import os, signal
_real = signal.set_wakeup_fd
def _set(fd, *a, **k):  # a second Ctrl-C once the relay has put Python's handlers back
    old = _real(fd, *a, **k)
    if fd == -1 and not os.environ.get("SENT"):
        os.environ["SENT"] = "1"
        os.kill(os.getpid(), signal.SIGINT)
    return old
signal.set_wakeup_fd = _set
"""


def test_second_ctrl_c_while_the_stop_is_handled_keeps_its_report(tmp_path, launchers):
    """Ctrl-C twice: the second lands after the relay restored Python's handler, while the
    first's stop is still being handled, and raises KeyboardInterrupt there (found under
    load: the launcher then ended with 130 and a blank line, as for a Ctrl-C before it
    started): it still says it was stopped by the signal."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGINT_AT_RESTORE)
    port = free_port()
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    n0 = node(launchers, 0, port, env=env)
    assert wait_for(lambda: accepts(port) and joined(port, "sig", 0), 30), n0.lines
    n0.signal(signal.SIGINT)
    assert_stopped_by(n0, signal.SIGINT)
    assert not n0.said("Traceback"), n0.lines


def test_waiting_for_a_node_is_not_silent(launchers):
    port = free_port()
    n0 = node(launchers, 0, port)
    assert wait_for(lambda: n0.said("rendezvous round 0: waiting for node(s) 1 (", "of 60 s)"), 15), n0.lines
    n0.signal(signal.SIGTERM)
    assert_stopped_by(n0, signal.SIGTERM)


@pytest.mark.parametrize("victim", [0, 1])
def test_signal_in_rendezvous_stops_the_other_waiting_nodes(launchers, victim):
    """Nodes 0 and 1 of 3 wait for node 2; a signal to either stops both (the store's
    host, node 0, waits for node 1 to read why)."""
    port = free_port()
    nodes = [node(launchers, k, port, nnodes=3) for k in range(2)]
    assert wait_for(lambda: accepts(port) and joined(port, "sig", 0, 1), 30)
    time.sleep(0.3)
    t0 = time.monotonic()
    nodes[victim].signal(signal.SIGTERM)
    for n in nodes:
        assert_stopped_by(n, signal.SIGTERM)
    assert time.monotonic() - t0 < PROMPT + 2


def test_signal_while_waiting_for_dynamic_members(launchers):
    port = free_port()
    la = launchers(
        "run",
        "--nnodes",
        "2:3",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "dynsig",
        "--nproc-per-node",
        1,
        WORKERS / "actor.py",
    )
    assert wait_for(lambda: accepts(port), 30)
    time.sleep(0.5)
    la.signal(signal.SIGTERM)
    assert_stopped_by(la, signal.SIGTERM)


# --- (b) an agent waiting for the head's plan ----------------------------------------------


def test_signal_while_agent_waits_for_the_heads_plan():
    import dataclasses

    from distlaunch.agent.node import NodeOptions
    from distlaunch.config import LaunchConfig
    from distlaunch.store import StoreClient, StoreServer

    with StoreServer("127.0.0.1", 0, token=TOKEN) as server:
        cfg = LaunchConfig(entrypoint=str(WORKERS / "actor.py"), run_id="planwait")
        spec = {
            "config": cfg.to_dict(),
            "store": ["127.0.0.1", server.port],
            "token": TOKEN,
            "node": dataclasses.asdict(NodeOptions(node_id=0, node_rank=0, slots=1)),
            "master_addr": "127.0.0.1",
            "env": {},
        }
        agent = subprocess.Popen(dl_cmd("agent"), stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            agent.stdin.write(json.dumps(spec) + "\n")
            agent.stdin.flush()
            # it connected: the store counts its connection (the head's plan never comes)
            with StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=5) as probe:
                assert wait_for(lambda: server_clients(server) >= 2 or agent.poll() is not None, 30)
                time.sleep(0.5)
                assert agent.poll() is None, agent.stderr.read()
                assert not probe.check(["planwait/r0/plan"])
            t0 = time.monotonic()
            agent.send_signal(signal.SIGTERM)
            agent.wait(PROMPT)
            assert time.monotonic() - t0 < PROMPT
            assert agent.returncode == 128 + signal.SIGTERM, agent.stderr.read()
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
            agent.stdin.close()
            agent.stderr.close()


def server_clients(server) -> int:
    """Connections open on ``server`` (the agent's included), from the kernel's table."""
    import psutil

    return sum(
        1
        for c in psutil.Process().net_connections("tcp")
        if c.laddr and c.laddr.port == server.port and c.status == psutil.CONN_ESTABLISHED
    )


# --- (c) the exit barrier ------------------------------------------------------------------

BUSY_WORKER = """\
import os, pathlib, sys, time
marks, busy = pathlib.Path(sys.argv[1]), int(sys.argv[2])
node = int(os.environ["GROUP_RANK"])
(marks / f"started.{node}").touch()
if node == busy:
    time.sleep(120)
(marks / f"done.{node}").touch()
"""


@pytest.mark.parametrize("victim", [0, 1])
def test_signal_at_the_exit_barrier(launchers, tmp_path, victim):
    """The victim's worker finished and it waits at the exit barrier for the other
    node's, which still runs: a SIGTERM ends the victim at once, and the other node
    stops its worker and exits with the same code."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY_WORKER)
    marks = tmp_path / "marks"
    marks.mkdir()
    port = free_port()
    busy = 1 - victim
    nodes = [node(launchers, k, port, script, marks, busy) for k in range(2)]
    assert wait_for(
        lambda: (marks / f"done.{victim}").exists() and (marks / f"started.{busy}").exists(), 30
    ), [n.lines for n in nodes]
    time.sleep(0.5)  # the victim's worker has exited; its agent is at the barrier
    assert all(n.proc.poll() is None for n in nodes)
    t0 = time.monotonic()
    nodes[victim].signal(signal.SIGTERM)
    for n in (nodes[victim], nodes[busy]):  # the busy node has 2 s of --stop-timeout
        assert_stopped_by(n, signal.SIGTERM, PROMPT + 2)
    assert time.monotonic() - t0 < PROMPT + 2
    assert not (marks / f"done.{busy}").exists()


# --- (d) the store is not there (yet) --------------------------------------------------------


def test_signal_while_waiting_for_the_store(launchers):
    port = free_port()
    n1 = node(launchers, 1, port)
    assert wait_for(lambda: n1.said("waiting for the store", f"127.0.0.1:{port}"), 15), n1.lines
    assert n1.said("connection refused")
    n1.signal(signal.SIGTERM)
    assert_stopped_by(n1, signal.SIGTERM)


# --- the endpoint diagnostics -------------------------------------------------------------------


def assert_keeps_saying(la, *parts, first=8.0, again=12.0):
    """``la`` names the problem within ``first`` s and says it again later."""
    assert wait_for(lambda: la.said(*parts), first), la.lines
    assert wait_for(lambda: len(la.said(*parts)) >= 2, again), la.lines
    assert la.proc.poll() is None, la.lines
    la.signal(signal.SIGTERM)
    assert_stopped_by(la, signal.SIGTERM)


def test_port_bound_but_not_listening(launchers):
    """A socket bound without listen() refuses connections (torchrun waits silently)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        n1 = node(launchers, 1, port)
        assert_keeps_saying(n1, f"waiting for the store at 127.0.0.1:{port}", "connection refused")


def test_dynamic_endpoint_bound_but_not_listening(launchers):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        la = launchers(
            "run",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--nproc-per-node",
            1,
            WORKERS / "actor.py",
        )
        assert_keeps_saying(
            la, f"127.0.0.1:{port}", "connection refused", "could not host the store there either", "in use"
        )


def test_port_held_by_a_silent_listener(launchers):
    with socket.create_server(("127.0.0.1", 0)) as other:  # accepts (backlog), says nothing
        port = other.getsockname()[1]
        n1 = node(launchers, 1, port)
        assert_keeps_saying(n1, f"127.0.0.1:{port}", "sent no greeting", "not a distlaunch store")


def test_port_held_by_a_listener_that_hangs_up(launchers):
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        done = threading.Event()

        def hang_up():
            other.settimeout(0.2)
            while not done.is_set():
                try:
                    other.accept()[0].close()
                except OSError:
                    pass

        t = threading.Thread(target=hang_up, daemon=True)
        t.start()
        try:
            n1 = node(launchers, 1, port)
            assert_keeps_saying(n1, f"127.0.0.1:{port}", "closed the connection before greeting")
        finally:
            done.set()
            t.join(5)


def test_host_that_does_not_resolve(launchers):
    port = free_port()
    la = launchers(
        "run",
        "--nnodes",
        2,
        "--node-rank",
        1,
        "--master-addr",
        "no-such-host.invalid",
        "--master-port",
        port,
        "--nproc-per-node",
        1,
        WORKERS / "actor.py",
    )
    assert_keeps_saying(la, f"no-such-host.invalid:{port}", "does not resolve")


# --- the store client after an interrupted call ------------------------------------------------


def test_interrupted_store_call_does_not_answer_the_next_one():
    """A blocking call cut short by an exception from a signal handler (Ctrl-C) leaves its
    reply due on the connection: the client must not hand it to the next call."""
    from distlaunch.errors import StoreConnectionError
    from distlaunch.store import StoreClient, StoreServer

    class Interrupted(Exception):
        pass

    def interrupt(*_):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with (
            StoreServer("127.0.0.1", 0, token=TOKEN) as server,
            StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as c,
            StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=10) as other,
        ):
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(Interrupted):
                c.get("late", timeout=5)
            other.set("late", b"the interrupted call's value")
            other.set("mine", b"mine")
            other.ping()
            with pytest.raises(StoreConnectionError, match="interrupted"):
                c.get("mine")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --- (e) the head while it connects to its hosts ------------------------------------------


def signal_a_thread(pid: int, signum: int) -> None:
    """Send ``signum`` to one thread of process ``pid`` other than its main thread (as
    the kernel may deliver a process-directed signal under load), with tgkill(2)."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the process has no thread but its main one"
    if ctypes.CDLL(None, use_errno=True).tgkill(pid, tids[0], signum) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.parametrize("to_a_thread", [False, True], ids=["process", "thread"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_while_the_head_connects_to_its_hosts(launchers, sshd_hosts, signum, to_a_thread):
    """Also when the signal lands on a connecting thread, not the main one (found under
    load: the main thread slept in the thread pool's join until the banner timeout)."""
    # an "sshd" that accepts and never speaks: the head waits for its banner
    with socket.create_server(("127.0.0.5", 0)) as silent:
        la = launchers(
            "run",
            "--ssh-config",
            sshd_hosts.ssh_config,
            "-H",
            "127.0.0.5:1",
            "--ssh-port",
            silent.getsockname()[1],
            WORKERS / "actor.py",
        )
        # signal once the head is connected and waiting for the banner (not after a
        # fixed sleep: under load the head may still be importing then)
        silent.settimeout(60)
        conn, _ = silent.accept()
        with conn:
            assert la.proc.poll() is None, la.lines
            if to_a_thread:
                signal_a_thread(la.proc.pid, signum)
            else:
                la.signal(signum)
            assert_stopped_by(la, signum)


SLOW_CONTROLLER = """import pathlib, sys, time
class Slow:  # the head's import of its controller takes 5 s (a window for the signal)
    def find_spec(self, name, path=None, target=None):
        if name == "distlaunch.head_controller":
            pathlib.Path({mark!r}).write_text("importing")
            time.sleep(5)
        return None
sys.meta_path.insert(0, Slow())
"""


def test_signal_after_the_agents_got_their_specs_before_plan_zero(sshd_hosts, tmp_path):
    """The head sends the agents their specs, then imports its controller (which
    publishes plan 0, what the agents wait for): a SIGTERM in between stops the job
    promptly (review finding: the agents waited for plan 0 and the head for them, up to
    --stop-timeout + 5 s)."""
    site, mark = tmp_path / "site", tmp_path / "mark"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_CONTROLLER.format(mark=str(mark)))
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    args = ("run", "--ssh-config", sshd_hosts.ssh_config, "-H", "node1:1", "--ssh-port", sshd_hosts.port)
    proc = dl_popen(*args, WORKERS / "actor.py", env=env)
    try:
        assert wait_for(mark.exists, 60), proc.stderr.read() if proc.poll() is not None else "no mark"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(15)  # was --stop-timeout (30 s) + 5 s
        err = proc.stderr.read()
        assert rc == 128 + signal.SIGTERM, err
        assert "stopped by signal 15" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


FOLLOW_PLAN = """
import sys, threading, time
from distlaunch.agent.signals import SignalRelay
from distlaunch.errors import LaunchInterrupted
from distlaunch.rendezvous import Rendezvous
from distlaunch.store import StoreClient

client = StoreClient("127.0.0.1", int(sys.argv[1]), token=sys.argv[2], timeout=120)
rdzv = Rendezvous(client, "job", 0, 1, join_timeout=60)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread besides main
relay = SignalRelay(lambda: ())
print("waiting", flush=True)
start = time.monotonic()
try:
    with relay.interruptible():
        rdzv.follow_plan(0, 0)
except LaunchInterrupted as e:
    print(f"interrupted by {e.signum} after {time.monotonic() - start:.1f} s", flush=True)
"""


def test_a_head_mode_agent_waiting_for_its_plan_stops_on_a_signal_to_another_thread():
    """An agent waits for the head's plan (Rendezvous.follow_plan) in short store waits,
    so a stop signal the kernel delivers to one of its other threads is handled within
    about a second (one long get slept until the join timeout: the main thread runs
    Python's handlers only when it runs code again)."""
    from distlaunch.store import StoreServer

    with StoreServer("127.0.0.1", 0, token=TOKEN) as server:
        proc = subprocess.Popen(
            [sys.executable, "-c", FOLLOW_PLAN, str(server.port), TOKEN],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().strip() == "waiting", proc.stderr.read()
            time.sleep(0.3)  # in the store's get by now
            signal_a_thread(proc.pid, signal.SIGTERM)
            out, err = proc.communicate(timeout=10)
            assert f"interrupted by {signal.SIGTERM}" in out, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


SIGNAL_IN_THREAD_START = """import os, signal, threading, time
_real = threading._start_new_thread
def _start(fn, args):  # SIGTERM to the head inside Thread.start, once its thread runs
    ident = _real(fn, args)
    if getattr(getattr(fn, "__self__", None), "name", "").startswith({name!r}) and not os.environ.get("SENT"):
        os.environ["SENT"] = "1"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here; the new thread has left threading's _limbo
    return ident
threading._start_new_thread = _start
"""


@pytest.mark.parametrize("thread", ["distlaunch-store", "head-controller", "distlaunch-ssh"])
def test_signal_while_the_head_starts_a_thread(tmp_path, thread, request):
    """A stop signal that lands inside threading's start of a thread the head makes (its
    store's, its controller's, an SSH connection pool's) is raised once that call has
    returned (found under load: LaunchInterrupted raised inside Thread.start left a
    running thread threading could not join, and the head ended with a KeyError
    traceback and exit code 1): the head stops as for any signal while it starts, 143
    and one line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGNAL_IN_THREAD_START.format(name=thread))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    if thread == "distlaunch-ssh":  # a host over SSH, whose "sshd" accepts and never speaks
        hosts = request.getfixturevalue("sshd_hosts")
        silent = socket.create_server(("127.0.0.5", 0))
        request.addfinalizer(silent.close)
        args = ["--ssh-config", hosts.ssh_config, "-H", "127.0.0.5:1", "--ssh-port", silent.getsockname()[1]]
    else:
        args = ["-H", "localhost:1"]
    proc = subprocess.run(
        dl_cmd("run", *args, WORKERS / "actor.py"), capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "stopped by signal 15" in proc.stderr, proc.stderr


SIGINT_AT_IMPORT = """import importlib.abc, os, signal, sys
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # Ctrl-C as the launcher imports {name}
        if name == {name!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Finder())
"""


@pytest.mark.parametrize("module", ["distlaunch.preparse", "click"])
def test_ctrl_c_while_the_launcher_loads_is_one_blank_line(tmp_path, module):
    """Ctrl-C before the launcher's own handling is in place (it is importing the CLI)
    ends it as click's Abort does, 130 and a blank line, not with a traceback of the
    imports."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SIGINT_AT_IMPORT.format(name=module))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    args = ("--nnodes", 2) if module == "click" else ()  # (the click-less form declines it)
    proc = subprocess.run(
        dl_cmd("run", *args, WORKERS / "actor.py"), capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "\n", proc.stderr


from sshd import sshd_hosts  # noqa: E402,F401  (session fixture)
