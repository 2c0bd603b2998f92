"""distlaunch: launch, supervise and connect distributed Python programs.

Kept import-light on purpose: workers import ``distlaunch.collectives`` and must not pay
for the launcher's dependencies. ``distlaunch.launch`` is loaded on first use.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "launch":
        from .launch_api import launch

        return launch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
