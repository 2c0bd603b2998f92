"""Host lists: ``-H`` specs, hostfiles, include/exclude filters.

Pure standard library (no paramiko): single-node launches import this module too.

Accepted syntax, one host per entry or line:

- ``-H`` list (Open MPI ``--host`` / MPICH ``-hosts``): ``node1:4,user@node2:2,node3``;
  ``host:N`` means N slots, a host without ``:N`` gets ``--nproc-per-node``.
- hostfile lines, formats may be mixed:

  - Open MPI: ``node1 slots=4 max_slots=8`` (``max-slots`` is accepted too)
  - DeepSpeed: ``node1 slots=4``
  - MPICH (Hydra): ``node1:4``
  - a bare ``node1``; any of the above as ``user@node1``
  - ``#`` starts a comment (whole line or trailing); blank lines are ignored.

IPv6 addresses are written in brackets when slots follow (``[fe80::1]:2``); a bare
address with several colons is taken as an address without slots.

Every mistake raises :class:`~distlaunch.errors.ConfigError` with one line that names the
value (and ``file:line`` for hostfiles) and the fix.
"""

from __future__ import annotations

import getpass
import re
import socket
from dataclasses import dataclass, replace

from .errors import ConfigError
from .topology import MAX_SLOTS_PER_NODE

__all__ = [
    "Host",
    "parse_host_list",
    "parse_hostfile",
    "resolve_slots",
    "filter_hosts",
    "check_one_local",
    "is_local",
]


@dataclass(frozen=True)
class Host:
    """One node as the user listed it.

    ``name`` is the host name or address as given (no user part, no brackets);
    ``user`` comes from ``user@host``; ``slots`` is None when not given (then
    ``--nproc-per-node`` applies, see :func:`resolve_slots`); ``max_slots`` is Open MPI's
    upper bound. ``port`` is never set by the parsers (``host:N`` means N slots, as in
    MPICH); SSH ports come from ``--ssh-port`` or the OpenSSH config.
    """

    name: str
    user: str | None = None
    slots: int | None = None
    max_slots: int | None = None
    port: int | None = None

    def __str__(self) -> str:
        return f"{self.user}@{self.name}" if self.user else self.name


# A host name, IPv4 or IPv6 address. Must not start with "-": it ends up as an argument
# of ssh-like tools and would be read as an option.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$|^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.%A-Za-z]*$")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\$?$")
_SLOTS_RE = re.compile(r"^[+-]?\d+$")


def _count(value: str, what: str, where: str) -> int:
    if not _SLOTS_RE.match(value):
        raise ConfigError(f"{where}: {what}={value!r} is not a number; give a positive integer")
    n = int(value) if len(value) <= 12 else MAX_SLOTS_PER_NODE + 1  # int() of 5000 digits fails
    if n <= 0:
        raise ConfigError(
            f"{where}: {what}={n}; a host needs at least 1 slot (remove the host or give a positive count)"
        )
    if n > MAX_SLOTS_PER_NODE:
        raise ConfigError(
            f"{where}: {what}={value} is more than the {MAX_SLOTS_PER_NODE} workers "
            f"one host may run; give a smaller count"
        )
    return n


def _split_host(text: str, where: str) -> tuple[str, str | None, int | None]:
    """``[user@]name[:N]`` -> (name, user, slots)."""
    user = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        if not _USER_RE.match(user):
            raise ConfigError(f"{where}: bad user name {user!r} in {user}@{text}; write user@host")
    slots_text = None
    if text.startswith("["):  # [v6addr] or [v6addr]:N
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{where}: unclosed '[' in {text!r}; write [address]:N")
        name, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(
                    f"{where}: unexpected {rest!r} after {text[: close + 1]}; write [address]:N"
                )
            slots_text = rest[1:]
    elif text.count(":") == 1:  # MPICH host:N
        name, _, slots_text = text.partition(":")
    else:  # plain name, or a bare IPv6 address (several colons)
        name = text
    if not name or not _NAME_RE.match(name):
        raise ConfigError(
            f"{where}: bad host name {name!r}; use a host name or address (optionally user@host or host:N)"
        )
    slots = None
    if slots_text is not None:
        if not _SLOTS_RE.match(slots_text):
            raise ConfigError(
                f"{where}: slot count {slots_text!r} in {text!r} is not a "
                f"number; write host:N with N a positive integer"
            )
        slots = _count(slots_text, "slots", where)
    return name, user, slots


