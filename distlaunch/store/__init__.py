"""distlaunch's rendezvous key-value store (torch c10d ``Store`` semantics).

* ``StoreServer(host, port, token)`` — the server (event loop on a background thread);
  ``serve_forever(host, port, token)`` runs one in the foreground until SIGINT/SIGTERM.
* ``StoreClient(host, port, token, timeout)`` — a blocking, thread-safe client.
* ``StoreAddress(host, port, token).connect(timeout)`` — a client for a known address.
* ``PrefixStore(prefix, store)`` — a view that prefixes every key (``prefix/key``).

Standard library only, and the server module is imported on first use so that workers,
which only need the client, import as little as possible. See docs/store.md.
"""

from __future__ import annotations

from .client import PrefixStore, StoreAddress, StoreClient

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a Slurm agent's path)
if TYPE_CHECKING:  # imported lazily at run time, by __getattr__
    from .server import StoreServer, serve_forever

__all__ = ["StoreAddress", "StoreClient", "StoreServer", "PrefixStore", "serve_forever"]


def __getattr__(name: str) -> object:
    if name in ("StoreServer", "serve_forever"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
