"""The GPUs this launcher may use, and which of them each local rank gets.

Pure functions over an environment mapping and a filesystem root (``/`` in production, a
directory tree in tests); NVML is reached only through an injectable callable. Nothing
here blocks beyond reading small files, and nothing starts a process.

Which GPUs are visible (:func:`visible_gpus`), in this order:

1. ``CUDA_VISIBLE_DEVICES`` when set, parsed as CUDA does (see
   :func:`parse_visible_devices`); HIP honours it too;
2. else ``HIP_VISIBLE_DEVICES``, else ``ROCR_VISIBLE_DEVICES`` (AMD; HIP's list selects
   among ROCR's, so the innermost one set is the list, as ``torch.cuda`` reads them);
3. else NVML (the ``nvidia-ml-py`` package, the optional ``gpu`` extra, imported only
   when this runs and only if installed);
4. else the NVIDIA driver's proc files, one directory per GPU under
   ``/proc/driver/nvidia/gpus/<bus id>/``.

Placement (:func:`place_gpus`) gives local rank ``i`` the devices ``[i*K, (i+1)*K)`` of
that list (the user's own subset and order kept) and writes them into the rank's own
visibility variable, as Slurm's ``srun --gpus-per-task K --gpu-bind per_task:K`` does; torchrun's
``--virtual-local-rank`` is the case ``K = 1`` with ``LOCAL_RANK=0``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .env import lookup
from .errors import ConfigError

CUDA_VAR = "CUDA_VISIBLE_DEVICES"
# Read in this order: the first one set is the visible list.
VISIBILITY_VARS = (CUDA_VAR, "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
PROC_GPUS = os.path.join("proc", "driver", "nvidia", "gpus")  # under the root
NO_DRIVER, NO_GPU = "no NVIDIA driver", "NVML lists no GPU"  # VisibleDevices.source of an empty list


@dataclass(frozen=True)
class Gpu:
    """One physical NVIDIA GPU as NVML or the driver's proc files describe it.

    ``index``: NVML's (and ``nvidia-smi``'s) index, which is PCI bus order; ``uuid``:
    ``GPU-...`` ("" when unknown); ``bus_id``: normalised PCI address (see
    :func:`normalize_bus_id`, done here: any spelling may be given); ``mig``: the UUIDs
    (``MIG-...``) of its MIG devices when MIG mode is on (NVML only)."""

    index: int
    uuid: str
    bus_id: str
    mig: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "bus_id", normalize_bus_id(self.bus_id))


@dataclass(frozen=True)
class Device:
    """One device a worker may be given: ``id`` as the visibility variable spells it
    (``"3"``, ``"GPU-8932f937"``, ``"MIG-..."``), ``bus_id`` the PCI address of the GPU
    (the parent GPU for a MIG device) when known, None otherwise (AMD, an unknown UUID)."""

    id: str
    bus_id: str | None = None


@dataclass(frozen=True)
class VisibleDevices:
    """The devices this launcher may use, in the order ranks receive them.

    ``variable``: the environment variable a rank's own list is written to (the one the
    list came from; ``CUDA_VISIBLE_DEVICES`` when discovered from NVML or proc files).
    ``source``: where the list came from, for messages and ``--dry-run``: the variable
    with its value, ``NVML``, the proc directory, or (empty) ``NO_DRIVER`` / ``NO_GPU``."""

    devices: tuple[Device, ...]
    variable: str
    source: str

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]

    def __len__(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class RankDevices:
    """What one local rank gets: ``local_rank`` is its real local rank (also under
    ``--virtual-local-rank``, where its ``LOCAL_RANK`` says 0), ``devices`` its share of
    the visible list, ``env`` the variables to set in its environment on top of the
    launcher's (its visibility variable, and ``LOCAL_RANK`` in virtual mode)."""

    local_rank: int
    devices: tuple[Device, ...]
    env: Mapping[str, str] = field(default_factory=dict)


# --- parsing ---------------------------------------------------------------------------

_LEADING_INT = re.compile(r"[+-]?\d+")


