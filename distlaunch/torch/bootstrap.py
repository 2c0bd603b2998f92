"""Which store the backend's runtime rendezvouses on (see the package docstring): the
launcher's under ``distlaunch run``, else the store torch passes."""

from __future__ import annotations

import datetime
import hashlib
import socket
from typing import Any

from ..collectives.runtime import Runtime, join_store, launcher_runtime, local_host_towards
from ..env import lookup

_STATE: dict = {}  # "runtime": the Runtime of the current distlaunch default group


class _TorchStore:
    """The runtime's store interface (set/get/add/wait/check/close) over a torch Store.
    torch's stores are not authenticated: the runtime is given a token for them
    (``Runtime(token=...)``), from which it derives its transport key."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def wait(self, keys: list, timeout: float) -> None:
        self._store.wait(list(keys), datetime.timedelta(seconds=max(0.001, timeout)))

    def check(self, keys: list) -> bool:
        return bool(self._store.check(list(keys)))

    def close(self) -> None:
        pass  # torch owns its store


def _machine_id() -> str:
    """Host name and boot id: ranks with the same value can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}:{boot}"


def _new_runtime(store: Any, rank: int, size: int, timeout: float) -> Runtime:
    """The runtime of a new default group: the launcher's store under ``distlaunch run``
    (when torch's rank and world size are the launcher's), else torch's ``store``, joined
    as every init path joins a store (:func:`~distlaunch.collectives.runtime.join_store`)."""
    if lookup("DISTLAUNCH_STORE_PORT") and lookup("RANK") == str(rank) and lookup("WORLD_SIZE") == str(size):
        return launcher_runtime("torch", timeout)
    host = local_host_towards(lookup("MASTER_ADDR") or "localhost")
    return join_store(
        _TorchStore(store),
        rank,
        size,
        "distlaunch/torch/",
        timeout,
        host,
        shared="torch-backend",
        node_id=_machine_id(),
    )


def _group_id(name: str) -> int:
    """The runtime's group id for torch's group name (decimal, or a hash of it):
    alike on every member."""
    if name.isdigit() and 0 < int(name) < 1 << 30:
        return int(name)
    return (1 << 30) | int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (3 << 30)
