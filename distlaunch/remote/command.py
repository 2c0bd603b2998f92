"""The command line that starts a program on a remote node, and which environment
variables travel with it.

Standard library only (no paramiko). The command line is run by sshd through the remote
user's login shell (``$SHELL -c``), which must be POSIX-compatible (sh, bash, dash, zsh,
ksh); csh and fish users need ``/bin/sh`` wrapping that is not done here.

Values shipped this way appear in the remote process's command line (``ps``) while ``env``
execs the program: never ship secrets through :func:`shipped_env`; secrets go through
stdin (``SSHConnection.exec(stdin_data=...)``). ``DISTLAUNCH_STORE_TOKEN`` is refused.

Imports no ``re``, ``shlex`` or ``fnmatch`` at load (~5 ms of a fresh interpreter's CPU):
the Slurm agent step's early start builds its command line (``checked_command`` without
variables) before anything else is imported (``remote.srun.start_early``).
"""

from __future__ import annotations

from .. import AGENT_HELLO as AGENT_HELLO
from ..errors import ConfigError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "HOST_SPECIFIC",
    "shipped_env",
    "env_file",
    "remote_command",
    "checked_command",
    "host_checks",
    "check_problem",
    "version_mismatch",
    "quote",
]

# Not shipped by env_all: they describe the head's machine, login or terminal, and the
# remote sshd/login sets its own. Patterns use fnmatch syntax.
HOST_SPECIFIC = (
    "SSH_*",  # the head's own SSH session and agent socket
    "DISPLAY",
    "XAUTHORITY",
    "WAYLAND_DISPLAY",
    "XDG_*",
    "DBUS_SESSION_BUS_ADDRESS",
    "HOSTNAME",
    "HOST",
    "HOSTTYPE",
    "PWD",
    "OLDPWD",  # the remote cwd is set by `cd`
    "HOME",
    "USER",
    "LOGNAME",
    "MAIL",
    "SHELL",  # the remote account may differ
    "TERM",
    "TERMCAP",
    "COLORTERM",
    "COLUMNS",
    "LINES",
    "TMUX",
    "TMUX_PANE",
    "STY",
    "WINDOW",
    "SHLVL",
    "_",
    "PS1",
    "PS2",
    "PROMPT_COMMAND",
    "TMPDIR",
    "KRB5CCNAME",  # per-machine paths
    "CUDA_VISIBLE_DEVICES",  # per-machine device ids: ship explicitly if equal
    "SLURM_*",
    "PMI_*",
    "PMIX_*",
    "OMPI_*",
    "PRTE_*",
    "HYDRA_*",
    "MPI_LOCAL*",  # schedulers
    "BASH_FUNC_*",  # exported shell functions
)

_SECRET = "DISTLAUNCH_STORE_TOKEN"
# the characters of a -x glob (a name's and fnmatch's)
_GLOB = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_*?[]!")
# shlex.quote's safe characters (its ``[^\w@%+=:,./-]`` with re.ASCII)
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-")