def _check_unique(hosts: list[Host], wheres: list[str]) -> None:
    seen: dict[str, str] = {}
    for host, where in zip(hosts, wheres):
        key = host.name.lower()
        if key in seen:
            raise ConfigError(
                f"{where}: host {host.name!r} is listed twice (first at "
                f"{seen[key]}); list each host once and give it all its "
                f"slots"
            )
        seen[key] = where


def parse_host_list(spec: str) -> list[Host]:
    """Parse a ``-H`` value such as ``node1:4,user@node2:2,node3``.

    Entries are comma-separated ``[user@]host[:N]`` (Open MPI ``--host``, MPICH ``-hosts``).
    Pure; does no name resolution.

    Raises ConfigError: empty list or entry, bad syntax, 0 or negative slots, a host twice.
    """
    if spec is None or not spec.strip():
        raise ConfigError("empty host list; give -H host1[:N],host2[:N],...")
    hosts, wheres = [], []
    for i, entry in enumerate(spec.split(","), 1):
        entry = entry.strip()
        where = f"-H entry {i} ({entry!r})" if entry else f"-H entry {i}"
        if not entry:
            raise ConfigError(f"{where}: empty entry in host list {spec!r}; remove the extra comma")
        if any(c.isspace() for c in entry):
            raise ConfigError(f"{where}: {entry!r} contains whitespace; separate hosts with commas only")
        name, user, slots = _split_host(entry, where)
        hosts.append(Host(name=name, user=user, slots=slots))
        wheres.append(where)
    _check_unique(hosts, wheres)
    return hosts


