"""GPU visibility, per-rank placement and NUMA binding (distlaunch.devices, distlaunch.numa),
on real sysfs/proc directory trees of synthetic machines built in tmp_path.

The default machine: 2 sockets, one NUMA node each, 16 cores per node with 2 hyperthreads
(core c is CPUs c and c+32, so node0's cpulist is 0-15,32-47), two L3 complexes of 8 cores
per node, and 8 GPUs, 4 per socket.
"""

from __future__ import annotations

import os

import pytest
from gpu_trees import BUS_IDS, UUIDS, build_machine, set_numa_node, write
from hypothesis import given, settings
from hypothesis import strategies as st

from distlaunch.devices import (
    Device,
    Gpu,
    VisibleDevices,
    normalize_bus_id,
    nvml_gpus,
    parse_visible_devices,
    place_gpus,
    proc_gpus,
    require_gpus,
    torchrun_gpus,
    visible_gpus,
)
from distlaunch.errors import ConfigError
from distlaunch.numa import numa_bindings, parse_cpulist

ALL_CPUS = frozenset(range(64))
NO_NVML = lambda: None  # this machine's GPUs come from the proc tree


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


@pytest.fixture
def machine(tmp_path):
    return build_machine(tmp_path)


# --- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0,1,2,3", ["0", "1", "2", "3"]),
        ("", []),
        ("-1", []),
        ("0,2,-1,1", ["0", "2"]),  # the CUDA guide's example: nothing after an invalid entry
        ("1gpu2,2ampere", ["1", "2"]),  # strtoul: the leading integer counts
        ("0, 1, 2, -1, 3", ["0", "1", "2"]),
        ("0, 1, 2, 1", []),  # an index twice hides everything
        ("2, +3, -0, 5", ["2", "3", "0", "5"]),
        ("one,two,3,4", []),
        ("4,3,two,one", ["4", "3"]),
        ("0,,1", ["0"]),
        ("GPU-9e8d35e3", ["GPU-9e8d35e3"]),
        ("GPU-9e8d35e3,GPU-aaaa,2", ["GPU-9e8d35e3", "GPU-aaaa"]),
        ("GPU-9e8d35e3,GPU-9e8d35e3", []),
        ("MIG-GPU-9e8d35e3/1/0,MIG-abc", ["MIG-GPU-9e8d35e3/1/0", "MIG-abc"]),
    ],
)
def test_parse_visible_devices_follows_cuda(value, expected):
    assert parse_visible_devices(value) == expected


def test_bus_ids_and_cpulists_are_normalised():
    assert normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"  # NVML's spelling
    assert normalize_bus_id("1b:00.0") == "0000:1b:00.0"
    assert normalize_bus_id(" 0001:DB:1F.7\n") == "0001:db:1f.7"
    for bad in ("", "1b:00", "gpu0", "0000:1b:00.8"):
        with pytest.raises(ValueError):
            normalize_bus_id(bad)
    assert parse_cpulist("0-15,32-47\n") == frozenset([*range(16), *range(32, 48)])
    assert parse_cpulist("\n") == frozenset()
    assert parse_cpulist("7") == {7}
    with pytest.raises(ValueError):
        parse_cpulist("3-1")


# --- visibility ----------------------------------------------------------------------------


def test_proc_files_give_every_gpu_in_bus_order(machine):
    gpus = proc_gpus(machine)
    assert [(g.index, g.uuid, g.bus_id) for g in gpus] == list(zip(range(8), UUIDS, BUS_IDS))
    v = visible_gpus({}, machine, nvml=NO_NVML)
    assert v.ids == [str(i) for i in range(8)]
    assert [d.bus_id for d in v.devices] == BUS_IDS
    assert (v.variable, v.source) == ("CUDA_VISIBLE_DEVICES", "/proc/driver/nvidia/gpus")
    assert require_gpus(v) == 8


