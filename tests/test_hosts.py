"""Host lists and hostfiles (distlaunch.hosts): pure parsing, no network."""

import getpass
import socket
import subprocess
import sys

import pytest

from distlaunch.errors import ConfigError
from distlaunch.hosts import Host, filter_hosts, is_local, parse_host_list, parse_hostfile, resolve_slots


def hostfile(tmp_path, text, name="hostfile"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- -H lists --------------------------------------------------------------------------


def test_host_list_slots_users_and_defaults():
    assert parse_host_list("node1:4,user@node2:2,node3") == [
        Host("node1", slots=4),
        Host("node2", user="user", slots=2),
        Host("node3"),
    ]


def test_host_list_spaces_around_entries_and_addresses():
    assert parse_host_list(" 10.0.0.1:2 , [fe80::1]:3, ::1 ") == [
        Host("10.0.0.1", slots=2),
        Host("fe80::1", slots=3),
        Host("::1"),
    ]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty host list"),
        ("   ", "empty host list"),
        ("a,,b", "extra comma"),
        ("a,", "extra comma"),
        ("a:0", "slots=0"),
        ("a:-2", "slots=-2"),
        ("a:x", "'x'"),
        ("a:", "''"),
        ("a,b,A:2", "listed twice"),
        ("u@a,a", "listed twice"),
        ("-oProxyCommand=x", "bad host name"),
        ("a b", "whitespace"),
        ("bad user@a", "whitespace"),
        ("@a", "bad user name"),
        ("[fe80::1", "unclosed"),
    ],
)
def test_host_list_errors(spec, words):
    with pytest.raises(ConfigError) as err:
        parse_host_list(spec)
    msg = str(err.value)
    assert words in msg and "\n" not in msg


def test_host_list_error_names_the_entry():
    with pytest.raises(ConfigError, match=r"-H entry 2 \('b:0'\)"):
        parse_host_list("a:1,b:0")


# --- hostfiles ---------------------------------------------------------------------------


def test_hostfile_openmpi(tmp_path):
    path = hostfile(tmp_path, "node1 slots=4 max_slots=8\nnode2 slots=2 max-slots=2\nnode3\n")
    assert parse_hostfile(path) == [
        Host("node1", slots=4, max_slots=8),
        Host("node2", slots=2, max_slots=2),
        Host("node3"),
    ]


def test_hostfile_deepspeed(tmp_path):
    path = hostfile(tmp_path, "worker-0 slots=4\nworker-1 slots=4\n")
    assert parse_hostfile(path) == [Host("worker-0", slots=4), Host("worker-1", slots=4)]


def test_hostfile_mpich(tmp_path):
    path = hostfile(tmp_path, "node1:2\nnode2:3\nnode3\n")
    assert parse_hostfile(path) == [Host("node1", slots=2), Host("node2", slots=3), Host("node3")]


