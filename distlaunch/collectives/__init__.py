"""distlaunch.collectives: a torch.distributed-style collectives runtime for CPU
processes (numpy arrays, torch CPU tensors, writable buffers).

    import distlaunch.collectives as dist
    dist.init_process_group()            # from `distlaunch run`'s environment
    dist.all_reduce(grad)                # in place, every rank gets the same bits

Names, argument order and semantics follow torch.distributed; see docs/collectives.md.
Importing this package loads only the standard library, numpy and distlaunch's
errors/env modules (no torch, click, psutil, paramiko or yaml).

Modules, lowest layer first (each imports only from its own or lower layers; checked
by tests/test_layers.py):

- ``errors``, ``optable`` (the op table: one entry per operation, its algorithm per
  transport), ``wire`` (message header), ``ops`` (ReduceOp), ``buffers`` (user buffers
  as numpy arrays, argument checks), ``filestore``, ``transport`` (the point-to-point
  interface);
- ``context`` (one running operation, a group's members), ``work`` (Work handles, the
  executor of async operations);
- ``transport.tcp`` (the TCP transport), ``transport.shm`` (a group's shared-memory
  channel), ``transport.shm_p2p`` (point to point between ranks of one node);
- ``algorithms.tcp`` (ring, tree, ... over TCP), ``algorithms.shm`` (over the channel);
- ``algorithms.backend`` (TCP and shared-memory backends: an op-table entry with its
  transport's algorithm), ``algorithms.hierarchy`` (the backend of groups spanning
  nodes);
- ``group`` (ProcessGroup: sequencing, backend choice, failure handling);
- ``runtime`` (init_process_group, new_group, destroy; the store bootstrap);
- ``api`` (tensor operations), ``objects`` (object operations); ``bench``.
"""

from .api import (
    P2POp,
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .errors import (
    CollectiveArgumentError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    NotInitializedError,
    PeerLostError,
)
from .filestore import FileStore
from .group import ProcessGroup
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .ops import ReduceOp, reduce_op
from .runtime import (
    GroupMember,
    destroy_process_group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
)
from .work import Work

__all__ = [
    # groups
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_process_group_ranks",
    "get_global_rank",
    "get_group_rank",
    "GroupMember",
    "ProcessGroup",
    "Work",
    "ReduceOp",
    "reduce_op",
    "FileStore",
    # operations
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    "broadcast",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    # errors
    "CollectiveError",
    "CollectiveArgumentError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "NotInitializedError",
]