def test_nvml_wins_over_proc_files(machine):
    nvml = lambda: [Gpu(0, UUIDS[5], "00000000:AB:00.0"), Gpu(1, UUIDS[6], "00000000:BA:00.0")]
    v = visible_gpus({}, machine, nvml=nvml)
    assert (v.ids, v.source) == (["0", "1"], "NVML")
    assert [d.bus_id for d in v.devices] == ["0000:ab:00.0", "0000:ba:00.0"]


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="this machine has an NVIDIA driver")
def test_default_nvml_loader_falls_back_without_a_driver(machine):
    """The real loader (nvidia-ml-py absent, or present without libnvidia-ml) gives None,
    and the proc tree is read instead."""
    assert nvml_gpus() is None
    assert visible_gpus({}, machine).source == "/proc/driver/nvidia/gpus"


def test_cuda_visible_devices_subset_and_order_are_kept(machine):
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "6,2"}, machine, nvml=NO_NVML)
    assert v.ids == ["6", "2"]
    assert [d.bus_id for d in v.devices] == [BUS_IDS[6], BUS_IDS[2]]
    assert v.source == "CUDA_VISIBLE_DEVICES='6,2'"


def test_uuids_abbreviated_resolve_to_their_gpu(machine):
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-5555,GPU-1111abcd-0000"}, machine, nvml=NO_NVML)
    assert v.ids == ["GPU-5555", "GPU-1111abcd-0000"]
    assert [d.bus_id for d in v.devices] == [BUS_IDS[5], BUS_IDS[1]]


def test_an_entry_naming_no_gpu_ends_the_list(machine):
    """As CUDA (and torch.cuda.device_count) do: index 9 on an 8-GPU machine, or an unknown
    UUID, hides itself and everything after it."""
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,9,1"}, machine, nvml=NO_NVML).ids == ["0"]
    assert visible_gpus(
        {"CUDA_VISIBLE_DEVICES": "GPU-3333,GPU-ffff,GPU-4444"}, machine, nvml=NO_NVML
    ).ids == ["GPU-3333"]
    # without a GPU list (no driver) nothing can be checked: the entries are kept as given
    bare = visible_gpus({"CUDA_VISIBLE_DEVICES": "0,9"}, "/nonexistent", nvml=NO_NVML)
    assert bare.ids == ["0", "9"] and [d.bus_id for d in bare.devices] == [None, None]
    # nor can a UUID be refused when the driver's files do not give every GPU's UUID
    os.remove(os.path.join(machine, "proc", "driver", "nvidia", "gpus", BUS_IDS[7], "information"))
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ffff,GPU-2222"}, machine, nvml=NO_NVML)
    assert (v.ids, [d.bus_id for d in v.devices]) == (["GPU-ffff", "GPU-2222"], [None, BUS_IDS[2]])


@pytest.mark.parametrize("value", ["", "-1", "-1,0", "x"])
def test_empty_or_invalid_variable_means_no_gpu(machine, value):
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": value}, machine, nvml=NO_NVML)
    assert len(v) == 0
    with pytest.raises(ConfigError) as e:
        require_gpus(v)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith("--nproc-per-node gpu: no GPU visible")
    assert f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU" in msg


def test_no_driver_no_variable_is_one_line(tmp_path):
    v = visible_gpus({}, str(tmp_path), nvml=NO_NVML)
    assert (len(v), v.source) == (0, "no NVIDIA driver")
    with pytest.raises(ConfigError) as e:
        require_gpus(v)
    assert str(e.value) == (
        "--nproc-per-node gpu: no GPU found on this node (no NVIDIA driver, "
        "no CUDA/HIP/ROCR_VISIBLE_DEVICES); make GPUs visible, or give a number or 'cpu'"
    )
    v = visible_gpus({}, str(tmp_path), nvml=lambda: [])  # NVML runs and lists nothing
    assert (len(v), v.source) == (0, "NVML lists no GPU")
    with pytest.raises(ConfigError, match=r"^--gpus-per-rank 1: no GPU found on this node \(NVML lists"):
        require_gpus(v, "--gpus-per-rank 1")


