"""distlaunch: launch, supervise and connect distributed Python programs.

Kept import-light on purpose: workers import ``distlaunch.collectives`` and must not pay
for the launcher's dependencies. ``distlaunch.launch`` is loaded on first use.
"""

__version__ = "0.1.0"
AGENT_HELLO = "DISTLAUNCH-AGENT"  # an agent's first line, "<AGENT_HELLO> <version>" (remote.command)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (type checkers know the name)
if TYPE_CHECKING:
    from .launch_api import launch as launch  # its real signature, for type checkers


def __getattr__(name: str) -> object:
    if name == "launch":
        from .launch_api import launch

        return launch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
