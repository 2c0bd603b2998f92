"""NUMA-aware CPU sets for ranks that drive GPUs, read from sysfs.

torchrun's ``--numa-binding node|socket|exclusive|core-complex`` (``torch/numa/binding.py``,
torch 2.13), computed from the same sysfs files under a root directory (``/`` in
production, a directory tree in tests):

- a GPU's NUMA node: ``<root>/sys/bus/pci/devices/<bus id>/numa_node``;
- a node's CPUs: ``<root>/sys/devices/system/node/node<N>/cpulist``;
- a CPU's socket: ``<root>/sys/devices/system/cpu/cpu<N>/topology/physical_package_id``;
- a CPU's physical core: its ``topology/thread_siblings_list`` (the lowest sibling names
  the core);
- a CPU's core complex: the CPUs sharing its highest-level data or unified cache
  (``cache/index*/{level,type,shared_cpu_list}``).

Where this differs from torch, on purpose: a ``numa_node`` of ``-1`` (the platform gave
no NUMA information) leaves that rank unbound, where torch assumes node 0; a rank with
several GPUs (``--gpus-per-rank``) gets the union of its GPUs' CPUs (torch has one GPU
per rank); a missing ``thread_siblings_list`` counts each CPU as its own core and a
missing cache directory makes the whole node one complex, where torch fails; a result
is also a memory node set (``mems``) for a memory policy, which torchrun does not set.
Everything is read when called; nothing blocks beyond small file reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .errors import ConfigError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:  # devices: only where GPUs are placed (not on a plain launch's path)
    from .config import LaunchConfig
    from .devices import Device, VisibleDevices

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")

_NODES = os.path.join("sys", "devices", "system", "node")
_CPUS = os.path.join("sys", "devices", "system", "cpu")
_PCI = os.path.join("sys", "bus", "pci", "devices")


@dataclass(frozen=True)
class NumaBinding:
    """One local rank's binding. ``cpus``: the CPUs it may run on (always within the
    launcher's allowed CPUs), None to leave its inherited affinity alone; ``mems``: the
    NUMA nodes its memory should come from (for ``numactl --membind`` or
    ``set_mempolicy``), None for no policy; ``note``: why the rank is left unbound, for
    one line of output ("" when bound)."""

    cpus: frozenset[int] | None
    mems: frozenset[int] | None
    note: str = ""


def parse_cpulist(text: str) -> frozenset[int]:
    """The kernel's CPU and node list format: ``0-15,32-47`` -> {0..15, 32..47}; an
    empty text (a node without CPUs) is the empty set. Raises ValueError otherwise."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        first, last = int(lo), int(hi) if dash else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        out.update(range(first, last + 1))
    return frozenset(out)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def gpu_numa_node(bus_id: str | None, root: str = "/") -> int | None:
    """The NUMA node of the PCI device ``bus_id`` (any spelling :func:`normalize_bus_id`
    takes), or None when unknown: no bus id, no sysfs entry, or ``-1`` (a platform
    without NUMA information)."""
    if bus_id is None:
        return None
    from .devices import normalize_bus_id

    text = _read(os.path.join(root, _PCI, normalize_bus_id(bus_id), "numa_node"))
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def node_cpus(root: str = "/") -> dict[int, frozenset[int]]:
    """Every NUMA node's CPUs (``node<N>/cpulist``), allowed or not; {} without sysfs."""
    base = os.path.join(root, _NODES)
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    out = {}
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            text = _read(os.path.join(base, name, "cpulist"))
            if text is not None:
                out[int(name[4:])] = parse_cpulist(text)
    return out


class _Topology:
    """The sysfs facts one computation needs, each file read once."""

    def __init__(self, root: str, allowed: frozenset[int]) -> None:
        self.root, self.allowed = root, allowed
        self.nodes = node_cpus(root)
        self._numa: dict[str | None, int | None] = {}

    def numa_of(self, device: Device) -> int | None:
        if device.bus_id not in self._numa:
            self._numa[device.bus_id] = gpu_numa_node(device.bus_id, self.root)
        return self._numa[device.bus_id]

    def cpu_file(self, cpu: int, *rel: str) -> str | None:
        return _read(os.path.join(self.root, _CPUS, f"cpu{cpu}", *rel))

    def socket_of_node(self, node: int) -> int | None:
        # Any CPU of the node names its package (torch takes an allowed one; any will do).
        for cpu in sorted(self.nodes.get(node, ())):
            text = self.cpu_file(cpu, "topology", "physical_package_id")
            if text is not None:
                return int(text)
        return None

    def core_of(self, cpu: int) -> int:
        text = self.cpu_file(cpu, "topology", "thread_siblings_list")
        return min(parse_cpulist(text)) if text else cpu

    def complex_of(self, cpu: int) -> int | None:
        """Lowest CPU sharing ``cpu``'s highest-level data/unified cache."""
        base = os.path.join(self.root, _CPUS, f"cpu{cpu}", "cache")
        try:
            entries = os.listdir(base)
        except OSError:
            return None
        best, key = -1, None
        for entry in entries:
            if not (entry.startswith("index") and entry[5:].isdecimal()):
                continue
            d = os.path.join(base, entry)
            level, kind, shared = (_read(os.path.join(d, f)) for f in ("level", "type", "shared_cpu_list"))
            if kind in ("Unified", "Data") and level and shared and int(level) > best:
                best, key = int(level), min(parse_cpulist(shared))
        return key


