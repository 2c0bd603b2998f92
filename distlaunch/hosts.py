"""Host lists: ``-H`` specs, hostfiles, include/exclude filters.

Pure standard library (no paramiko): single-node launches import this module too.

Accepted syntax, one host per entry or line:

- ``-H`` list (Open MPI ``--host`` / MPICH ``-hosts``): ``node1:4,user@node2:2,node3``;
  ``host:N`` means N slots, a host without ``:N`` gets ``--nproc-per-node``.
- host ranges in Slurm's hostlist syntax wherever a host is named (``-H``, hostfile
  lines, ``--include``/``--exclude``): ``node[01-16]:8`` is node01 ... node16 with 8
  slots each (``hostlist.expand_hostlist``).
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
from .hostlist import expand_hostlist
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
    upper bound; ``devices`` are the local slot ids DeepSpeed-style ``--include`` /
    ``--exclude`` kept (the workers' CUDA_VISIBLE_DEVICES), None when all are used.
    ``port`` is never set by the parsers (``host:N`` means N slots, as in MPICH); SSH
    ports come from ``--ssh-port`` or the OpenSSH config.
    """

    name: str
    user: str | None = None
    slots: int | None = None
    max_slots: int | None = None
    port: int | None = None
    devices: tuple[int, ...] | None = None  # local slot ids chosen by --include/--exclude

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


def _split_host(text: str, where: str) -> tuple[list[str], str | None, int | None]:
    """``[user@]name[:N]`` -> (names, user, slots); a name with host ranges
    (``node[01-04]``) gives every name it expands to."""
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
    names = [name]
    if "[" in name and not text.startswith("["):
        try:
            names = expand_hostlist(name)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}; write ranges as node[01-16] or node[1,3-5]") from None
    for name in names:
        if not name or not _NAME_RE.match(name):
            raise ConfigError(
                f"{where}: bad host name {name!r}; use a host name or address "
                f"(optionally user@host or host:N)"
            )
    slots = None
    if slots_text is not None:
        if not _SLOTS_RE.match(slots_text):
            raise ConfigError(
                f"{where}: slot count {slots_text!r} in {text!r} is not a "
                f"number; write host:N with N a positive integer"
            )
        slots = _count(slots_text, "slots", where)
    return names, user, slots


def _split_entries(spec: str) -> list[str]:
    """``spec`` split at the commas outside brackets (host ranges, IPv6 addresses)."""
    entries, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            entries.append(spec[start:i])
            start = i + 1
    entries.append(spec[start:])
    return entries


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
    for i, entry in enumerate(_split_entries(spec), 1):
        entry = entry.strip()
        where = f"-H entry {i} ({entry!r})" if entry else f"-H entry {i}"
        if not entry:
            raise ConfigError(f"{where}: empty entry in host list {spec!r}; remove the extra comma")
        if any(c.isspace() for c in entry):
            raise ConfigError(f"{where}: {entry!r} contains whitespace; separate hosts with commas only")
        names, user, slots = _split_host(entry, where)
        hosts += [Host(name=name, user=user, slots=slots) for name in names]
        wheres += [where] * len(names)
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
        names, user, slots = _split_host(words[0], where)
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
                        f"{where}: slots given twice for {words[0]}; keep one of host:N and slots=N"
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
        hosts += [Host(name=name, user=user, slots=slots, max_slots=max_slots) for name in names]
        wheres += [where] * len(names)
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


def _selection(value: str, flag: str, known: set[str]) -> list[tuple[list[str], list[int] | None]]:
    """``--include``/``--exclude`` as (host names, slot ids or None for the whole host).

    DeepSpeed's syntax: entries separated by ``@``, each ``host`` or ``host:0,2``
    (``host1:0,2@host2``); an entry without slots may also list hosts separated by
    commas (``host1,host2``), and ``user@host`` names ``host`` when ``user`` is not a
    host in ``known``. Host names may hold ranges (``node[01-04]``)."""
    parts = value.split("@")
    entries = [
        p for i, p in enumerate(parts) if i == len(parts) - 1 or p.strip().lower() in known or ":" in p
    ]
    out: list[tuple[list[str], list[int] | None]] = []
    for entry in entries:
        host, colon, ids = entry.strip().rpartition(":") if ":" in entry else (entry.strip(), "", "")
        slots = None
        if colon:
            try:
                slots = [int(i) for i in ids.split(",")]
            except ValueError:
                raise ConfigError(
                    f"{flag} {value!r}: slots {ids!r} of {host} are not numbers; write host:0,2"
                ) from None
        for item in [host] if colon else _split_entries(host):
            if not item.strip():
                raise ConfigError(
                    f"{flag} {value!r}: empty name; write {flag} host1,host2 or host1:0,1@host2"
                )
            names, _, _ = _split_host(item.strip(), f"{flag} {value!r}")
            out.append(([n.lower() for n in names], slots))
    return out


def filter_hosts(hosts: list[Host], include: str | None, exclude: str | None) -> list[Host]:
    """Keep only ``include``d hosts or slots, or drop ``exclude``d ones (DeepSpeed's
    ``--include`` / ``--exclude``: ``"host1:0,2@host2"`` keeps slots 0 and 2 of host1 and
    all of host2; ``--exclude host1:1`` drops slot 1 of host1). A host whose slots were
    selected gets them as ``devices`` and that many slots. Call after
    :func:`resolve_slots` (slot ids are checked against the slot counts). Order of
    ``hosts`` is kept; names match case-insensitively; ``user@`` is ignored.

    Raises ConfigError: both given (as DeepSpeed, they are mutually exclusive), a name
    not in ``hosts``, a slot id the host does not have, a host named twice (its
    meaning differs between DeepSpeed versions; the error gives the one-entry
    spelling), or nothing left.
    """
    if include is not None and exclude is not None:
        raise ConfigError("--include and --exclude are mutually exclusive; use one")
    if include is None and exclude is None:
        return list(hosts)
    flag, value = ("--include", include) if include is not None else ("--exclude", exclude)
    assert value is not None
    by_name = {h.name.lower(): h for h in hosts}
    chosen: dict[str, set[int]] = {}  # host -> slot ids selected (include) or dropped (exclude)
    twice = None
    for names, slots in _selection(value, flag, set(by_name)):
        for name in names:
            if name not in by_name:
                listed = ", ".join(h.name for h in hosts)
                raise ConfigError(f"{flag}: {name} not in the host list ({listed}); fix the name")
            count = slots_of(by_name[name])
            bad = [i for i in slots or () if not 0 <= i < count]
            if bad:
                wrong = ", ".join(map(str, bad))
                raise ConfigError(f"{flag}: {name} has slots 0..{count - 1}, not {wrong}; fix the slot ids")
            twice = twice or (name if name in chosen else None)
            chosen.setdefault(name, set()).update(range(count) if slots is None else slots)
    if twice is not None:
        # DeepSpeed's runner.py reads a host named twice as its last entry (before
        # parse_node_config_list) or as the union of the slot lists, a bare name then
        # losing its whole host (after): no one reading is the peer's, so none is ours.
        host, union = by_name[twice], sorted(chosen[twice])
        merged = host.name if len(union) == slots_of(host) else f"{host.name}:{','.join(map(str, union))}"
        raise ConfigError(f"{flag}: {host.name} is named twice; write {merged}")
    keep = []
    for h in hosts:
        all_ids = set(range(slots_of(h)))
        picked = chosen.get(h.name.lower(), set())
        ids = picked if flag == "--include" else all_ids - picked
        if ids:
            keep.append(h if ids == all_ids else replace(h, slots=len(ids), devices=tuple(sorted(ids))))
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
