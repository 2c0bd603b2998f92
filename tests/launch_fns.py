"""Module-level functions for the launch() API tests (workers import this module)."""

import os


def rank_info(scale, offset=0):
    return {
        "rank": int(os.environ["RANK"]) * scale + offset,
        "world": int(os.environ["WORLD_SIZE"]),
        "who": os.environ.get("WHO"),
    }


def fail_on_rank_one():
    if os.environ["RANK"] == "1":
        raise KeyError("rank one is broken")
    return "fine"


def fail_first_attempt():
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "0":
        raise RuntimeError("first attempt")
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def die_by_signal():
    import signal

    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def argparse_error():
    """A worker whose argument parsing fails: argparse exits with code 2."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--needed", required=True)
    p.parse_args([])


def launcher_cmdline_and_env(name):
    """The command line of this worker's parent (the `distlaunch run` launcher), the
    value of variable ``name`` here, and whether the launcher's own environment has it."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        cmdline = f.read().decode()
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:
        in_launcher = any(v.startswith(name.encode() + b"=") for v in f.read().split(b"\0"))
    return cmdline, os.environ.get(name), in_launcher


def fail_on_rank_one_then_rank_zero_raises_when_stopped():
    """Rank 1 fails first; rank 0 turns the stop (SIGTERM) into an exception of its own,
    as programs that clean up on SIGTERM do: a consequence, not the root cause."""
    import signal
    import time

    if os.environ["RANK"] == "1":
        raise KeyError("rank one is broken")

    def stopped(signum, frame):
        raise RuntimeError("rank zero was stopped")

    signal.signal(signal.SIGTERM, stopped)
    time.sleep(60)