def _split_evenly(groups: list[list[int]], count: int, index: int) -> list[int]:
    """Share ``index`` of ``count`` contiguous shares of ``groups``, the first
    ``len(groups) % count`` shares one group larger (torch's exclusive split)."""
    per, extra = divmod(len(groups), count)
    start = index * per + min(index, extra)
    return [cpu for g in groups[start : start + per + (index < extra)] for cpu in g]


def _grouped(cpus: Iterable[int], key: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        out.setdefault(key[cpu], []).append(cpu)
    return out


def _gpu_cpus(mode: str, topo: _Topology, node: int, peers: list[Device], device: Device) -> set[int]:
    """The CPUs ``mode`` gives the GPU ``device`` on NUMA node ``node``, whose GPUs (in
    the visible order) are ``peers``."""
    node_allowed = topo.nodes.get(node, frozenset()) & topo.allowed
    if mode == "socket":
        sock = topo.socket_of_node(node)
        same = [n for n in topo.nodes if sock is not None and topo.socket_of_node(n) == sock] or [node]
        return {c for n in same for c in topo.nodes[n] & topo.allowed}
    if mode == "node" or not node_allowed:  # none allowed: the caller leaves the rank unbound
        return set(node_allowed)
    rel = peers.index(device) if device in peers else 0
    if mode == "exclusive":
        cores = _grouped(node_allowed, {c: topo.core_of(c) for c in node_allowed})
        if len(cores) < len(peers):
            raise ConfigError(
                f"--numa-binding exclusive: NUMA node {node} has {len(cores)} physical cores this "
                f"launcher may use for its {len(peers)} GPUs; use --numa-binding node"
            )
        return set(_split_evenly([cores[k] for k in sorted(cores)], len(peers), rel))
    # core-complex: one cache group per GPU, larger groups first, wrapping round (torch's order)
    keys = {c: topo.complex_of(c) for c in node_allowed}
    if any(k is None for k in keys.values()):
        return set(node_allowed)  # no cache topology: the node is one complex
    groups = _grouped(node_allowed, {c: k for c, k in keys.items() if k is not None})
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return set(ordered[rel % len(ordered)][1])


def numa_bindings(
    mode: str,
    ranks: Sequence[Sequence[Device]],
    visible: VisibleDevices,
    allowed_cpus: Iterable[int],
    root: str = "/",
) -> list[NumaBinding]:
    """Per local rank, its CPUs and memory nodes under ``--numa-binding mode``.

    ``ranks[i]``: local rank i's devices (``[r.devices for r in place_gpus(...)]``; for
    torchrun's own rule, rank i drives visible device i: ``devices.torchrun_gpus(...)``).
    ``visible``: every device of the node, in order (the ranks' devices come from it):
    ``exclusive`` and ``core-complex`` divide a NUMA node among all its visible GPUs, used
    or not, as torch does. ``allowed_cpus``: the launcher's own affinity (``os.sched_getaffinity(0)``,
    which honours taskset and cgroup cpusets); every set is within it.

    - ``node``: the CPUs of the GPU's NUMA node; memory from that node;
    - ``socket``: the CPUs of every NUMA node on the GPU's socket; memory from those;
    - ``exclusive``: the node's physical cores split into contiguous equal shares, one
      per GPU on the node in visible order (lower GPUs get one extra core when it does
      not divide), every hyperthread of a core with it;
    - ``core-complex``: one group of cores sharing the last-level cache per GPU, larger
      groups first, shared round robin when GPUs outnumber groups.

    A rank is unbound (``cpus`` None, ``note`` saying why) when it has no GPU, a GPU's
    NUMA node is unknown (``-1``, no bus id) or none of the CPUs are allowed. Raises
    ConfigError (exit 2) for an unknown mode, or ``exclusive`` with fewer physical
    cores than GPUs on a node.
    """
    if mode not in NUMA_MODES:
        raise ConfigError(f"--numa-binding {mode!r} is invalid: use one of {', '.join(NUMA_MODES)}")
    topo = _Topology(root, frozenset(allowed_cpus))
    by_node: dict[int, list[Device]] = {}
    for d in visible.devices:
        node = topo.numa_of(d)
        if node is not None:
            by_node.setdefault(node, []).append(d)
    out = []
    for devices in ranks:
        nodes = [topo.numa_of(d) for d in devices]
        unknown = [d.id for d, n in zip(devices, nodes) if n is None]
        if not devices or unknown:
            why = f"GPU {', '.join(unknown)} has no NUMA node" if unknown else "the rank has no GPU"
            out.append(NumaBinding(None, None, f"not bound: {why}"))
            continue
        known = [n for n in nodes if n is not None]  # all of them (checked above); for the type checker
        cpus: set[int] = set()
        for d, node in zip(devices, known):
            cpus |= _gpu_cpus(mode, topo, node, by_node.get(node, [d]), d)
        mems = set(known)
        if mode == "socket":  # memory from every node whose CPUs the rank got
            mems |= {n for n, c in topo.nodes.items() if c & cpus}
        if not cpus:
            where = ",".join(str(n) for n in sorted(mems))
            out.append(NumaBinding(None, None, f"not bound: no CPU of NUMA node {where} is allowed here"))
            continue
        out.append(NumaBinding(frozenset(cpus), frozenset(mems)))
    return out


@dataclass(frozen=True)
class RankBinding:
    """What the launcher applies to one local rank: ``env`` on top of its environment
    (its device variable, ``LOCAL_RANK`` under ``--virtual-local-rank``), ``cpus`` its CPU
    affinity (None: inherited), ``devices`` its placed devices (None: nothing placed),
    ``note`` why a NUMA binding left it unbound ("" otherwise)."""

    cpus: frozenset[int] | None
    devices: tuple[Device, ...] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    note: str = ""


def places_gpus(cfg: LaunchConfig) -> bool:
    """Whether the job places devices per rank (``--gpus-per-rank`` or ``--virtual-local-rank``)."""
    return cfg.gpus_per_rank is not None or cfg.virtual_local_rank


def rank_bindings(
    cfg: LaunchConfig, local_world_size: int, environ: Mapping[str, str], allowed_cpus: Iterable[int]
) -> list[RankBinding]:
    """Each local rank's devices, environment and CPUs on this node, from this node's
    own visible devices (``devices.node_gpus(environ)``) and the launcher's allowed CPUs
    (``os.sched_getaffinity(0)``):

    - devices: with ``--gpus-per-rank K`` / ``--virtual-local-rank``, ``devices.place_gpus``;
    - CPUs with ``--numa-binding MODE``: :func:`numa_bindings` of each rank's placed
      devices, or, without placement, torchrun's rule (local rank i drives device i);
    - CPUs with devices placed and ``--bind-to auto`` (GPU-aware auto): the CPUs of the
      rank's GPUs' NUMA node(s), split into disjoint contiguous blocks among the ranks
      whose GPUs share them (``topology.cpu_sets`` auto within that set); when a rank's
      GPUs have no known NUMA node, or span nodes that other ranks' GPUs use too, every
      rank gets its plain auto block instead (blocks cut from overlapping sets would
      overlap);
    - otherwise ``topology.cpu_sets(--bind-to)``, as without GPUs.

    Reads small files only. Raises ConfigError (exit 2): no GPU or too few for the
    placement, ``exclusive`` with fewer cores than GPUs (one line each)."""
    from .topology import cpu_sets

    allowed = frozenset(allowed_cpus)
    n = local_world_size
    placed = places_gpus(cfg)
    if not placed and cfg.numa_binding is None:
        return [RankBinding(c) for c in cpu_sets(cfg.bind_to, n, allowed)]
    from .devices import discovery_root, node_gpus, place_gpus, torchrun_gpus

    visible, root = node_gpus(environ), discovery_root(environ)
    if placed:
        ranks = place_gpus(visible, n, cfg.gpus_per_rank or 1, cfg.virtual_local_rank)
        per_rank = [r.devices for r in ranks]
        envs: list[Mapping[str, str]] = [r.env for r in ranks]
    else:
        per_rank, envs = torchrun_gpus(visible, n), [{} for _ in range(n)]
    devices = per_rank if placed else [None] * n
    if cfg.numa_binding is not None:
        found = numa_bindings(cfg.numa_binding, per_rank, visible, allowed, root)
        return [RankBinding(b.cpus, d, e, b.note) for b, d, e in zip(found, devices, envs)]
    cpus = cpu_sets(cfg.bind_to, n, allowed)
    if cfg.bind_to == "auto":  # GPU-aware: each rank near its GPUs, disjoint blocks
        near = numa_bindings("node", per_rank, visible, allowed, root)
        sharing: dict[frozenset[int], list[int]] = {}
        for i, b in enumerate(near):
            if b.cpus is not None:
                sharing.setdefault(b.cpus, []).append(i)
        pools = list(sharing)
        overlap = any(a & b for k, a in enumerate(pools) for b in pools[k + 1 :])
        if overlap or any(b.cpus is None for b in near):
            # a rank with no NUMA node, or whose GPUs span nodes others use too: blocks
            # cut from overlapping pools would overlap; the plain auto blocks do not
            sharing = {}
        for share, members in sharing.items():
            split = [share] if len(members) == 1 else cpu_sets("auto", len(members), share)
            for i, c in zip(members, split):
                cpus[i] = c
    return [RankBinding(c, d, e) for c, d, e in zip(cpus, devices, envs)]
