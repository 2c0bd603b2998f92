"""Process-wide state of the collectives runtime: init_process_group and friends.

Init methods (``init_process_group(init_method=...)``):

- ``None`` under ``distlaunch run`` (DISTLAUNCH_STORE_PORT is set): connect to the
  launcher's store with DISTLAUNCH_STORE_ADDR/PORT/TOKEN; rank and world size from
  RANK/WORLD_SIZE; keys under ``distlaunch/coll/<run id>/<restart count>/`` so a
  restarted group never sees a previous attempt's keys. Otherwise ``None`` means
  ``env://`` (as torch).
- ``None`` in processes started by ``srun`` or ``mpiexec`` (no RANK in the environment,
  ``env.scheduler_identity`` finds SLURM_STEP_ID/SLURM_PROCID, PMI_RANK/PMI_SIZE or
  OMPI_COMM_WORLD_*): rank, world size and node from the scheduler; rank 0 hosts the
  store on the step's first node (its DNS name, else its Slurm NodeAddr) at a port
  derived from the job and step ids (mpiexec: 127.0.0.1, all ranks on one host, port
  from the parent process), MASTER_ADDR/MASTER_PORT override; the token is derived from
  the user's secret and the job (``distlaunch.secret``); ranks of one Slurm node (one
  host for mpiexec) share memory. Table of variables: ``env.SCHEDULER_VARS``.
- ``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (arguments win over the
  environment); rank 0 hosts a StoreServer on MASTER_PORT, all ranks connect to it with
  the token DISTLAUNCH_STORE_TOKEN, else one derived from the user's secret file
  (``distlaunch.secret``: processes of one user on one machine, or on machines sharing
  the home directory, agree with no set-up; nothing an outsider can derive).
- ``tcp://host:port[?rank=R&world_size=N]``: as env:// with the address from the URL.
- ``file:///path[?rank=R&world_size=N]``: a :class:`FileStore` in ``path`` (no server;
  every rank must see the file). Use a fresh file per job.
- ``store=``: any object with set/get/add/wait/check (e.g. a StoreClient) plus
  ``rank``/``world_size``.

file:// and ``store=`` derive the transport key from ``shared_token("collectives")``
(DISTLAUNCH_STORE_TOKEN, a token file, or the per-user secret file): ranks on several
machines need the same one, as for env://.

On every store, ranks first take a *generation* number (``add`` on one counter) so that
re-initialising on the same store uses fresh keys; rank 0 publishes a random public
nonce, from which every rank derives the key that authenticates transport connections
(``secret.derive_key`` of the token it holds, the key prefix, which names the run id and
restart count, and the nonce: no secret is a store value, the store's traffic is
plain; docs/security.md); each rank publishes its listening address;
then all ranks wait until everyone joined (CollectiveTimeoutError names the ranks that
did not). Transport sockets listen on DISTLAUNCH_COLL_HOST if set, else on the local
address that routes to the store host (127.0.0.1 for a loopback store or a file store).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, urlparse

from ..secret import TOKEN_VAR, derive_key, shared_token
from .context import DEFAULT_TIMEOUT, Members, to_seconds
from .errors import CollectiveArgumentError, CollectiveTimeoutError, ConfigError, NotInitializedError
from .filestore import FileStore
from .group import ProcessGroup
from .transport.shm import ShmConfig
from .transport.shm import available as shm_available
from .transport.tcp import HANDSHAKE_TIMEOUT, TcpTransport
from .wire import Header

_BACKENDS = {None, "auto", "cpu", "gloo", "cpu:gloo"}
_NONCE = 16  # bytes of rank 0's public nonce
# file:// and store= have no store token: their ranks share one through secret.shared_token
_SHARED_CONTEXT = "collectives"


def _key_check(key: bytes) -> bytes:
    """A public check value of the transport key (a MAC of a fixed label: reveals nothing
    of the key) so that a rank with another token fails at init with a clear error."""
    return hmac.new(key, b"distlaunch-key-check", hashlib.sha256).digest()


class _NonGroupMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    """As torch.distributed.GroupMember: ``WORLD`` is the default group once
    initialised (None before), ``NON_GROUP_MEMBER`` what new_group returns to ranks
    outside the group."""

    WORLD: ProcessGroup | None = None
    NON_GROUP_MEMBER = _NonGroupMember()


class _LockedStore:
    """Serialises calls to a store client shared by several threads."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return fn(*args, **kwargs)

        return call