def test_amd_variables(machine):
    v = visible_gpus({"ROCR_VISIBLE_DEVICES": "0,3"}, machine, nvml=NO_NVML)
    assert (v.ids, v.variable) == (["0", "3"], "ROCR_VISIBLE_DEVICES")
    assert [d.bus_id for d in v.devices] == [None, None]  # NVIDIA's tables say nothing of AMD GPUs
    # HIP's list selects among ROCR's: HIP is the list, and what a rank's own list is written to
    v = visible_gpus({"ROCR_VISIBLE_DEVICES": "0,1,2", "HIP_VISIBLE_DEVICES": "2,0"}, machine, nvml=NO_NVML)
    assert (v.ids, v.variable) == (["2", "0"], "HIP_VISIBLE_DEVICES")
    assert [r.env for r in place_gpus(v, 2)] == [{"HIP_VISIBLE_DEVICES": "2"}, {"HIP_VISIBLE_DEVICES": "0"}]
    v = visible_gpus({"HIP_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": "1"}, machine, nvml=NO_NVML)
    assert (v.ids, v.variable) == (["1"], "CUDA_VISIBLE_DEVICES")  # HIP honours CUDA's variable first
    assert len(visible_gpus({"HIP_VISIBLE_DEVICES": "-1"}, machine, nvml=NO_NVML)) == 0


MIGS = [f"MIG-{i}0000000-aaaa-bbbb-cccc-dddddddddddd" for i in range(3)]


def test_mig_devices_one_per_rank(machine):
    nvml = lambda: [
        Gpu(0, UUIDS[0], BUS_IDS[0], (MIGS[0], MIGS[1])),
        Gpu(1, UUIDS[4], BUS_IDS[4], (MIGS[2],)),
    ]
    v = visible_gpus({}, machine, nvml=nvml)
    assert v.ids == MIGS  # a GPU in MIG mode contributes its MIG devices
    assert [d.bus_id for d in v.devices] == [BUS_IDS[0], BUS_IDS[0], BUS_IDS[4]]
    ranks = place_gpus(v, 3, virtual_local_rank=True)
    assert [r.env for r in ranks] == [{"CUDA_VISIBLE_DEVICES": m, "LOCAL_RANK": "0"} for m in MIGS]
    with pytest.raises(
        ConfigError, match=r"^--gpus-per-rank 2: the visible devices are MIG devices .* only one MIG"
    ):
        place_gpus(v, 1, gpus_per_rank=2)
    # the old form names its parent GPU; the new form is found through NVML's MIG list
    value = f"MIG-{UUIDS[5]}/1/0,{MIGS[2]}"
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": value}, machine, nvml=nvml)
    assert v.ids == [f"MIG-{UUIDS[5]}/1/0", MIGS[2]]
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": value}, machine, nvml=NO_NVML)
    assert [d.bus_id for d in v.devices] == [BUS_IDS[5], None]


# --- placement ----------------------------------------------------------------------------


def test_gpus_per_rank_takes_consecutive_blocks_of_the_users_list(machine):
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "7,6,5,4,3,2,1,0"}, machine, nvml=NO_NVML)
    ranks = place_gpus(v, 4, gpus_per_rank=2)
    assert [r.local_rank for r in ranks] == [0, 1, 2, 3]
    # LOCAL_RANK is not overridden: the launcher's real local rank stands
    assert [dict(r.env) for r in ranks] == [
        {"CUDA_VISIBLE_DEVICES": cvd} for cvd in ("7,6", "5,4", "3,2", "1,0")
    ]
    assert [[d.bus_id for d in r.devices] for r in ranks][0] == [BUS_IDS[7], BUS_IDS[6]]


