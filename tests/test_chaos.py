"""The chaos suite, short form: every fault once in every mode (the benchmark script
benchmarks/chaos.py runs 100 random trials)."""

import random
import signal

import pytest
from chaos import FAULTS, run_trial, unshare_problem
from sshd import sshd_hosts  # noqa: F401

CASES = [(mode, fault) for mode, faults in FAULTS.items() for fault in faults]


@pytest.mark.slow
@pytest.mark.parametrize("mode, fault", CASES)
def test_fault_ends_cleanly(mode, fault, request):
    if fault == "shm_full" and (why := unshare_problem()):
        pytest.skip(why)
    sshd = request.getfixturevalue("sshd_hosts") if mode == "head" else None
    out = run_trial(mode, fault, random.Random(f"{mode}-{fault}"), sshd)
    assert out.ok, out
    assert out.end_s is not None and out.end_s < 45, out
    if fault in ("kill_worker", "stop_worker") and out.delivered:
        assert all(c == 0 for c in out.codes), out  # restarted and completed
    if fault in ("kill_agent", "cut_store", "freeze_store"):
        assert any(c not in (0, -9) for c in out.codes), out  # the survivors say why they stop
    if fault == "term_rendezvous":  # the launcher told to stop says so (or died of it unset)
        assert {128 + signal.SIGTERM, -signal.SIGTERM} & set(out.codes), out