class Runtime:
    """Everything one initialised process group owns: store, transport, groups."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        prefix: str,
        timeout: float,
        host: str,
        owned: Iterable[Any] = (),
        node_id: str | None = None,
        token: str | bytes = "",
    ):
        """Join ``world_size`` ranks on ``store`` (set/get/add/wait/check/close) under key
        ``prefix``; blocks until all joined or ``timeout`` seconds passed
        (CollectiveTimeoutError naming the absent ranks). ``host``: the address transport
        sockets listen on (:func:`local_host_towards`); ``owned``: objects closed with
        the runtime; ``node_id``: ranks with the same id share memory (default
        DISTLAUNCH_NODE_ID; none: TCP only). ``token``: the secret every rank already
        holds (the launcher's DISTLAUNCH_STORE_TOKEN, or ``distlaunch.secret.shared_token``):
        rank 0 publishes a random nonce and every rank derives the transport key as
        ``secret.derive_key(token, "transport", prefix, nonce)``, so no secret is ever a
        store value or crosses the wire (the store's traffic is not encrypted). Raises
        ConfigError on a rank whose token differs from rank 0's (rank 0 publishes a
        check value, HMAC-SHA256(key, label), with the nonce)."""
        self.rank = rank
        # which ranks may share memory: only the launcher's node id says so (never a host
        # name: loopback multi-node jobs must use TCP); published as <ns>node/<rank>
        launcher_node = node_id or os.environ.get("DISTLAUNCH_NODE_ID")
        self.node_id = launcher_node or socket.gethostname()
        use_shm = bool(launcher_node) and shm_available()
        self._shm_node = f"L:{launcher_node}" if use_shm else f"N:{rank}"
        # read once here, not at import: the sizes every shared-memory channel uses
        self.shm_config = ShmConfig.from_env()
        self._node_ids: list[str] | None = None
        self.world_size = world_size
        self.timeout = timeout
        self.store = _LockedStore(store)
        self._owned = list(owned)  # things to close on destroy (store client, file store)
        self.groups: dict[int, ProcessGroup] = {}
        self._early_aborts: dict = {}
        self._next_gid = 0
        deadline = time.monotonic() + timeout
        generation = (self.store.add(f"{prefix}generation", 1) - 1) // world_size
        self.prefix = ns = f"{prefix}g{generation}/"
        self.store.set(f"{ns}arrived/{rank}", b"1")  # only read to name absent ranks
        if not token:
            raise ConfigError(f"no secret to derive the collectives key from: set {TOKEN_VAR}")
        if rank == 0:  # public: a fresh key per initialisation, even on a reused store
            nonce = secrets.token_bytes(_NONCE)
            self.store.set(f"{ns}nonce", nonce + _key_check(derive_key(token, "transport", ns, nonce)))
        published = self._init_wait([f"{ns}nonce"], deadline, timeout)
        key = derive_key(token, "transport", ns, published[:_NONCE])
        if not hmac.compare_digest(published[_NONCE:], _key_check(key)):
            self.store.set(f"{ns}other-token/{rank}", b"1")  # names it in the others' errors
            self.store.add(f"{ns}other-tokens", 1)
            self.store.set(f"{ns}joined/{rank}", b"")  # releases the others' wait: they raise too
            raise ConfigError(
                f"rank {rank} holds a different secret from rank 0's (its key does not match rank 0's "
                f"check value): give every rank the same {TOKEN_VAR} (or the same per-user secret file)"
            )
        # hex: shared-memory names hash it (never the key itself: /dev/shm is public)
        self.secret = key.hex()
        self.transport = TcpTransport(
            rank,
            world_size,
            self.store,
            ns,
            host,
            key,
            self._status,
            self._abort,
            handshake_timeout=min(HANDSHAKE_TIMEOUT, timeout),
        )
        self.transport.late_handler = self._late
        try:
            self.store.set(f"{ns}node/{rank}", self._shm_node.encode())
            self.store.set(f"{ns}joined/{rank}", b"1")
            self._init_wait([f"{ns}joined/{r}" for r in range(world_size)], deadline, timeout)
            if self.store.add(f"{ns}other-tokens", 0):  # one look, not one per rank
                raise ConfigError(
                    f"ranks {self._other_tokens()} hold a different secret from rank 0's: give every "
                    f"rank the same {TOKEN_VAR} (or the same per-user secret file)"
                )
        except BaseException:
            self.close()
            raise
        self.world = ProcessGroup(self, 0, list(range(world_size)), timeout, "WORLD")
        self._add_group(self.world)

    def _init_wait(self, keys: list[str], deadline: float, timeout: float) -> bytes:
        """Wait for ``keys`` until the init deadline and return the first one's value;
        on timeout name the ranks that never arrived (CollectiveTimeoutError)."""
        try:
            self.store.wait(keys, max(0.01, deadline - time.monotonic()))
            return self.store.get(keys[0])
        except Exception as e:
            absent = [
                r for r in range(self.world_size) if not self.store.check([f"{self.prefix}arrived/{r}"])
            ]
            other = [] if absent else self._other_tokens()
            why = (
                f"ranks {absent} did not join"
                if absent
                else f"ranks {other} hold a different secret from rank 0's "
                f"(give every rank the same {TOKEN_VAR})"
                if other
                else f"every rank arrived, but store key {keys[0]!r} did not appear"
            )
            raise CollectiveTimeoutError(
                f"init_process_group timed out after {timeout:g} s: {why} (world size {self.world_size}): {e}"
            ) from e

    def _other_tokens(self) -> list[int]:
        """The ranks that found they hold another secret than rank 0's."""
        return [r for r in range(self.world_size) if self.store.check([f"{self.prefix}other-token/{r}"])]

    def _status(self, gid: int) -> tuple[int, int]:
        g = self.groups.get(gid)
        return g.status() if g is not None else (-1, 0)

    def _abort(self, hdr: Header, text: str) -> None:
        g = self.groups.get(hdr.group)
        if g is not None:
            g.on_abort(hdr, text)
        else:  # this rank has not created the group yet (still in init / new_group)
            self._early_aborts.setdefault(hdr.group, (hdr, text))

    def _add_group(self, g: ProcessGroup) -> None:
        self.groups[g.gid] = g
        early = self._early_aborts.pop(g.gid, None)
        if early is not None:
            g.on_abort(*early)

    def _late(self, hdr: Header) -> None:
        g = self.groups.get(hdr.group)
        if g is not None:
            g.on_late(hdr)

    def new_group(self, ranks: list, timeout: float) -> ProcessGroup | _NonGroupMember:
        """The next numbered group of sorted global ``ranks`` (every rank calls it, in
        the same order); NON_GROUP_MEMBER on ranks outside it."""
        self._next_gid += 1
        if self.rank not in ranks:
            return GroupMember.NON_GROUP_MEMBER
        return self.new_group_with_id(ranks, self._next_gid, timeout)

    def new_group_with_id(
        self, ranks: list, gid: int, timeout: float | None = None, name: str | None = None
    ) -> ProcessGroup:
        """A group of global ``ranks`` (in group-rank order, this rank among them) with
        the id ``gid`` the caller chose alike on every member (e.g. an MPI context id or
        torch's group name; ids 1..2**30 may collide with new_group's numbering).
        ``timeout``: seconds per operation (default the runtime's); ``name``: for error
        messages. Does not communicate. Raises CollectiveArgumentError when this rank is
        not in ``ranks`` or ``gid`` is taken by a live group."""
        if self.rank not in ranks:
            raise CollectiveArgumentError(f"rank {self.rank} is not in the group's ranks {list(ranks)}")
        if gid in self.groups:
            raise CollectiveArgumentError(f"group id {gid} is already used by {self.groups[gid].name}")
        g = ProcessGroup(
            self, gid, list(ranks), timeout or self.timeout, name or f"group {gid} {list(ranks)}"
        )
        self._add_group(g)
        return g

    def node_ids(self) -> list[str]:
        """Every rank's published node key ("L:<launcher node id>" when it can use
        shared memory, else unique per rank); fetched once from the store."""
        if self._node_ids is None:
            self._node_ids = [
                self.store.get(f"{self.prefix}node/{r}").decode() for r in range(self.world_size)
            ]
        return self._node_ids

    def node_keys(self, group: Members) -> list:
        """Node key of each member of ``group`` (in group-rank order)."""
        ids = self.node_ids()
        return [ids[g] for g in group.ranks]

    def shm_name(self, group: Members) -> str | None:
        """Name of ``group``'s shared-memory segment, or None when its members cannot
        share memory. Names start with DISTLAUNCH_SHM_PREFIX (the launcher removes such
        segments after crashes) and carry a one-way hash of this initialisation's random
        secret: /dev/shm names are visible to every user of the machine, the secret (the
        transport's HMAC key) must not be."""
        if group.size < 2 or not self._shm_node.startswith("L:"):
            return None
        ids = self.node_ids()
        if any(ids[g] != self._shm_node for g in group.ranks):
            return None
        # Without a launcher's per-node prefix, the node key goes into the name: two Slurm
        # nodes on one machine (or two jobs) must not meet in one segment.
        node = hashlib.sha256(self._shm_node.encode()).hexdigest()[:8]
        prefix = os.environ.get("DISTLAUNCH_SHM_PREFIX") or f"distlaunch-{os.getuid()}-{node}-"
        tag = hashlib.sha256(b"distlaunch-shm-name:" + self.secret.encode()).hexdigest()[:16]
        return f"{prefix}coll-{tag}-{group.gid}"

    def close(self) -> None:
        """Close the transport, every group (threads, shared memory) and owned stores.
        Raises the first group's error of :meth:`ProcessGroup.check_last` (a last eager
        operation whose calls differ), after closing everything; checked first, while
        the transport can still tell the other members."""
        errors = [e for g in self.groups.values() if (e := g.check_last()) is not None]
        self.transport.close()
        for g in self.groups.values():
            g.shutdown()
        for obj in self._owned:
            try:
                obj.close()
            except Exception:
                pass
        if errors:
            raise errors[0]


_runtime: Runtime | None = None
_servers: dict = {}  # (host, port) -> StoreServer this process hosts for env:// / tcp://


def current_runtime() -> Runtime:
    if _runtime is None:
        raise NotInitializedError(
            "the default process group is not initialized; call init_process_group() first"
        )
    return _runtime


def is_initialized() -> bool:
    """True between init_process_group() and destroy_process_group()."""
    return _runtime is not None


def _int_arg(value, env_name, what):
    if value is not None and value != -1:
        return int(value)
    raw = os.environ.get(env_name)
    if raw is None:
        raise ConfigError(f"{what} is not given and {env_name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{env_name}={raw!r} is not an integer") from None


def local_host_towards(host: str) -> str:
    """The local address transport sockets should listen on to be reachable from the
    machine ``host`` (its route's source address; 127.0.0.1 for a loopback host or when
    the route is unknown); DISTLAUNCH_COLL_HOST overrides. Sends nothing."""
    override = os.environ.get("DISTLAUNCH_COLL_HOST")
    if override:
        return override
    from ..env import route_source  # (env is not imported by `import distlaunch.collectives`)

    return "127.0.0.1" if host in ("localhost", "") else route_source(host) or "127.0.0.1"


def _scheduled() -> Any:
    """``env.scheduler_identity()``: set when srun or mpiexec started this process."""
    from ..env import scheduler_identity  # lazy: only without a launcher

    return scheduler_identity()


def _slurm_node_address(name: str) -> str:
    """``env.slurm_node_address``, its error naming the way out (MASTER_ADDR)."""
    from ..env import slurm_node_address  # lazy: only under srun

    try:
        return slurm_node_address(name)
    except ConfigError as e:
        raise ConfigError(
            f"cannot find the address of Slurm node {name!r} (first node of the step, where rank 0 "
            f"hosts the store): {e}; set MASTER_ADDR"
        ) from None


def _tcp_store(host, port, rank, token, timeout, deadline):
    """StoreClient to host:port (retrying until the deadline: rank 0's server may start
    later); rank 0 first starts the StoreServer there."""
    # lazy: only env:// / tcp:// need the store package (the server side is not light)
    from ..errors import StoreError
    from ..store import StoreClient, StoreServer

    if rank == 0 and (host, port) not in _servers:
        bind = "127.0.0.1" if local_host_towards(host) == "127.0.0.1" else "0.0.0.0"
        try:
            server = StoreServer(host=bind, port=port, token=token)
            server.start()
        except (StoreError, OSError) as e:
            raise ConfigError(f"rank 0 cannot host the store on {bind}:{port}: {e}") from e
        _servers[(host, port)] = server
    try:
        own = _servers.get((host, port))  # rank 0 talks to the store it runs without a handshake
        return StoreClient(
            host,
            port,
            token=token,
            timeout=timeout,
            connect_timeout=max(0.1, deadline - time.monotonic()),
            connect=own.connect_local if own is not None else None,
        )
    except StoreError as e:
        if isinstance(e, TimeoutError):
            raise CollectiveTimeoutError(f"cannot reach the store at {host}:{port}: {e}") from e
        raise ConfigError(f"cannot use the store at {host}:{port}: {e}") from e


def join_store(
    store: Any,
    rank: int,
    world_size: int,
    prefix: str,
    timeout: float,
    host: str,
    token: str | bytes | None = None,
    shared: str = _SHARED_CONTEXT,
    owned: Iterable[Any] = (),
    node_id: str | None = None,
) -> Runtime:
    """The one store bootstrap of the init paths that are handed a store (env://,
    tcp://, file://, ``store=``, srun/mpiexec, and the torch backend's torch store): a
    :class:`Runtime` of ``rank`` among ``world_size`` on ``store`` under ``prefix``
    (arguments as Runtime's). ``token``: the secret the ranks hold; None: the user's,
    ``secret.shared_token(shared)`` (stores that carry no token of their own). Blocks
    until all joined; closes ``owned`` when it fails. Raises ConfigError (rank outside
    0..world_size-1, another token than rank 0's) and CollectiveTimeoutError."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside 0..world_size-1 (world_size {world_size})")
    try:
        if token is None:
            token = shared_token(shared)
        return Runtime(rank, world_size, store, prefix, timeout, host, owned, node_id, token)
    except BaseException:
        for obj in owned:
            obj.close()
        raise


def launcher_runtime(namespace: str, timeout: float) -> Runtime:
    """The Runtime of a worker started by ``distlaunch run``, on the launcher's
    authenticated store (DISTLAUNCH_STORE_ADDR/PORT/TOKEN); rank and world size from
    RANK/WORLD_SIZE. Keys live under ``distlaunch/<namespace>/<run id>/<restart count>/``:
    a restarted job never sees a previous attempt's keys, and runtimes of different
    namespaces (this API's "coll", the torch backend's "torch") share the store apart.
    Ranks of one launcher node share memory. ``timeout``: seconds for joining and for
    every later operation. Blocks until every rank joined. Raises ConfigError (not under
    the launcher, or an incomplete environment) and CollectiveTimeoutError (ranks
    missing at the deadline, or the store unreachable)."""
    from ..env import read_worker_env  # lazy: only under `distlaunch run`

    ident = read_worker_env()
    if ident.store_addr is None or ident.store_port is None:  # a hand-made environment may lack one
        raise ConfigError("DISTLAUNCH_STORE_PORT is set but DISTLAUNCH_STORE_ADDR is not (set both)")
    deadline = time.monotonic() + timeout
    store = _tcp_store(ident.store_addr, ident.store_port, -1, ident.store_token, timeout, deadline)
    try:
        return Runtime(
            ident.rank,
            ident.world_size,
            store,
            f"distlaunch/{namespace}/{ident.run_id}/{ident.restart_count}/",
            timeout,
            local_host_towards(ident.store_addr),
            owned=[store],
            node_id=ident.node_id,
            token=ident.store_token or "",
        )
    except BaseException:
        store.close()
        raise


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialise the default process group (``torch.distributed.init_process_group``).

    ``backend``: None, "auto", "cpu" or "gloo" (all the same CPU runtime); anything else
    raises ConfigError. ``init_method``: None, "env://", "tcp://host:port",
    "file:///path" (see the module docstring). ``timeout``: seconds (float) or
    timedelta for init and for every later operation; default 1800 s. ``world_size``,
    ``rank``: required for tcp:// and file:// and with ``store`` unless RANK/WORLD_SIZE
    are set. Blocks until all ranks joined. Raises ConfigError (bad arguments or
    environment), CollectiveTimeoutError (ranks missing at the deadline, naming them),
    CollectiveArgumentError if already initialised. Semantics: torch.distributed.
    """
    global _runtime
    if _runtime is not None:
        raise CollectiveArgumentError(
            "the default process group is already initialized (call destroy_process_group() first)"
        )
    if (backend.lower() if isinstance(backend, str) else backend) not in _BACKENDS:
        raise ConfigError(
            f"backend {backend!r} is not supported: distlaunch.collectives is a CPU runtime "
            f"(use None, 'auto', 'cpu' or 'gloo')"
        )
    timeout = to_seconds(timeout) or DEFAULT_TIMEOUT
    deadline = time.monotonic() + timeout
    if store is not None and init_method is not None:
        raise ConfigError("give init_method or store, not both")
    owned, node_id, token = [], None, None
    if store is not None:
        r, n = _int_arg(rank, "RANK", "rank"), _int_arg(world_size, "WORLD_SIZE", "world_size")
        prefix, host = "distlaunch/coll/", local_host_towards(getattr(store, "host", "127.0.0.1"))
    elif init_method is None and os.environ.get("DISTLAUNCH_STORE_PORT"):
        from ..env import read_worker_env  # lazy: only under `distlaunch run`

        ident = read_worker_env()
        for given, actual, what in ((rank, ident.rank, "rank"), (world_size, ident.world_size, "world_size")):
            if given not in (-1, None) and given != actual:
                raise ConfigError(f"{what}={given} contradicts the launcher's environment ({actual})")
        _runtime = launcher_runtime("coll", timeout)
        GroupMember.WORLD = _runtime.world
        return
    elif (
        init_method is None
        and rank in (-1, None)
        and "RANK" not in os.environ
        and (sched := _scheduled()) is not None
    ):
        r, n = sched.rank, sched.world_size
        if world_size not in (-1, None) and world_size != n:
            raise ConfigError(f"world_size={world_size} contradicts {sched.source}'s environment ({n})")
        addr = sched.store_host or _slurm_node_address(sched.store_node or "")
        token = shared_token(sched.context)
        store = _tcp_store(addr, sched.store_port, r, token, timeout, deadline)
        owned.append(store)
        prefix = f"distlaunch/coll/{sched.context}/"
        host = local_host_towards(addr)
        node_id = sched.node_id
    else:
        url = urlparse(init_method or "env://")
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if "rank" in query and rank in (-1, None):
            rank = int(query["rank"])
        if "world_size" in query and world_size in (-1, None):
            world_size = int(query["world_size"])
        r, n = _int_arg(rank, "RANK", "rank"), _int_arg(world_size, "WORLD_SIZE", "world_size")
        if url.scheme == "file":
            if not url.path:
                raise ConfigError(f"init_method {init_method!r} has no path")
            store = FileStore(url.path, timeout=timeout)
            owned.append(store)
            prefix, host = "distlaunch/coll/", local_host_towards("localhost")
        elif url.scheme in ("env", "tcp"):
            if url.scheme == "env":
                addr = os.environ.get("MASTER_ADDR")
                if not addr:
                    raise ConfigError("env:// needs MASTER_ADDR (and MASTER_PORT) in the environment")
                port = _int_arg(None, "MASTER_PORT", "MASTER_PORT")
            else:
                addr, port = url.hostname, url.port
                if not addr or not port:
                    raise ConfigError(f"init_method {init_method!r} must be tcp://host:port")
            token = shared_token(f"port:{port}")
            store = _tcp_store(addr, port, r, token, timeout, deadline)
            owned.append(store)
            prefix = f"distlaunch/coll/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
            host = local_host_towards(addr)
        else:
            raise ConfigError(
                f"init_method {init_method!r}: unsupported scheme (use env://, tcp://host:port "
                f"or file:///path)"
            )
    # file://, store=: a secret of the user's (token None), not of the store
    _runtime = join_store(store, r, n, prefix, timeout, host, token, owned=owned, node_id=node_id)
    GroupMember.WORLD = _runtime.world


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or (None / WORLD) the whole runtime: pending operations fail
    with CollectiveError, connections close, helper threads are joined (blocks up to a
    few seconds). A store server hosted by this process for env:// keeps running until
    the process exits (other ranks may still be reading from it) and is reused by a
    later init on the same address. Raises NotInitializedError, or
    CollectiveArgumentError for a group that is not live. As torch.distributed."""
    global _runtime
    rt = current_runtime()
    if group is None or group is GroupMember.WORLD:
        _runtime = None
        GroupMember.WORLD = None
        rt.close()
    elif group is GroupMember.NON_GROUP_MEMBER:
        return
    elif isinstance(group, ProcessGroup) and rt.groups.get(group.gid) is group:
        del rt.groups[group.gid]
        group.shutdown()
    else:
        raise CollectiveArgumentError(f"{group!r} is not a live group of this runtime")


def new_group(
    ranks: Iterable[int] | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | _NonGroupMember:
    """Create a group of the global ``ranks`` (None: all). Every rank must call
    new_group, in the same order, with the same ranks (as torch.distributed). Returns the
    ProcessGroup on members and ``GroupMember.NON_GROUP_MEMBER`` elsewhere. Does not
    block or communicate (connections are made by the first operation). ``timeout``:
    seconds or timedelta, default the world's. Raises NotInitializedError, ConfigError
    for an unsupported backend, CollectiveArgumentError for ranks outside the world."""
    rt = current_runtime()
    if (backend.lower() if isinstance(backend, str) else backend) not in _BACKENDS:
        raise ConfigError(f"backend {backend!r} is not supported")
    if ranks is None:
        ranks = range(rt.world_size)
    members = sorted(set(int(r) for r in ranks))
    if any(not 0 <= r < rt.world_size for r in members):
        raise CollectiveArgumentError(f"new_group ranks {list(ranks)} must be within 0..{rt.world_size - 1}")
    if not members:
        raise CollectiveArgumentError("new_group needs at least one rank")
    return rt.new_group(members, to_seconds(timeout) or rt.timeout)


def _resolve(group: Any) -> ProcessGroup | None:
    rt = current_runtime()
    if group is None or group is GroupMember.WORLD:
        return rt.world
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    return group


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: global rank); -1 on a non-member.
    Raises NotInitializedError."""
    g = _resolve(group)
    return -1 if g is None else g.rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 on a non-member.
    Raises NotInitializedError."""
    g = _resolve(group)
    return -1 if g is None else g.size


def get_backend(group: ProcessGroup | None = None) -> str:
    """Always "cpu" (the only backend)."""
    current_runtime()
    return "cpu"


def get_process_group_ranks(group: ProcessGroup | None) -> list:
    """Global ranks of ``group``."""
    g = _resolve(group)
    return [] if g is None else list(g.ranks)


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group`` (CollectiveArgumentError if outside)."""
    g = _resolve(group)
    if g is None:
        raise CollectiveArgumentError("this rank is not a member of the group")
    return g.ranks[g.check_group_rank(group_rank, "group_rank")]


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """Rank of ``global_rank`` inside ``group`` (CollectiveArgumentError if not a member)."""
    g = _resolve(group)
    if g is None:
        raise CollectiveArgumentError("this rank is not a member of the group")
    return g.group_rank(global_rank, "global_rank")


def is_available() -> bool:
    """Always True (as torch.distributed.is_available)."""
    return True