def test_virtual_local_rank_is_torchruns(machine):
    """torchrun --virtual-local-rank: LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES the one entry
    of the parent's list at the real local rank (local_elastic_agent._set_local_rank_env)."""
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-3333,GPU-1111,GPU-7777"}, machine, nvml=NO_NVML)
    ranks = place_gpus(v, 3, virtual_local_rank=True)
    assert [dict(r.env) for r in ranks] == [
        {"CUDA_VISIBLE_DEVICES": u, "LOCAL_RANK": "0"} for u in ("GPU-3333", "GPU-1111", "GPU-7777")
    ]
    assert [r.local_rank for r in ranks] == [0, 1, 2]
    ranks = place_gpus(visible_gpus({}, machine, nvml=NO_NVML), 8, virtual_local_rank=True)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in ranks] == [str(i) for i in range(8)]


def test_oversubscription_is_one_line_naming_the_numbers(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    with pytest.raises(ConfigError) as e:
        place_gpus(v, 8, gpus_per_rank=2)
    assert str(e.value) == (
        "--gpus-per-rank 2: 8 workers x 2 GPUs need 16 GPUs but 8 are visible "
        "(/proc/driver/nvidia/gpus); use --nproc-per-node 4 or make more GPUs visible"
    )
    assert e.value.exit_code == 2
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}, machine, nvml=NO_NVML)
    with pytest.raises(
        ConfigError, match=r"^--virtual-local-rank: 4 workers x 1 GPU need 4 GPUs but 3 are visible "
    ):
        place_gpus(v, 4, virtual_local_rank=True)
    with pytest.raises(ConfigError, match=r"need 4 GPUs but 3 are visible .*; use --gpus-per-rank 3 or"):
        place_gpus(v, 1, gpus_per_rank=4)
    with pytest.raises(ConfigError, match=r"^--gpus-per-rank 0 is invalid"):
        place_gpus(v, 1, gpus_per_rank=0)
    empty = visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, machine, nvml=NO_NVML)
    with pytest.raises(ConfigError, match=r"^--virtual-local-rank: no GPU visible"):
        place_gpus(empty, 1, virtual_local_rank=True)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 16),
    local_world_size=st.integers(1, 8),
    k=st.integers(1, 4),
    virtual=st.booleans(),
    data=st.data(),
)
def test_placement_partitions_a_prefix_of_the_visible_list(n, local_world_size, k, virtual, data):
    ids = data.draw(st.permutations([str(i) for i in range(n)]))
    v = VisibleDevices(tuple(Device(i) for i in ids), "CUDA_VISIBLE_DEVICES", "test")
    if local_world_size * k > n:
        with pytest.raises(ConfigError):
            place_gpus(v, local_world_size, k, virtual)
        return
    ranks = place_gpus(v, local_world_size, k, virtual)
    given_out = [d.id for r in ranks for d in r.devices]
    assert given_out == ids[: local_world_size * k]  # disjoint, in the user's order, nothing skipped
    for r in ranks:
        assert len(r.devices) == k
        assert r.env["CUDA_VISIBLE_DEVICES"].split(",") == [d.id for d in r.devices]
        assert r.env.get("LOCAL_RANK") == ("0" if virtual else None)


# --- NUMA ----------------------------------------------------------------------------------

NODE0 = cpus("0-15,32-47")
NODE1 = cpus("16-31,48-63")


