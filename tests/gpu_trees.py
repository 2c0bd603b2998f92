"""Synthetic machines for the GPU tests: the sysfs and proc files of a 2-socket, 8-GPU
node (and variants) written under a directory, read by distlaunch.devices / numa
through their ``root`` argument or ``DISTLAUNCH_SYSFS_ROOT``.

The default machine: 2 sockets, one NUMA node each, 16 cores per node with 2 hyperthreads
(core c is CPUs c and c+32, so node0's cpulist is 0-15,32-47), two L3 complexes of 8 cores
per node, and 8 GPUs, 4 per socket.
"""

from __future__ import annotations

import os

BUS_IDS = [
    "0000:18:00.0",
    "0000:2a:00.0",
    "0000:3a:00.0",
    "0000:5d:00.0",
    "0000:9a:00.0",
    "0000:ab:00.0",
    "0000:ba:00.0",
    "0000:db:00.0",
]
UUIDS = [f"GPU-{i}{i}{i}{i}abcd-0000-1111-2222-33334444555{i}" for i in range(8)]


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def build_machine(root, nodes_per_socket: int = 1, sockets: int = 2, cores: int = 32, gpus: int = 8):
    """Write the sysfs and proc files of a machine: ``cores`` physical cores with two
    hyperthreads each (c and c + cores), split evenly over sockets x nodes_per_socket
    NUMA nodes, L3 complexes of 8 cores, GPUs spread evenly over the nodes."""
    nodes = sockets * nodes_per_socket
    per_node = cores // nodes
    sysd = os.path.join(root, "sys", "devices", "system")
    for n in range(nodes):
        first = n * per_node
        last = first + per_node - 1
        write(
            os.path.join(sysd, "node", f"node{n}", "cpulist"),
            f"{first}-{last},{first + cores}-{last + cores}",
        )
    for cpu in range(2 * cores):
        core = cpu % cores
        base = os.path.join(sysd, "cpu", f"cpu{cpu}")
        write(os.path.join(base, "topology", "physical_package_id"), str(core // (cores // sockets)))
        write(os.path.join(base, "topology", "thread_siblings_list"), f"{core},{core + cores}")
        ccx = core // 8 * 8
        caches = [
            ("Data", 1, f"{core},{core + cores}"),
            ("Instruction", 4, f"0-{2 * cores - 1}"),  # must be ignored: not a data cache
            ("Unified", 3, f"{ccx}-{ccx + 7},{ccx + cores}-{ccx + cores + 7}"),
        ]
        for i, (kind, level, shared) in enumerate(caches):
            d = os.path.join(base, "cache", f"index{i}")
            write(os.path.join(d, "type"), kind)
            write(os.path.join(d, "level"), str(level))
            write(os.path.join(d, "shared_cpu_list"), shared)
    for g in range(gpus):
        bus = BUS_IDS[g]
        write(os.path.join(root, "sys", "bus", "pci", "devices", bus, "numa_node"), str(g * nodes // gpus))
        info = (
            f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {UUIDS[g]}\n"
            f"Bus Location: \t {bus}\nDevice Minor: \t {g}"
        )
        write(os.path.join(root, "proc", "driver", "nvidia", "gpus", bus, "information"), info)
    return str(root)


def set_numa_node(root, bus: str, value: str) -> None:
    write(os.path.join(root, "sys", "bus", "pci", "devices", bus, "numa_node"), value)


# The launch tests' machine: node0's and node1's cpulists each hold one of CPUs 0 and 1,
# so that on a 2-CPU test machine each socket's GPUs still have a CPU (a larger machine
# gives node0 more of its CPUs: the tests intersect with their own affinity).
NODE_CPULISTS = ("0,2-15,32-47", "1,16-31,48-63")


def launch_machine(root) -> str:
    """The default 2-socket, 8-GPU machine (GPUs 0-3 on NUMA node 0, 4-7 on node 1),
    its node cpulists replaced by NODE_CPULISTS."""
    build_machine(root)
    for n, text in enumerate(NODE_CPULISTS):
        write(os.path.join(root, "sys", "devices", "system", "node", f"node{n}", "cpulist"), text)
    return str(root)


def intel_render_nodes(root, count: int) -> str:
    """``count`` DRM render nodes of Intel GPUs (``--nproc-per-node xpu``) and one of
    another vendor, which must not count."""
    drm = os.path.join(root, "sys", "class", "drm")
    for i in range(count):
        write(os.path.join(drm, f"renderD{128 + i}", "device", "vendor"), "0x8086")
    write(os.path.join(drm, f"renderD{128 + count}", "device", "vendor"), "0x10de")
    return str(root)