def parse_visible_devices(value: str) -> list[str]:
    """Entries of a ``CUDA_VISIBLE_DEVICES`` (or HIP/ROCR) value that CUDA makes visible.

    Follows the CUDA Programming Guide (Environment Variables, ``CUDA_VISIBLE_DEVICES``)
    and ``torch.cuda._parse_visible_devices``, which mirrors the driver:

    - an empty value means no device; entries are comma-separated, blanks around them
      ignored;
    - a list starting with ``GPU-`` (UUIDs, abbreviations allowed) or ``MIG-`` (MIG device
      ids) is read up to the first entry without that prefix;
    - otherwise each entry is read like ``strtoul``: its leading (signed) integer counts
      (``1gpu2`` is ``1``); the first negative or unreadable entry ends the list
      (``0,2,-1,1`` is ``0,2``; ``-1`` alone hides every device);
    - an id given twice hides every device (the driver's rule, tested by torch).

    Indices come back in canonical form (``+3`` -> ``"3"``); UUIDs verbatim.
    """
    entries = [e.strip() for e in value.split(",")]
    out: list[str] = []
    prefix = next((p for p in ("GPU-", "MIG-") if entries[0].startswith(p)), None)
    for entry in entries:
        if prefix is not None:
            if not entry.startswith(prefix):
                break
            ident = entry
        else:
            m = _LEADING_INT.match(entry)
            if m is None or int(m.group()) < 0:
                break
            ident = str(int(m.group()))
        if ident in out:
            return []
        out.append(ident)
    return out


def normalize_bus_id(text: str) -> str:
    """A PCI address as sysfs names it: lowercase, a 4-hex-digit domain.

    NVML's ``00000000:1B:00.0``, the proc directory's ``0000:1b:00.0`` and a bare
    ``1b:00.0`` all give ``0000:1b:00.0``. Raises ValueError for anything else."""
    m = re.fullmatch(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])", text.strip())
    if m is None:
        raise ValueError(f"not a PCI bus id: {text!r}")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn}"


# --- discovery -------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older nvidia-ml-py gives bytes


def nvml_gpus() -> list[Gpu] | None:
    """Every NVIDIA GPU on this machine from NVML, or None when ``nvidia-ml-py`` is not
    installed or NVML cannot start (no driver, no library). Ignores
    ``CUDA_VISIBLE_DEVICES`` (NVML always sees the whole machine). Blocks while NVML
    initialises (well under a second on a healthy node)."""
    try:
        import pynvml  # the optional 'gpu' extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus_id = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
            gpus.append(Gpu(i, _text(pynvml.nvmlDeviceGetUUID(h)), bus_id, _nvml_migs(pynvml, h)))
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_migs(pynvml: Any, handle: Any) -> tuple[str, ...]:
    """UUIDs of a GPU's MIG devices when its MIG mode is on, else ()."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:  # NotSupported: a GPU without MIG
        return ()
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return ()
    out = []
    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
        except pynvml.NVMLError:  # NotFound: an empty MIG slot
            continue
        out.append(_text(pynvml.nvmlDeviceGetUUID(mig)))
    return tuple(out)


def proc_gpus(root: str = "/") -> list[Gpu]:
    """Every NVIDIA GPU the driver lists under ``<root>/proc/driver/nvidia/gpus/``
    (one directory per GPU, named by its bus id), indexed in PCI bus order as NVML and
    ``nvidia-smi`` index them; the UUID read from its ``information`` file ("" if
    absent). An empty list without the directory (no NVIDIA driver)."""
    base = os.path.join(root, PROC_GPUS)
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        try:
            bus_id = normalize_bus_id(name)
        except ValueError:
            continue
        found.append((bus_id, _proc_uuid(os.path.join(base, name, "information"))))
    return [Gpu(i, uuid, bus_id) for i, (bus_id, uuid) in enumerate(sorted(found))]


def _proc_uuid(path: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "GPU UUID":
                    return value.strip()
    except OSError:
        pass
    return ""


def _resolve(ident: str, gpus: Sequence[Gpu]) -> Gpu | None:
    """The GPU an entry names (an index, a UUID or its prefix, a MIG id), or None."""
    if ident.isdigit():
        i = int(ident)
        return gpus[i] if i < len(gpus) else None
    if ident.startswith("MIG-"):
        for g in gpus:
            if ident in g.mig:
                return g
        parent = ident[4:].split("/")[0]  # old form MIG-GPU-<uuid>/<gi>/<ci>
        if not parent.startswith("GPU-"):
            return None
        ident = parent
    matches = [g for g in gpus if g.uuid and g.uuid.startswith(ident)]
    return matches[0] if len(matches) == 1 else None


def _checkable(ident: str, gpus: Sequence[Gpu]) -> bool:
    """Whether the known GPUs can tell that ``ident`` names none of them: an index, or a
    UUID when every GPU's UUID is known; never a MIG id (NVML may not list them)."""
    if not gpus or ident.startswith("MIG-"):
        return False
    return ident.isdigit() or all(g.uuid for g in gpus)