def test_hostfile_comments_blank_lines_users_mixed_formats(tmp_path):
    path = hostfile(
        tmp_path,
        """\
# cluster A

alice@node1 slots=2   # trailing comment
\tbob@node2:4
node3 SLOTS=1

# end
""",
    )
    assert parse_hostfile(path) == [
        Host("node1", user="alice", slots=2),
        Host("node2", user="bob", slots=4),
        Host("node3", slots=1),
    ]


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("a slots=2\nb slots=0\n", 2, "slots=0"),
        ("a\n\n# c\nb slots=-1\n", 4, "slots=-1"),
        ("a slots=two\n", 1, "not a number"),
        ("a:x\n", 1, "not a number"),
        ("a slots\n", 1, "cannot parse 'slots'"),
        ("a cpu=4\n", 1, "unknown setting 'cpu=4'"),
        ("a:2 slots=2\n", 1, "slots given twice"),
        ("a slots=4 max_slots=2\n", 1, "max_slots=2 is below slots=4"),
        ("a slots=1 max_slots=0\n", 1, "max_slots=0"),
        ("a\nb\na slots=2\n", 3, "listed twice (first at"),
        ("-a\n", 1, "bad host name"),
    ],
)
def test_hostfile_errors_name_file_and_line(tmp_path, text, line, words):
    path = hostfile(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        parse_hostfile(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:{line}: ") and words in msg and "\n" not in msg


def test_hostfile_empty_or_only_comments(tmp_path):
    path = hostfile(tmp_path, "# nothing\n\n")
    with pytest.raises(ConfigError, match="lists no hosts"):
        parse_hostfile(path)


def test_hostfile_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"hostfile .*nope: cannot read it"):
        parse_hostfile(str(tmp_path / "nope"))


def test_hostfile_not_text(tmp_path):
    path = tmp_path / "bin"
    path.write_bytes(b"\xff\xfe\x00node")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_hostfile(str(path))


# --- resolve_slots -------------------------------------------------------------------------


def test_resolve_slots_fills_only_missing():
    hosts = [Host("a", slots=3), Host("b"), Host("c", user="u")]
    assert resolve_slots(hosts, 2) == [Host("a", slots=3), Host("b", slots=2), Host("c", user="u", slots=2)]


def test_resolve_slots_respects_max_slots():
    assert resolve_slots([Host("a", max_slots=4)], 4) == [Host("a", slots=4, max_slots=4)]
    with pytest.raises(ConfigError, match="exceeds its max_slots=4"):
        resolve_slots([Host("a", max_slots=4)], 5)


def test_resolve_slots_bad_default():
    with pytest.raises(ConfigError, match="at least 1"):
        resolve_slots([Host("a")], 0)
    assert resolve_slots([Host("a", slots=1)], 0) == [Host("a", slots=1)]  # not needed


# --- include / exclude -----------------------------------------------------------------------

HOSTS = [Host("n1", slots=1), Host("n2", user="u", slots=2), Host("n3", slots=3)]


def test_filter_none_keeps_all():
    assert filter_hosts(HOSTS, None, None) == HOSTS


def test_include_keeps_order_of_the_host_list():
    assert filter_hosts(HOSTS, "n3,N1", None) == [HOSTS[0], HOSTS[2]]


def test_exclude():
    assert filter_hosts(HOSTS, None, "u@n2") == [HOSTS[0], HOSTS[2]]


@pytest.mark.parametrize(
    "include, exclude, words",
    [
        ("n1,n9", None, "n9 not in the host list"),
        (None, "zz", "zz not in the host list"),
        ("n1", "n2", "mutually exclusive"),
        (None, "n1,n2,n3", "leaves no hosts"),
        ("n1:0,1", None, "n1 has slots 0..0, not 1"),
        ("n2:x", None, "slots 'x' of n2 are not numbers"),
        (None, "n1:0@n2:0,1@n3", "leaves no hosts"),
        ("n1,,n2", None, "empty name"),
    ],
)
def test_filter_errors(include, exclude, words):
    with pytest.raises(ConfigError, match=words):
        filter_hosts(HOSTS, include, exclude)


def test_deepspeed_slot_selection():
    """DeepSpeed's --include 'host1:0,2@host2' / --exclude 'host1:1': the chosen local
    slots become the host's devices (its workers' CUDA_VISIBLE_DEVICES)."""
    n3_02 = Host("n3", slots=2, devices=(0, 2))
    assert filter_hosts(HOSTS, "n3:0,2@n1", None) == [HOSTS[0], n3_02]
    assert filter_hosts(HOSTS, None, "n3:1") == [HOSTS[0], HOSTS[1], n3_02]
    assert filter_hosts(HOSTS, None, "n3:1@n1") == [HOSTS[1], n3_02]
    assert filter_hosts(HOSTS, "n3:0,1,2", None) == [HOSTS[2]]  # every slot: no devices
    assert filter_hosts(HOSTS, "n[1-2]", None) == HOSTS[:2]


def test_host_ranges_everywhere(tmp_path):
    assert parse_host_list("node[01-03]:8,u@gpu[1,3]") == [
        *(Host(f"node0{i}", slots=8) for i in (1, 2, 3)),
        Host("gpu1", user="u"),
        Host("gpu3", user="u"),
    ]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n[1-2] slots=4\nx[08-09]:2\n")
    assert parse_hostfile(str(hostfile)) == [
        Host("n1", slots=4), Host("n2", slots=4), Host("x08", slots=2), Host("x09", slots=2)
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="range '3-1' runs backwards"):
        parse_host_list("n[3-1]")
    with pytest.raises(ConfigError, match="listed twice"):
        parse_host_list("n[1-2],n2")


# --- is_local --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["localhost", "LOCALHOST", "127.0.0.1", "::1", socket.gethostname()])
def test_is_local(name):
    assert is_local(Host(name))
    assert is_local(Host(name, user=getpass.getuser(), slots=2))


@pytest.mark.parametrize("name", ["127.0.0.2", "127.0.0.3", "node1", "10.1.2.3", socket.gethostname() + "x"])
def test_is_not_local(name):
    assert not is_local(Host(name))


def test_other_user_on_localhost_is_not_local():
    assert not is_local(Host("localhost", user=getpass.getuser() + "x"))


def test_hosts_does_not_import_paramiko():
    code = (
        "import sys, distlaunch.hosts, distlaunch.remote, distlaunch.remote.command; "
        "assert 'paramiko' not in sys.modules, 'paramiko imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