def quote(text: str) -> str:
    """``shlex.quote(text)`` (a POSIX shell word that reads back as ``text``), without
    importing ``shlex`` and ``re``. Pure."""
    if not text:
        return "''"
    if _SAFE.issuperset(text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _is_name(name: str) -> bool:
    """A shell variable name (POSIX: ASCII letters, digits, ``_``; not starting with a
    digit), which an ASCII identifier is exactly."""
    return name.isascii() and name.isidentifier()


def _host_specific(name: str) -> bool:
    from fnmatch import fnmatchcase

    return any(fnmatchcase(name, pattern) for pattern in HOST_SPECIFIC)


def shipped_env(environ: Mapping[str, str], names: list[str], env_all: bool) -> dict[str, str]:
    """The variables to set for remote processes, from the head's ``environ``.

    Follows ``mpirun -x``: each item of ``names`` is ``NAME`` (its value is taken from
    ``environ``), ``NAME=VALUE`` (exactly that value) or a glob such as ``NCCL_*``
    (every variable of ``environ`` it matches; none is fine). With ``env_all`` every variable
    of ``environ`` is shipped except :data:`HOST_SPECIFIC` ones, the names distlaunch sets
    per worker (``RANK``, ``MASTER_ADDR``, ``DISTLAUNCH_*``, scheduler ranks ...) and names
    that are not shell identifiers. ``PYTHONPATH`` is always shipped when set. Explicit
    ``names`` win over ``env_all`` (a host-specific name can still be shipped by naming
    it).

    Raises ConfigError: a ``NAME`` not set in ``environ``, a name that is not an identifier
    (letters, digits, ``_``) or glob, or ``DISTLAUNCH_STORE_TOKEN`` (secrets are never
    shipped this way).
    """
    from fnmatch import fnmatchcase

    out: dict[str, str] = {}
    if env_all:
        # set per worker by the agent (env.py; imported only here: the Slurm agent step's
        # command line, remote.srun, starts before it): the head's values are only noise
        from ..env import DISTLAUNCH_VARS, MPI_VARS, STALE_VARS, TORCHRUN_VARS

        launcher_set = {*TORCHRUN_VARS, *MPI_VARS, *DISTLAUNCH_VARS, *STALE_VARS}
        out.update(
            (k, v)
            for k, v in environ.items()
            if _is_name(k) and not _host_specific(k) and k not in launcher_set
        )
    if "PYTHONPATH" in environ:
        out["PYTHONPATH"] = environ["PYTHONPATH"]
    for item in names:
        name, eq, value = item.partition("=")
        if not eq and name and _GLOB.issuperset(name) and set(name) & set("*?["):
            out.update((k, v) for k, v in environ.items() if fnmatchcase(k, name) and k != _SECRET)
            continue
        if not _is_name(name):
            raise ConfigError(
                f"-x {item!r}: {name!r} is not a variable name; use NAME or NAME=VALUE (letters, digits, _)"
            )
        if name == _SECRET:
            raise ConfigError(
                f"-x {name}: the store token is never shipped on a command "
                f"line; remove it (distlaunch passes it to agents itself)"
            )
        if not eq:
            if name not in environ:
                raise ConfigError(
                    f"-x {name}: not set in this environment; export it first or write -x {name}=VALUE"
                )
            value = environ[name]
        out[name] = value
    return out


def env_file(path: str) -> dict[str, str]:
    """The variables of a dotenv file (``--env-file``; Docker's and python-dotenv's
    syntax: ``NAME=value`` lines, optional ``export``, single or double quotes, ``#``
    comments, blank lines), shipped like ``-x NAME=value``. Reads the file (blocking).

    Raises ConfigError naming ``path:line``: the file cannot be read, a line is not
    ``NAME=value``, or it sets ``DISTLAUNCH_STORE_TOKEN``.
    """
    from dotenv.parser import parse_stream  # only when an env file is given

    try:
        with open(path, encoding="utf-8") as f:
            bindings = list(parse_stream(f))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--env-file {path}: cannot read it ({e}); check the path") from None
    out: dict[str, str] = {}
    for b in bindings:
        where = f"--env-file {path}:{b.original.line}"
        if b.error or (b.key is not None and (b.value is None or not _is_name(b.key))):
            line = b.original.string.strip()
            raise ConfigError(f"{where}: cannot read {line!r}; write NAME=value")
        if b.key == _SECRET:
            raise ConfigError(f"{where}: the store token is never shipped this way; remove the line")
        if b.key is not None and b.value is not None:
            out[b.key] = b.value
    return out


def remote_command(python: str, cwd: str, argv: list[str], env: Mapping[str, str]) -> str:
    """A POSIX ``sh`` command line: ``cd <cwd> && exec env NAME=VALUE ... <python> <argv>``.

    Every piece is quoted (``quote``, as ``shlex.quote``), so values with spaces,
    quotes, ``$``, ``;``, globs and newlines arrive byte for byte. ``cwd`` is taken
    literally (no ``~`` expansion; a relative path is relative to the remote home).
    ``exec`` makes the program the session's process, so sshd reports its exit status
    directly. Pure.

    Raises ConfigError: an environment name that is not an identifier, ``python`` empty,
    starting with ``-`` or containing ``=`` (``env`` would take it for an option or an
    assignment), ``cwd`` empty.
    """
    _check(python, cwd, env)
    if cwd.startswith("-"):  # `cd -x` would be read as an option
        cwd = "./" + cwd
    return " ".join(["cd", quote(cwd), "&&", _exec(quote(python), argv, env)])


# The marks a checked command prints (on stdout) when the host cannot run it, and the
# first line the agent prints once it runs: "<AGENT_HELLO> <version>" (remote.preflight;
# defined at the package's top so the agent says it before any other import).
CHECK_MARK = "DISTLAUNCH-PREFLIGHT"
CHECK_FAILED = 97  # the exit status after a mark


def host_checks(python: str, cwd: str) -> str:
    """POSIX ``sh`` lines that enter ``cwd`` and make sure ``python`` can be run there
    (a path, relative to ``cwd`` if relative, or a name on the remote ``PATH``); on a
    problem they print ``CHECK_MARK nodir|nocd|nopython`` and exit ``CHECK_FAILED``.
    They leave ``$py`` set to the interpreter. No ``!`` (history expansion). Pure."""
    q = quote
    fail = f'{{ echo "{CHECK_MARK} %s"; exit {CHECK_FAILED}; }}'
    return "\n".join(
        [
            f"d={q(cwd)}; py={q(python)}",
            'test -d "$d" || ' + fail % "nodir",
            'cd -- "$d" 2>/dev/null || ' + fail % "nocd",
            'case "$py" in',
            '  */*) { test -x "$py" && test -f "$py"; } || ' + fail % "nopython" + " ;;",
            '  *) command -v "$py" >/dev/null 2>&1 || ' + fail % "nopython" + " ;;",
            "esac",
        ]
    )


def check_problem(mark: str, python: str, cwd: str) -> str | None:
    """What a :func:`host_checks` mark (``nodir``, ``nocd`` or ``nopython``) says is wrong
    with ``cwd`` or ``python``, as one line; None for any other mark. Pure."""
    if mark == "nodir":
        return f"directory {cwd} does not exist"
    if mark == "nocd":
        return f"directory {cwd} cannot be entered (permissions?)"
    if mark == "nopython":
        return f"python {python} not found or not executable"
    return None


def version_mismatch(expected: str, found: str, python: str) -> str:
    """The problem of a host whose ``python`` imports distlaunch ``found`` while the head
    runs ``expected`` (mixed versions would speak different protocols). Pure."""
    return f"distlaunch {expected} expected, found {found} (python {python})"


def checked_command(python: str, cwd: str, argv: list[str], env: Mapping[str, str]) -> str:
    """Like :func:`remote_command`, with :func:`host_checks` first: a host that cannot
    run the program says why (a mark) instead of a shell error. Pure. Raises as
    :func:`remote_command`."""
    _check(python, cwd, env)
    return host_checks(python, cwd) + "\n" + _exec('"$py"', argv, env)


def _check(python: str, cwd: str, env: Mapping[str, str]) -> None:
    if not python or "=" in python or python.startswith("-"):
        raise ConfigError(
            f"remote python {python!r}: give an interpreter path (no '=', not starting with '-')"
        )
    if not cwd:
        raise ConfigError("remote working directory is empty; give a directory")
    for name in env:
        if not _is_name(name):
            raise ConfigError(f"environment name {name!r} is not a variable name (letters, digits, _)")


def _exec(python: str, argv: list[str], env: Mapping[str, str]) -> str:
    assignments = [quote(f"{k}={v}") for k, v in env.items()]
    run_env = ["env", *assignments] if assignments else []  # no variables: no env process
    return " ".join(["exec", *run_env, python, *(quote(a) for a in argv)])
