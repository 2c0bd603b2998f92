"""distlaunch: launch, supervise and connect distributed Python programs.

Kept import-light on purpose: workers import ``distlaunch.collectives`` and must not pay
for the launcher's dependencies.
"""

__version__ = "0.1.0"
