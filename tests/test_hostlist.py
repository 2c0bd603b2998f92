"""distlaunch.hostlist against Slurm itself: ``scontrol show hostnames`` on generated host
lists (hypothesis), and the task counts Slurm gives real steps of the test cluster."""

from __future__ import annotations

import collections
import itertools
import subprocess

import pytest
from slurm import slurm_cluster  # noqa: F401  (session-scoped fixture)

from distlaunch.hostlist import MAX_HOSTS, expand_hostlist, parse_tasks_per_node

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

NAME = "abcdefghijklmnopqrstuvwxyz0123456789-._"


@st.composite
def ranges(draw) -> str:
    """``LO`` or ``LO-HI`` with LO written with optional zero padding."""
    lo = draw(st.integers(0, 120))
    text = str(lo).zfill(draw(st.integers(1, 4)))
    if draw(st.booleans()):
        text += f"-{lo + draw(st.integers(0, 12))}"
    return text


@st.composite
def items(draw) -> str:
    """A name with 0-3 bracket groups, text between them; no text after the last group
    (Slurm 22.05 refuses ``a[1-2]b``)."""
    out = draw(st.text(NAME, min_size=1, max_size=6))
    for _ in range(draw(st.integers(0, 3))):
        if not out or draw(st.booleans()):
            out += draw(st.text(NAME, min_size=1, max_size=3))
        out += "[" + ",".join(draw(st.lists(ranges(), min_size=1, max_size=3))) + "]"
    return out


@st.composite
def hostlists(draw) -> str:
    seps = st.sampled_from([",", " ", ",,", "\t", ", "])
    parts = draw(st.lists(items(), min_size=1, max_size=4))
    text = parts[0]
    for p in parts[1:]:
        text += draw(seps) + p
    return text


def scontrol_hostnames(cluster, text: str) -> list[str]:
    cp = cluster.run("scontrol", "show", "hostnames", "--", text)
    assert cp.returncode == 0 and "Invalid" not in cp.stdout + cp.stderr, (text, cp.stdout, cp.stderr)
    return cp.stdout.split()


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(text=hostlists())
def test_expansion_matches_scontrol(slurm_cluster, text):  # noqa: F811
    assert expand_hostlist(text) == scontrol_hostnames(slurm_cluster, text)


@pytest.mark.parametrize(
    "text",
    ["n[01-04,07],gpu-a[1-2]", "r[1-2]n[1-2]", "n[8-012]", "n[1-2]-[3-4]", "[1-2]", "a,,b", "n[1,1],n1"],
)
def test_examples_match_scontrol(slurm_cluster, text):  # noqa: F811
    assert expand_hostlist(text) == scontrol_hostnames(slurm_cluster, text)


@pytest.mark.parametrize(
    "text, bad, slurm_refuses",
    [
        ("n[1-3", "never closed", False),  # scontrol prints "n]"
        ("n[1-2]]", "without '['", True),
        ("n[[1-2]]", "nested", True),
        ("n[]", "''", True),
        ("n[1,]", "''", True),
        ("n[3-1]", "'3-1'", True),
        ("n[a]", "'a'", True),
        ("n[1-2-3]", "'1-2-3'", True),
        ("n[ 1-2]", "' '", False),  # scontrol prints n01 n02
        ("a\nb", "'\\n'", False),  # scontrol makes "a\nb" one name
        ("n[1-70000]", "more than", True),
        ("a[1-1000]b[1-1000]c[1-10]", "more than", False),  # not tried: 10**7 names
    ],
)
def test_bad_hostlists_name_the_text(slurm_cluster, text, bad, slurm_refuses):  # noqa: F811
    with pytest.raises(ValueError) as e:
        expand_hostlist(text)
    assert bad in str(e.value) and repr(text)[:-1] in str(e.value)
    if slurm_refuses:
        cp = slurm_cluster.run("scontrol", "show", "hostnames", "--", text)
        assert "Invalid hostlist" in cp.stdout + cp.stderr


def test_suffix_after_the_last_group_is_accepted():
    # The one deliberate difference from Slurm 22.05 (documented in distlaunch.hostlist).
    assert expand_hostlist("node[1-2]-ib") == ["node1-ib", "node2-ib"]


@st.composite
def counts(draw) -> list[int]:
    return draw(st.lists(st.integers(1, 64), min_size=1, max_size=12))


def run_length(values: list[int]) -> str:
    """Slurm's ``SLURM_TASKS_PER_NODE`` form, written independently of the parser."""
    return ",".join(
        str(v) if n == 1 else f"{v}(x{n})"
        for v, n in ((k, len(list(g))) for k, g in itertools.groupby(values))
    )


@hypothesis.given(values=counts())
def test_tasks_per_node_round_trip(values):
    assert parse_tasks_per_node(run_length(values)) == values


@pytest.mark.parametrize("text", ["", "2(x0)", "2(x)", "x", "2,", "2(3)", "-1", "2(x3)1"])
def test_bad_tasks_per_node(text):
    with pytest.raises(ValueError, match="tasks per node"):
        parse_tasks_per_node(text)


def test_tasks_per_node_cap():
    with pytest.raises(ValueError, match="more than"):
        parse_tasks_per_node(f"1(x{MAX_HOSTS + 1})")


@pytest.mark.parametrize(
    "layout", [["-N2", "-n3"], ["-N2", "--ntasks-per-node=2"], ["-N2", "-n5"], ["-N1", "-n4"]]
)
def test_tasks_per_node_of_real_steps(slurm_cluster, layout):  # noqa: F811
    """The step's SLURM_STEP_TASKS_PER_NODE / SLURM_STEP_NODELIST match where its tasks
    really ran (SLURMD_NODENAME of each task)."""
    cp = slurm_cluster.run(
        "srun",
        *layout,
        "--overcommit",
        "sh",
        "-c",
        'echo "$SLURMD_NODENAME $SLURM_STEP_NODELIST $SLURM_STEP_TASKS_PER_NODE $SLURM_TASKS_PER_NODE"',
        timeout=60,
    )
    assert cp.returncode == 0, cp.stderr
    rows = [line.split() for line in cp.stdout.splitlines()]
    seen = collections.Counter(r[0] for r in rows)
    nodelist, step_tpn, job_tpn = rows[0][1:]
    nodes = expand_hostlist(nodelist)
    assert parse_tasks_per_node(step_tpn) == [seen[n] for n in nodes]
    assert len(parse_tasks_per_node(job_tpn)) == len(nodes)


def test_scontrol_needs_no_controller(tmp_path):
    """``scontrol show hostnames`` is pure: it works with a configuration whose controller
    does not exist (so the property test does not depend on slurmctld)."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=nowhere(127.0.0.9)\nNodeName=a\n")
    try:
        cp = subprocess.run(
            ["scontrol", "show", "hostnames", "n[1-2]"],
            capture_output=True,
            text=True,
            timeout=20,
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
        )
    except FileNotFoundError:
        pytest.skip("scontrol not installed")
    assert cp.stdout.split() == expand_hostlist("n[1-2]")
