"""A store kept in one shared file, for ``init_method="file:///path"`` (as torch's
FileStore): no server, any process that can open the file can join.

The file is an append-only log of records ``<u32 key len><key><i64 value len><value>``
(value length -1 marks a deletion), written under an exclusive ``fcntl.flock``. Readers
replay the log from where they stopped last time. Blocking calls poll the file with a
growing interval (1 ms up to 50 ms) until their deadline.

Implements the subset of the c10d Store API the collectives runtime uses: ``set``,
``get``, ``add``, ``check``, ``wait``, ``delete_key``, ``num_keys``. Keys are str,
values bytes, timeouts float seconds.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable, Iterable

from ..errors import StoreTimeoutError

_KEYLEN = struct.Struct("<I")
_VALLEN = struct.Struct("<q")


class FileStore:
    """Key-value store in the file ``path`` (created if missing).

    ``timeout``: default seconds for ``get`` and ``wait``. All methods may raise
    OSError when the file is unusable; ``get``/``wait`` raise StoreTimeoutError.
    """

    def __init__(self, path: str, timeout: float = 300.0):
        self.path = path
        self.timeout = timeout
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._offset = 0
        self._data: dict[str, bytes] = {}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- log handling

    def _refresh(self) -> None:
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        raw = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _KEYLEN.size <= len(raw):
            (klen,) = _KEYLEN.unpack_from(raw, pos)
            vpos = pos + _KEYLEN.size + klen
            if vpos + _VALLEN.size > len(raw):
                break
            (vlen,) = _VALLEN.unpack_from(raw, vpos)
            end = vpos + _VALLEN.size + max(vlen, 0)
            if end > len(raw):
                break  # a record still being written (cannot happen under flock, but be safe)
            key = raw[pos + _KEYLEN.size : vpos].decode()
            if vlen < 0:
                self._data.pop(key, None)
            else:
                self._data[key] = raw[vpos + _VALLEN.size : end]
            pos = end
        self._offset += pos

    def _append(self, key: str, value: bytes | None) -> None:
        k = key.encode()
        v = b"" if value is None else value
        record = _KEYLEN.pack(len(k)) + k + _VALLEN.pack(-1 if value is None else len(v)) + v
        os.lseek(self._fd, 0, os.SEEK_END)
        os.write(self._fd, record)

    class _Locked:
        def __init__(self, store: FileStore) -> None:
            self.store = store

        def __enter__(self) -> None:
            fcntl.flock(self.store._fd, fcntl.LOCK_EX)
            self.store._refresh()

        def __exit__(self, *exc: object) -> None:
            fcntl.flock(self.store._fd, fcntl.LOCK_UN)

    def _poll(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        delay = 0.001
        while True:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                self._refresh()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if ready():
                return
            now = time.monotonic()
            if now >= deadline:
                raise StoreTimeoutError(f"file store {self.path}: timed out waiting for {what}")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.05)

    # -- c10d API subset

    def set(self, key: str, value: str | bytes | bytearray | memoryview) -> None:
        """Store ``value`` (bytes or str) under ``key``."""
        with self._Locked(self):
            self._append(key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, blocking until it exists (StoreTimeoutError after
        the store's timeout)."""
        self._poll(lambda: key in self._data, None, repr(key))
        return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key`` (0 if missing); returns the
        new value."""
        with self._Locked(self):
            value = int(self._data.get(key, b"0")) + amount
            self._append(key, str(value).encode())
            self._data[key] = str(value).encode()
        return value

    def check(self, keys: Iterable[str]) -> bool:
        """True when every key in ``keys`` exists (does not block)."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            self._refresh()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return all(k in self._data for k in keys)

    def wait(self, keys: Iterable[str], timeout: float | None = None) -> None:
        """Block until every key exists; StoreTimeoutError after ``timeout`` seconds
        (default: the store's timeout)."""
        keys = list(keys)
        self._poll(lambda: all(k in self._data for k in keys), timeout, ", ".join(map(repr, keys)))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        with self._Locked(self):
            existed = key in self._data
            if existed:
                self._append(key, None)
                del self._data[key]
        return existed

    def num_keys(self) -> int:
        self.check(())
        return len(self._data)