def test_node_binding_every_rank(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    out = numa_bindings("node", torchrun_gpus(v, 8), v, ALL_CPUS, machine)
    assert [b.cpus for b in out] == [NODE0] * 4 + [NODE1] * 4
    assert [b.mems for b in out] == [{0}] * 4 + [{1}] * 4
    assert all(b.note == "" for b in out)


def test_node_binding_follows_the_placed_gpu_not_the_local_rank(machine):
    """With CUDA_VISIBLE_DEVICES=4,0 and --virtual-local-rank, local rank 0 drives GPU 4 on
    socket 1: its CPUs are node 1's."""
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "4,0"}, machine, nvml=NO_NVML)
    ranks = place_gpus(v, 2, virtual_local_rank=True)
    assert [r.env for r in ranks] == [
        {"CUDA_VISIBLE_DEVICES": "4", "LOCAL_RANK": "0"},
        {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"},
    ]
    out = numa_bindings("node", [r.devices for r in ranks], v, ALL_CPUS, machine)
    assert [b.cpus for b in out] == [NODE1, NODE0]


def test_binding_stays_within_the_launchers_cpus(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    allowed = cpus("0-7,16-23")  # e.g. a cgroup cpuset without hyperthreads
    out = numa_bindings("node", torchrun_gpus(v, 8), v, allowed, machine)
    assert [b.cpus for b in out] == [cpus("0-7")] * 4 + [cpus("16-23")] * 4
    out = numa_bindings("node", torchrun_gpus(v, 8), v, cpus("0-15"), machine)
    assert [b.cpus for b in out][:4] == [cpus("0-15")] * 4
    assert [(b.cpus, b.mems, b.note) for b in out][4:] == [
        (None, None, "not bound: no CPU of NUMA node 1 is allowed here")
    ] * 4
    for mode in ("exclusive", "core-complex", "socket"):
        out = numa_bindings(mode, torchrun_gpus(v, 8), v, cpus("0-15,32-47"), machine)
        assert all(b.cpus is not None for b in out[:4]), mode
        assert [b.note for b in out[4:]] == ["not bound: no CPU of NUMA node 1 is allowed here"] * 4, mode


def test_unknown_numa_node_leaves_only_that_rank_unbound(machine):
    set_numa_node(machine, BUS_IDS[3], "-1")
    os.remove(os.path.join(machine, "sys", "bus", "pci", "devices", BUS_IDS[5], "numa_node"))
    v = visible_gpus({}, machine, nvml=NO_NVML)
    out = numa_bindings("node", torchrun_gpus(v, 8), v, ALL_CPUS, machine)
    assert [b.cpus for b in out] == [NODE0] * 3 + [None, NODE1, None, NODE1, NODE1]
    assert out[3].note == "not bound: GPU 3 has no NUMA node"
    assert out[5].note == "not bound: GPU 5 has no NUMA node"
    # a rank beyond the visible GPUs (torchrun's rule with more ranks than GPUs) has none
    v2 = visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, machine, nvml=NO_NVML)
    out = numa_bindings("node", torchrun_gpus(v2, 2), v2, ALL_CPUS, machine)
    assert [(b.cpus, b.note) for b in out] == [(NODE0, ""), (None, "not bound: the rank has no GPU")]


def test_socket_binding_spans_the_sockets_nodes(tmp_path):
    """Sub-NUMA clustering: 2 nodes per socket; socket mode gives both of the socket's
    nodes, node mode only the GPU's own."""
    root = build_machine(tmp_path, nodes_per_socket=2)
    v = visible_gpus({}, root, nvml=NO_NVML)
    node = numa_bindings("node", torchrun_gpus(v, 8), v, ALL_CPUS, root)
    assert [b.cpus for b in node][::2] == [
        cpus("0-7,32-39"),
        cpus("8-15,40-47"),
        cpus("16-23,48-55"),
        cpus("24-31,56-63"),
    ]
    sock = numa_bindings("socket", torchrun_gpus(v, 8), v, ALL_CPUS, root)
    assert [b.cpus for b in sock] == [NODE0] * 4 + [NODE1] * 4
    assert [b.mems for b in sock] == [{0, 1}] * 4 + [{2, 3}] * 4
    # the GPU's own node has no allowed CPU, its socket's other node has: socket mode binds
    sock = numa_bindings("socket", torchrun_gpus(v, 1), v, cpus("8-15"), root)
    assert [(b.cpus, b.mems) for b in sock] == [(cpus("8-15"), {0, 1})]


def test_exclusive_binding_splits_physical_cores(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    out = numa_bindings("exclusive", torchrun_gpus(v, 8), v, ALL_CPUS, machine)
    assert [b.cpus for b in out] == [
        cpus(f"{4 * i}-{4 * i + 3},{4 * i + 32}-{4 * i + 35}") for i in range(8)
    ]  # 16 cores / 4 GPUs per node: 4 cores each, with their hyperthreads
    assert [b.mems for b in out] == [{0}] * 4 + [{1}] * 4
    # 14 allowed cores on node 0: shares of 4, 4, 3, 3 (the lower GPUs get the extra ones)
    allowed = cpus("0-13,32-45,16-31,48-63")
    out = numa_bindings("exclusive", torchrun_gpus(v, 4), v, allowed, machine)
    assert [b.cpus for b in out] == [
        cpus("0-3,32-35"),
        cpus("4-7,36-39"),
        cpus("8-10,40-42"),
        cpus("11-13,43-45"),
    ]
    # two ranks with 4 GPUs each: the union of their GPUs' shares, i.e. whole nodes
    ranks = place_gpus(v, 2, gpus_per_rank=4)
    out = numa_bindings("exclusive", [r.devices for r in ranks], v, ALL_CPUS, machine)
    assert [b.cpus for b in out] == [NODE0, NODE1]
    with pytest.raises(ConfigError) as e:
        numa_bindings("exclusive", torchrun_gpus(v, 1), v, cpus("0-2,16-31"), machine)
    assert str(e.value) == (
        "--numa-binding exclusive: NUMA node 0 has 3 physical cores this launcher may use "
        "for its 4 GPUs; use --numa-binding node"
    )


def test_exclusive_divides_among_all_visible_gpus_of_the_node(machine):
    """As torch: the node is shared among its visible GPUs, not only the ones ranks use."""
    v = visible_gpus({"CUDA_VISIBLE_DEVICES": "1,0"}, machine, nvml=NO_NVML)
    out = numa_bindings("exclusive", torchrun_gpus(v, 1), v, ALL_CPUS, machine)
    assert out[0].cpus == cpus("0-7,32-39")  # GPU 1 is first of the node's two visible GPUs


def test_core_complex_binding(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    out = numa_bindings("core-complex", torchrun_gpus(v, 8), v, ALL_CPUS, machine)
    a, b = cpus("0-7,32-39"), cpus("8-15,40-47")
    c, d = cpus("16-23,48-55"), cpus("24-31,56-63")
    assert [x.cpus for x in out] == [a, b, a, b, c, d, c, d]  # 4 GPUs over 2 complexes: round robin
    # the larger (more allowed CPUs) complex comes first
    allowed = ALL_CPUS - cpus("0-3")
    out = numa_bindings("core-complex", torchrun_gpus(v, 2), v, allowed, machine)
    assert [x.cpus for x in out] == [b, a - cpus("0-3")]


def test_core_complex_without_cache_topology_is_the_node(machine):
    import shutil

    for cpu in range(64):
        shutil.rmtree(os.path.join(machine, "sys", "devices", "system", "cpu", f"cpu{cpu}", "cache"))
    v = visible_gpus({}, machine, nvml=NO_NVML)
    out = numa_bindings("core-complex", torchrun_gpus(v, 8), v, ALL_CPUS, machine)
    assert [x.cpus for x in out] == [NODE0] * 4 + [NODE1] * 4


def test_unknown_mode_is_a_usage_error(machine):
    v = visible_gpus({}, machine, nvml=NO_NVML)
    with pytest.raises(ConfigError, match=r"^--numa-binding 'nodes' is invalid: use one of node, socket"):
        numa_bindings("nodes", torchrun_gpus(v, 1), v, ALL_CPUS, machine)
