"""Collectives on arbitrary picklable Python objects (torch.distributed's ``*_object*``
functions), built on the buffer collectives: objects are pickled to uint8 arrays; sizes
travel first so every rank can allocate (padded to the largest where the operation needs
equal sizes).

Security: unpickling runs code chosen by the sender, exactly as in torch; only use these
between ranks of the same trusted job. Errors: as the underlying operations, plus
pickling errors from the caller's objects.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from . import api
from .api import Group
from .errors import CollectiveArgumentError
from .group import ProcessGroup


def _dump(obj: Any) -> np.ndarray:
    return np.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), np.uint8)


def _load(arr: np.ndarray) -> Any:
    return pickle.loads(arr.tobytes())


def broadcast_object_list(
    object_list: list,
    src: int | None = None,
    group: Group = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace the elements of ``object_list`` on every rank by those of ``src``'s list
    (all ranks pass a list of the same length). Blocking."""
    g = api.resolve_group(group)
    if g is None:
        return
    root = api.root_of(g, src, group_src, "src")
    if g.rank == root:
        data = _dump(list(object_list))
        size = np.array([data.size], np.int64)
    else:
        size = np.zeros(1, np.int64)
    api.broadcast(size, group=group, group_src=root)
    if g.rank != root:
        data = np.empty(int(size[0]), np.uint8)
    api.broadcast(data, group=group, group_src=root)
    if g.rank != root:
        objs = _load(data)
        if len(objs) != len(object_list):
            raise CollectiveArgumentError(
                f"object_list has {len(object_list)} elements but the source sent {len(objs)}"
            )
        object_list[:] = objs


def _padded_all_gather(g: ProcessGroup, group: Group, data: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    sizes = np.zeros(g.size, np.int64)
    api.all_gather_into_tensor(sizes, np.array([data.size], np.int64), group=group)
    width = int(sizes.max())
    mine = np.zeros(width, np.uint8)
    mine[: data.size] = data
    return sizes, width, mine


def all_gather_object(object_list: list, obj: Any, group: Group = None) -> None:
    """``object_list[i]`` (a list of group-size elements) becomes rank i's ``obj``."""
    g = api.resolve_group(group)
    if g is None:
        return
    if len(object_list) != g.size:
        raise CollectiveArgumentError(f"object_list has {len(object_list)} elements; the group has {g.size}")
    sizes, width, mine = _padded_all_gather(g, group, _dump(obj))
    out = np.empty(width * g.size, np.uint8)
    api.all_gather_into_tensor(out, mine, group=group)
    for i in range(g.size):
        object_list[i] = _load(out[i * width : i * width + int(sizes[i])])


def gather_object(
    obj: Any,
    object_gather_list: list | None = None,
    dst: int | None = None,
    group: Group = None,
    group_dst: int | None = None,
) -> None:
    """On ``dst``, ``object_gather_list[i]`` (group-size list) becomes rank i's ``obj``."""
    g = api.resolve_group(group)
    if g is None:
        return
    root = api.root_of(g, dst, group_dst, "dst")
    if g.rank == root and (object_gather_list is None or len(object_gather_list) != g.size):
        raise CollectiveArgumentError(
            f"object_gather_list must be a list of {g.size} elements on the destination"
        )
    sizes, width, mine = _padded_all_gather(g, group, _dump(obj))
    outs = [np.empty(width, np.uint8) for _ in range(g.size)] if g.rank == root else None
    api.gather(mine, outs, group=group, group_dst=root)
    if outs is not None and object_gather_list is not None:  # (both exactly on the root)
        for i in range(g.size):
            object_gather_list[i] = _load(outs[i][: int(sizes[i])])


def scatter_object_list(
    scatter_object_output_list: list,
    scatter_object_input_list: list | None = None,
    src: int | None = None,
    group: Group = None,
    group_src: int | None = None,
) -> None:
    """``scatter_object_output_list[0]`` on rank i becomes element i of ``src``'s
    ``scatter_object_input_list`` (group-size list, only needed on ``src``)."""
    g = api.resolve_group(group)
    if g is None:
        return
    root = api.root_of(g, src, group_src, "src")
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise CollectiveArgumentError("scatter_object_output_list must be a non-empty list")
    sizes = np.zeros(g.size, np.int64)
    if g.rank == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != g.size:
            raise CollectiveArgumentError(
                f"scatter_object_input_list must have {g.size} elements on the source"
            )
        blobs = [_dump(o) for o in scatter_object_input_list]
        sizes[:] = [b.size for b in blobs]
    api.broadcast(sizes, group=group, group_src=root)
    width = int(sizes.max())
    ins = None
    if g.rank == root:
        ins = [np.zeros(width, np.uint8) for _ in range(g.size)]
        for buf, b in zip(ins, blobs):
            buf[: b.size] = b
    mine = np.empty(width, np.uint8)
    api.scatter(mine, ins, group=group, group_src=root)
    scatter_object_output_list[0] = _load(mine[: int(sizes[g.rank])])


def send_object_list(
    object_list: list,
    dst: int | None = None,
    group: Group = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (size first, then the pickle)."""
    data = _dump(list(object_list))
    api.send(np.array([data.size], np.int64), dst, group, 0, group_dst)
    api.send(data, dst, group, 0, group_dst)


def recv_object_list(
    object_list: list,
    src: int | None = None,
    group: Group = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Fill ``object_list`` (of the sender's length) with the objects sent by ``src``
    (None: any source); returns the sender's rank."""
    size = np.zeros(1, np.int64)
    sender = api.recv(size, src, group, 0, group_src)
    if sender == -1:
        return -1
    data = np.empty(int(size[0]), np.uint8)
    if group_src is not None:
        api.recv(data, None, group, 0, sender)
    else:
        api.recv(data, sender, group, 0)
    objs = _load(data)
    if len(objs) != len(object_list):
        raise CollectiveArgumentError(
            f"object_list has {len(object_list)} elements but rank {sender} sent {len(objs)}"
        )
    object_list[:] = objs
    return sender
