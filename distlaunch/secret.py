"""Where a job's store secret comes from when no single process can generate it.

A single-node job and a head-mode job generate a random secret and hand it to their
agents and workers themselves. Launches that start independently on every node (per-node
static and dynamic, ``env://``/``tcp://`` started by hand) share no channel for one, so
they read it, in this order:

1. ``DISTLAUNCH_STORE_TOKEN``: used as it is (every node must export the same value);
2. a token file: ``--store-token-file FILE`` or ``DISTLAUNCH_STORE_TOKEN_FILE``;
3. the per-user secret file ``$XDG_CONFIG_HOME/distlaunch/secret`` (default
   ``~/.config/distlaunch/secret``), created with mode 0600 on first use, so that
   clusters with a shared home directory need no set-up at all.

A file is refused unless it is a regular file owned by the user and not readable by
group or others (as ssh treats private keys). From a file's secret each job derives its
own token, ``HMAC-SHA256(secret, context)`` with the run id (or the store port) as
context: workers see only their job's token in their environment, never the long-lived
file secret, and jobs of one user cannot read each other's keys by accident.

Nothing here is derivable from public information (run ids, ports, job ids, user names):
that is the point (torchrun's TCPStore has no secret at all). Every further key a process
needs (the collectives transport's) is :func:`derive_key` of the token it already holds
and public values, so no secret is ever a store value or a payload on the wire. Standard
library only, and cheap: workers import it through ``distlaunch.collectives``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

from .env import lookup
from .errors import ConfigError

TOKEN_VAR = "DISTLAUNCH_STORE_TOKEN"
TOKEN_FILE_VAR = "DISTLAUNCH_STORE_TOKEN_FILE"
_MIN_SECRET = 16  # characters: a shorter file secret is refused as too guessable
_HOW = (
    f"export {TOKEN_VAR} on every node, or give --store-token-file FILE "
    f"(or {TOKEN_FILE_VAR}) with a file of mode 600"
)


def user_secret_path() -> str:
    """The per-user secret file: ``$XDG_CONFIG_HOME/distlaunch/secret``, else
    ``~/.config/distlaunch/secret``. Pure (no I/O)."""
    base = lookup("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "distlaunch", "secret")


def read_secret_file(path: str, what: str) -> str:
    """The secret in ``path`` (surrounding white space removed). ``what`` names the file's
    source in errors (e.g. ``--store-token-file``).

    Raises ConfigError when the file cannot be read, is not a regular file, is not owned
    by this user, is readable or writable by group or others, or holds fewer than 16
    characters. Does not follow a symbolic link as the last component.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read ({e.strerror}); {_HOW}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path!r} is not a regular file; give a file of mode 600")
        if st.st_uid != os.getuid():
            raise ConfigError(
                f"{what} {path!r} is owned by uid {st.st_uid}, not by you "
                f"(uid {os.getuid()}); use a file of your own, mode 600"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{what} {path!r} has mode {stat.S_IMODE(st.st_mode):o}: others "
                f"may read it; run chmod 600 {path}"
            )
        text = os.read(fd, 65536).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if len(text) < _MIN_SECRET:
        raise ConfigError(
            f"{what} {path!r} holds {len(text)} characters; put a secret of at "
            f"least {_MIN_SECRET} in it (e.g. `openssl rand -hex 32 > {path}`)"
        )
    return text


def _user_secret() -> str:
    """Read the per-user secret file, creating it (0600, in a 0700 directory) if absent.
    Two processes racing to create it agree: only the O_EXCL winner writes, the other
    reads what was written. Raises ConfigError when it can be neither read nor made."""
    path = user_secret_path()
    if not os.path.lexists(path):
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (secrets.token_hex(32) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic and never replaces: the first writer wins
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise ConfigError(
                f"no store secret: the per-user secret file {path!r} cannot be created ({e.strerror}); {_HOW}"
            ) from None
    return read_secret_file(path, "the per-user secret file")


def shared_token(context: str, token_file: str | None = None) -> str:
    """The store token of a job whose processes start independently (see the module
    docstring for the order of sources). ``context`` separates jobs (the run id, or
    ``port:<N>`` for env://); it is public, the secret it is mixed with is not.

    May create the per-user secret file. Raises ConfigError (one line saying how to
    provide a secret) when no secret can be had.
    """
    explicit = lookup(TOKEN_VAR)
    if explicit:
        return explicit
    if token_file:
        secret = read_secret_file(token_file, "--store-token-file")
    elif path := lookup(TOKEN_FILE_VAR):
        secret = read_secret_file(path, TOKEN_FILE_VAR)
    else:
        secret = _user_secret()
    return hmac.new(secret.encode(), f"distlaunch-store:{context}".encode(), hashlib.sha256).hexdigest()


def derive_key(token: str | bytes, purpose: str, *public: str | bytes) -> bytes:
    """A 32-byte key for ``purpose`` (e.g. "transport"): HMAC-SHA256(token, label),
    the label being ``distlaunch-key:<purpose>`` and every ``public`` value (run id,
    restart count, a published nonce...), each length-prefixed so that no two
    different lists give the same label. Processes holding the same token and the same
    public values agree on the key without exchanging anything secret; without the
    token it cannot be computed, and it reveals nothing of the token (HMAC is a PRF).
    Pure; str values are UTF-8 encoded."""
    msg = bytearray(b"distlaunch-key:" + purpose.encode())
    for v in public:
        b = v.encode() if isinstance(v, str) else bytes(v)
        msg += len(b).to_bytes(4, "big") + b
    key = token.encode() if isinstance(token, str) else bytes(token)
    return hmac.new(key, bytes(msg), hashlib.sha256).digest()