def visible_gpus(
    environ: Mapping[str, str],
    root: str = "/",
    nvml: Callable[[], list[Gpu] | None] = nvml_gpus,
) -> VisibleDevices:
    """The devices this process may use (see the module docstring for the order).

    ``environ``: the launcher's environment; ``root``: where ``/proc`` and ``/sys`` are;
    ``nvml``: returns the machine's GPUs or None (tests pass their own). Raises nothing:
    an empty result means no GPU (check with :func:`require_gpus`).

    The machine's GPUs (NVML, else proc files) are read even when a variable is set, to
    find each device's PCI bus id and, as CUDA and ``torch.cuda.device_count`` do, to
    end the list at the first index or UUID that names no GPU. MIG: every listed MIG
    device is kept so that ranks can get one each (one process sees at most one, CUDA's
    rule); without a variable, a GPU in MIG mode contributes its MIG devices.

    Discovered GPUs are numbered in PCI bus order (NVML's and ``nvidia-smi``'s indices),
    which is CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and, on a node of
    identical GPUs, under CUDA's default (fastest first) too.
    """
    gpus = nvml()
    from_nvml = gpus is not None
    if gpus is None:
        gpus = proc_gpus(root)
    for var in VISIBILITY_VARS:
        value = lookup(var, environ)
        if value is None:
            continue
        devices = []
        for ident in parse_visible_devices(value):
            gpu = _resolve(ident, gpus) if var == CUDA_VAR else None
            if gpu is None and var == CUDA_VAR and _checkable(ident, gpus):
                break  # names no GPU on this machine: CUDA stops the list here
            devices.append(Device(ident, gpu.bus_id if gpu else None))
        return VisibleDevices(tuple(devices), var, f"{var}={value!r}")
    devices = []
    for g in gpus:
        devices.extend([Device(m, g.bus_id) for m in g.mig] or [Device(str(g.index), g.bus_id)])
    source = (NO_GPU if not gpus else "NVML") if from_nvml else ("/" + PROC_GPUS if gpus else NO_DRIVER)
    return VisibleDevices(tuple(devices), CUDA_VAR, source)


def require_gpus(visible: VisibleDevices, option: str = "--nproc-per-node gpu") -> int:
    """The number of visible devices; raises ConfigError (exit 2) naming ``option`` and
    where the (empty) list came from when there is none."""
    if visible.devices:
        return len(visible)
    if visible.source in (NO_DRIVER, NO_GPU):
        why = f"no GPU found on this node ({visible.source}, no CUDA/HIP/ROCR_VISIBLE_DEVICES)"
    else:
        why = f"no GPU visible ({visible.source} hides every GPU)"
    raise ConfigError(f"{option}: {why}; make GPUs visible, or give a number or 'cpu'")


# --- placement -------------------------------------------------------------------------


def place_gpus(
    visible: VisibleDevices,
    local_world_size: int,
    gpus_per_rank: int = 1,
    virtual_local_rank: bool = False,
) -> list[RankDevices]:
    """Each local rank's devices and environment overrides, for ranks
    ``0 .. local_world_size - 1``.

    Local rank ``i`` gets ``visible.devices[i*K:(i+1)*K]`` (``K = gpus_per_rank``) and
    its visibility variable (``visible.variable``) set to just those, so ``cuda:0`` is
    its first device (Slurm's ``--gpu-bind per_task:K``); ``LOCAL_RANK``
    stays the real local rank. With ``virtual_local_rank`` (torchrun's
    ``--virtual-local-rank``) ``LOCAL_RANK`` is ``"0"`` as well, so a script's
    ``torch.cuda.set_device(LOCAL_RANK)`` picks its own device; torchrun sets no other
    variable for the real local rank (it survives only in the ``${local_rank}`` argument
    macro and log prefixes): here it is ``RankDevices.local_rank``. Devices left over
    (more visible than ranks need) are given to nobody. Without placement torchrun
    leaves the variable inherited; that is not calling this.

    Raises ConfigError (exit 2): ``gpus_per_rank`` below 1; more than one MIG device per
    rank (CUDA shows a process one MIG device); more devices asked for than visible,
    naming both numbers and the largest ``--nproc-per-node`` that fits.
    """
    k, n = gpus_per_rank, len(visible)
    what = "--virtual-local-rank" if virtual_local_rank and k == 1 else f"--gpus-per-rank {k}"
    if k < 1:
        raise ConfigError(f"--gpus-per-rank {k} is invalid: give at least 1")
    if k > 1 and any(d.id.startswith("MIG-") for d in visible.devices):
        raise ConfigError(
            f"--gpus-per-rank {k}: the visible devices are MIG devices ({visible.source}) and "
            "CUDA shows a process only one MIG device; use --gpus-per-rank 1"
        )
    if local_world_size * k > n:
        require_gpus(visible, what)
        fix = f"use --nproc-per-node {n // k}" if n >= k else f"use --gpus-per-rank {n}"
        raise ConfigError(
            f"{what}: {local_world_size} workers x {k} GPU{'s' if k > 1 else ''} need "
            f"{local_world_size * k} GPUs but {n} are visible ({visible.source}); "
            f"{fix} or make more GPUs visible"
        )
    out = []
    for i in range(local_world_size):
        mine = visible.devices[i * k : (i + 1) * k]
        env = {visible.variable: ",".join(d.id for d in mine)}
        if virtual_local_rank:
            env["LOCAL_RANK"] = "0"
        out.append(RankDevices(i, mine, env))
    return out


