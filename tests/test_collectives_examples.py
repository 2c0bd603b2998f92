"""The collectives examples run under `distlaunch run` and check their own results."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "collectives_workers"))
import launch  # noqa: E402

EXAMPLES = ["p2p", "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce", "ring_all_reduce"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example(name):
    rc, out, err = launch.launch(os.path.join(launch.REPO, "examples", f"{name}.py"), 3, timeout=120)
    assert rc == 0, f"{out[-2000:]}\n{err[-4000:]}"


def test_train_digits_reaches_accuracy():
    pytest.importorskip("sklearn")
    rc, out, err = launch.launch(os.path.join(launch.REPO, "examples", "train_digits.py"), 4, timeout=180)
    assert rc == 0, f"{out[-2000:]}\n{err[-4000:]}"
    m = re.search(r"accuracy=([0-9.]+)", out)
    assert m and float(m.group(1)) >= 0.95, out
    assert "identical parameters on all 4 ranks" in out
