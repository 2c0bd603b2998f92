"""distlaunch: launch, supervise and connect distributed Python programs.

Kept import-light on purpose: workers import ``distlaunch.collectives`` and must not pay
for the launcher's dependencies. ``distlaunch.launch`` and ``distlaunch.LaunchFailedError``
are loaded on first use.
"""

__version__ = "0.1.0"
AGENT_HELLO = "DISTLAUNCH-AGENT"  # an agent's first line, "<AGENT_HELLO> <version>" (remote.command)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers know the name)
if TYPE_CHECKING:
    from .launch_api import LaunchFailedError as LaunchFailedError
    from .launch_api import launch as launch  # its real signature, for type checkers
    from .progress import heartbeat as heartbeat  # distlaunch.heartbeat()

_LAZY = ("launch", "LaunchFailedError")  # from launch_api, on first use


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import launch_api

        return getattr(launch_api, name)
    if name == "heartbeat":  # progress.heartbeat: stdlib only; kept here so later calls skip this
        from .progress import heartbeat

        globals()["heartbeat"] = heartbeat
        return heartbeat
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