def torchrun_gpus(visible: VisibleDevices, local_world_size: int) -> list[tuple[Device, ...]]:
    """Each local rank's GPU when nothing is placed: torchrun's rule (its NUMA binding
    takes local rank i's GPU to be ``cuda:i``), i.e. visible device i; none for a rank
    beyond the list. For :func:`distlaunch.numa.numa_bindings` without placement."""
    return [visible.devices[i : i + 1] for i in range(local_world_size)]


# --- the launcher's view ---------------------------------------------------------------

SYSFS_ROOT_VAR = "DISTLAUNCH_SYSFS_ROOT"  # for tests: a directory tree standing in for /


def discovery_root(environ: Mapping[str, str]) -> str:
    """Where ``/proc`` and ``/sys`` are read: ``DISTLAUNCH_SYSFS_ROOT`` when set (a test's
    synthetic machine), else ``/``."""
    from .env import lookup

    return lookup(SYSFS_ROOT_VAR, environ) or "/"


def node_gpus(environ: Mapping[str, str]) -> VisibleDevices:
    """:func:`visible_gpus` of this node as the launcher sees it: under
    ``DISTLAUNCH_SYSFS_ROOT`` the tree is the whole machine and NVML is not asked (its
    answer would be the real machine's); else NVML, then ``/proc``."""
    root = discovery_root(environ)
    return visible_gpus(environ, root, (lambda: None) if root != "/" else nvml_gpus)


XPU_VAR = "ZE_AFFINITY_MASK"
_INTEL_VENDOR = "0x8086"


def xpu_count(environ: Mapping[str, str]) -> tuple[int, str]:
    """Intel GPUs (XPUs) this process may use, and where the count came from, for
    ``--nproc-per-node xpu``. torchrun counts ``torch.xpu.device_count()``: the Level
    Zero devices the SYCL runtime enumerates. Without importing torch, the same rule
    from its inputs: ``ZE_AFFINITY_MASK`` when set and not empty (the Level Zero
    specification, "Affinity Mask": a comma-separated list of ``device`` or
    ``device.subdevice`` entries; each is one device under the default flat hierarchy),
    else the DRM render nodes whose PCI vendor is Intel
    (``<root>/sys/class/drm/renderD*/device/vendor`` is ``0x8086``)."""
    mask = (lookup(XPU_VAR, environ) or "").strip()
    if mask:
        entries = {e.strip() for e in mask.split(",") if e.strip()}
        return len(entries), f"{XPU_VAR}={mask!r}"
    base = os.path.join(discovery_root(environ), "sys", "class", "drm")
    try:
        names = os.listdir(base)
    except OSError:
        names = []
    count = 0
    for name in names:
        if name.startswith("renderD"):
            try:
                with open(os.path.join(base, name, "device", "vendor")) as f:
                    count += f.read().strip().lower() == _INTEL_VENDOR
            except OSError:
                continue
    return count, "Intel DRM render nodes in /sys/class/drm"


def wait_gpu_release(
    pids: Sequence[int], timeout: float = 30.0, on_wait: Callable[[str], None] | None = None
) -> bool:
    """Before a restart: block (up to ``timeout`` seconds) until no GPU lists any of
    ``pids`` among its compute processes (NVML's ``nvmlDeviceGetComputeRunningProcesses``),
    so the new attempt does not meet memory the old one still holds, as NVIDIA's
    fault-tolerance launcher (``nvidia-resiliency-ext``) waits before restarting ranks.
    ``on_wait`` gets one line when the wait begins. Returns True when released (or when
    NVML is not installed or cannot start: nothing to wait on), False on timeout. Never
    raises. In a container with its own PID namespace NVML reports the host's pids, which
    match none of ``pids``: the wait then ends at once (not run on a GPU here)."""
    try:
        import pynvml  # the optional 'gpu' extra
    except ImportError:
        return True
    import time

    old = set(pids)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return True
    try:
        deadline, said = time.monotonic() + timeout, False
        while True:
            held = set()
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                held |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)} & old
            if not held:
                return True
            if not said and on_wait is not None:
                on_wait(
                    f"waiting up to {timeout:g} s for the previous attempt's processes "
                    f"{','.join(map(str, sorted(held)))} to release their GPU memory"
                )
                said = True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
    except pynvml.NVMLError:
        return True
    finally:
        pynvml.nvmlShutdown()
