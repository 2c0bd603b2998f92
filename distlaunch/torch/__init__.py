"""A ``torch.distributed`` process-group backend named ``"distlaunch"`` on the
distlaunch collectives runtime (shared memory inside a node, TCP across nodes).

    import distlaunch.torch                      # registers the backend (needs torch)
    dist.init_process_group("distlaunch")        # instead of "gloo"; nothing else changes

Registration: importing this module calls ``torch.distributed.Backend.register_backend(
"distlaunch", ..., extended_api=True, devices=["cpu"])``. torch's only plugin entry
point, the ``torch.backends`` group (RFC pytorch#122468), is *not* used: torch loads and
calls every such entry point at ``import torch`` (unless TORCH_DEVICE_BACKEND_AUTOLOAD=0),
so distlaunch would be imported into the start-up of every torch program in the
environment, distributed or not, and any failure there would break ``import torch``
itself. One explicit import in the programs that want the backend is the cheaper
trade-off.

Bootstrap (which store the runtime rendezvouses on):

- under ``distlaunch run`` (DISTLAUNCH_STORE_PORT set, and torch's rank and world size
  are the launcher's RANK/WORLD_SIZE): the launcher's store, which is authenticated
  (docs/security.md); torch's own store (``env://`` TCPStore, ``tcp://``, ``file://`` or
  ``store=``) is not read at all. The launcher's node id decides which ranks share
  memory.
- otherwise (torchrun, ``tcp://``, ``file://`` or ``store=`` started by hand): the store
  torch passes to the backend, which is the only one every rank has. torch's TCPStore is
  not authenticated, so the transport secret never goes into it: rank 0 publishes a
  random nonce and every rank derives the key from it and a token (``Runtime``, as on
  every init path: ``secret.derive_key``), the token from
  ``distlaunch.secret.shared_token`` (DISTLAUNCH_STORE_TOKEN, a token file, or the
  per-user secret file; ranks on several machines need the same secret there). Ranks
  share memory when they are on the same machine (host name and boot id).

Operations: every method torch's Python API, DDP, ZeRO/FSDP on CPU and the object
collectives call on a ProcessGroup (``allreduce``, ``allreduce_coalesced``, ``broadcast``,
``allgather``, ``all_gather_single`` / ``_allgather_base``, ``allgather_coalesced``,
``all_gather_single_coalesced`` / ``allgather_into_tensor_coalesced``,
``reduce_scatter``, ``reduce_scatter_single`` / ``_reduce_scatter_base``,
``reduce_scatter_single_coalesced`` / ``reduce_scatter_tensor_coalesced``, ``alltoall``,
``all_to_all_single`` / ``alltoall_base``, ``reduce``, ``gather``, ``scatter``,
``barrier``, ``send``, ``recv``, ``recv_anysource``) on dense CPU tensors of every dtype
torch trains with. ReduceOp SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR (AVG: floating
point only; PREMUL_SUM raises ValueError).

- Contiguous tensors are used in place (``tensor.numpy()`` views: zero copies; bfloat16
  is moved as its int16 bits). Non-contiguous tensors go through a contiguous copy.
- bfloat16 and float16 *reductions* run in float32 (numpy has no bfloat16) on a float32
  copy, rounded once to the tensor's dtype at the end: results are within 0.5 ulp of the
  float32 reduction (gloo rounds after every addition, so the two may differ by a few
  ulp when more than two values are summed; MIN and MAX are exact).
- Ordering: the operations of one group run in call order. A call with
  ``opts.asyncOp == False`` (torch's blocking API) or a small one (at most
  ``INLINE_BYTES``) runs in the calling thread when nothing of the group is pending;
  otherwise it is queued to the group's helper thread, so DDP's gradient buckets overlap
  with the backward pass. ``Work.wait()`` and ``Work.get_future()`` (value: the output
  tensors, as gloo's) work for both.

Failures: a dead peer, ranks that called different operations, and an operation not
finished within ``init_process_group(timeout=...)`` raise on every surviving rank within
that timeout (as the runtime's CollectiveError classes): :class:`DistlaunchTimeoutError`,
:class:`DistlaunchPeerLostError`, :class:`DistlaunchMismatchError`, all subclasses of
torch's ``DistBackendError`` and of the matching ``distlaunch.collectives`` error. The
first rank to fail aborts the group on the others (a timeout too: ranks blocked in the
operation raise with it, ranks that had not reached it raise at their next call).
After a failure the group is broken, as in the runtime. Bad
arguments raise ValueError (CollectiveArgumentError) on the calling rank only.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..collectives.errors import CollectiveError
from .bootstrap import _STATE as _STATE  # (read by tests: the default group's runtime)
from .bootstrap import _group_id, _new_runtime
from .errors import (
    DistlaunchBackendError,
    DistlaunchMismatchError,
    DistlaunchPeerLostError,
    DistlaunchTimeoutError,
    _as_torch_error,
)
from .group import BACKEND, INLINE_BYTES, DistlaunchProcessGroup
from .work import DistlaunchWork as DistlaunchWork

__all__ = [
    "BACKEND",
    "INLINE_BYTES",
    "DistlaunchProcessGroup",
    "DistlaunchBackendError",
    "DistlaunchTimeoutError",
    "DistlaunchPeerLostError",
    "DistlaunchMismatchError",
]

# The package: errors, work (torch Work handles), tensors (tensors as flat arrays),
# bootstrap (which store the runtime joins), group (the ProcessGroup); this module
# creates the groups for torch and registers the backend.


def _create(opts: Any, pg_options: Any = None) -> DistlaunchProcessGroup:
    """torch's backend creator (extended API): the default group starts a Runtime;
    subgroups of a distlaunch default group are groups of that runtime; a distlaunch
    subgroup of a non-distlaunch default group gets a runtime of its own."""
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout.total_seconds()
    ranks = list(opts.global_ranks_in_group)
    rt = _STATE.get("runtime")
    try:
        if ranks and rt is not None:
            g = rt.new_group_with_id(sorted(ranks), _group_id(str(opts.group_id)), timeout)
            return DistlaunchProcessGroup(g, None)
        rt = _new_runtime(opts.store, rank, size, timeout)
    except CollectiveError as e:
        raise _as_torch_error(e) from None
    if not ranks:
        _STATE["runtime"] = rt
    return DistlaunchProcessGroup(rt.world, rt)


def _register() -> None:
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


_register()