def parse_hostfile(path: str) -> list[Host]:
    """Read a hostfile (Open MPI, DeepSpeed or MPICH format; see the module docstring).

    Reads the whole file (blocking file I/O). Every error names ``path:line``.

    Raises ConfigError: the file cannot be read, lists no hosts, a line has bad syntax, an
    unknown ``key=value``, 0 or negative slots, ``max_slots`` below ``slots``, slots given
    twice, or a host listed twice.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"hostfile {path}: cannot read it ({e.strerror or e}); check the path") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"hostfile {path}: not UTF-8 text ({e.reason}); give a text hostfile") from e
    hosts, wheres = [], []
    for lineno, line in enumerate(lines, 1):
        where = f"{path}:{lineno}"
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, user, slots = _split_host(words[0], where)
        max_slots = None
        for word in words[1:]:
            key, eq, value = word.partition("=")
            key = key.lower().replace("-", "_")
            if not eq or not value:
                raise ConfigError(
                    f"{where}: cannot parse {word!r}; expected 'host slots=N [max_slots=M]' or 'host:N'"
                )
            if key == "slots":
                if slots is not None:
                    raise ConfigError(
                        f"{where}: slots given twice for {name}; keep one of host:N and slots=N"
                    )
                slots = _count(value, "slots", where)
            elif key == "max_slots":
                if max_slots is not None:
                    raise ConfigError(f"{where}: max_slots given twice; keep one")
                max_slots = _count(value, "max_slots", where)
            else:
                raise ConfigError(
                    f"{where}: unknown setting {word!r}; only slots=N and max_slots=M are understood"
                )
        if max_slots is not None and slots is not None and max_slots < slots:
            raise ConfigError(
                f"{where}: max_slots={max_slots} is below slots={slots}; raise max_slots or lower slots"
            )
        hosts.append(Host(name=name, user=user, slots=slots, max_slots=max_slots))
        wheres.append(where)
    if not hosts:
        raise ConfigError(f"hostfile {path} lists no hosts; add one host per line ('host slots=N')")
    _check_unique(hosts, wheres)
    return hosts


def slots_of(host: Host) -> int:
    """``host.slots`` once :func:`resolve_slots` filled it in (head mode does so first).
    Raises ValueError for a host whose slots were never resolved."""
    if host.slots is None:
        raise ValueError(f"host {host.name}: slots not resolved (see resolve_slots)")
    return host.slots


def resolve_slots(hosts: list[Host], default_slots: int) -> list[Host]:
    """Return ``hosts`` with every ``slots=None`` replaced by ``default_slots``
    (``--nproc-per-node``); hosts that give slots keep them.

    Raises ConfigError: ``default_slots`` below 1 while a host needs it, or above a host's
    ``max_slots``.
    """
    out = []
    for host in hosts:
        if host.slots is None:
            if default_slots < 1:
                raise ConfigError(f"--nproc-per-node={default_slots}; host {host.name} needs at least 1 slot")
            if host.max_slots is not None and default_slots > host.max_slots:
                raise ConfigError(
                    f"host {host.name}: --nproc-per-node={default_slots} "
                    f"exceeds its max_slots={host.max_slots}; give it "
                    f"slots=N in the hostfile or lower --nproc-per-node"
                )
            host = replace(host, slots=default_slots)
        out.append(host)
    return out


def _names(value: str, flag: str) -> list[str]:
    names = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"{flag} {value!r}: empty name; write {flag} host1,host2")
        if ":" in item and item.count(":") == 1:
            raise ConfigError(
                f"{flag} {value!r}: selecting slots ({item!r}) is not supported; name whole hosts"
            )
        names.append(item.rpartition("@")[2].lower())
    return names


def filter_hosts(hosts: list[Host], include: str | None, exclude: str | None) -> list[Host]:
    """Keep only ``include``d hosts, or drop ``exclude``d ones (DeepSpeed's ``--include`` /
    ``--exclude``, whole hosts only: ``"node1,node2"``; a ``user@`` prefix is ignored).

    Order of ``hosts`` is kept. Names match case-insensitively.

    Raises ConfigError: both given (as DeepSpeed, they are mutually exclusive), a name that
    is not in ``hosts``, per-slot selection (``host:0,1``), or nothing left.
    """
    if include is not None and exclude is not None:
        raise ConfigError("--include and --exclude are mutually exclusive; use one")
    if include is not None:
        flag, value = "--include", include
    elif exclude is not None:
        flag, value = "--exclude", exclude
    else:
        return list(hosts)
    names = _names(value, flag)
    known = {h.name.lower() for h in hosts}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"{flag}: {', '.join(unknown)} not in the host list "
            f"({', '.join(h.name for h in hosts)}); fix the name"
        )
    chosen = set(names)
    keep = [h for h in hosts if (h.name.lower() in chosen) == (flag == "--include")]
    if not keep:
        raise ConfigError(f"{flag} {value!r} leaves no hosts; keep at least one")
    return keep


_LOCAL_NAMES = {"localhost", "localhost.localdomain", "127.0.0.1", "::1", "0:0:0:0:0:0:0:1"}


def is_local(host: Host) -> bool:
    """True if ``host`` is this machine, so no SSH is needed: ``localhost``, ``127.0.0.1``,
    ``::1`` or this machine's ``socket.gethostname()`` (exact, case-insensitive).

    Other loopback aliases (``127.0.0.2`` ...) are *not* local: tests run sshd on them to
    stand in for remote nodes. A host with a ``user@`` other than the current user is not
    local either (reaching another account needs SSH). No name resolution, no network.
    """
    name = host.name.lower()
    if name not in _LOCAL_NAMES and name != socket.gethostname().lower():
        return False
    return host.user is None or host.user == getpass.getuser()


def check_one_local(hosts: list[Host]) -> None:
    """Head mode runs one in-process agent for this machine, so it may be listed once.
    Raises ConfigError naming the entries (``localhost`` and ``127.0.0.1`` are the same
    machine) and the merged entry to give instead."""
    local = [h for h in hosts if is_local(h)]
    if len(local) > 1:
        names = ", ".join(h.name for h in local)
        raise ConfigError(
            f"the host list names this machine {len(local)} times ({names}); "
            f"give it once with all its slots, e.g. {local[0].name}:"
            f"{sum(h.slots or 0 for h in local)}"
        )
