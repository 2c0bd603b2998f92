"""The one channel from every layer of the launcher to the user: ``say(msg)`` writes a
launcher line (``distlaunch: msg`` on stderr; worker output has its own ``[rank]: ``
prefix), ``progress(text, final)`` updates the live start-up status. The CLI installs
the reporter once (``install``); without it (library use) lines still go to stderr and
no live status is shown. Standard library only, and not ``logging``: this is on the
launcher's start-up path.
"""

from __future__ import annotations

import sys


class Reporter:
    """Writes launcher lines to stderr (looked up at each call, so a redirected
    ``sys.stderr`` is honoured). ``live``: a terminal, where ``progress`` rewrites one
    status line in place and keeps it once final; otherwise ``progress`` shows nothing."""

    def __init__(self, live: bool = False) -> None:
        self.live = live
        self._last: str | None = None

    def say(self, msg: str) -> None:
        sys.stderr.write(f"distlaunch: {msg}\n")
        sys.stderr.flush()

    def progress(self, text: str, final: bool) -> None:
        if self.live and (text != self._last or final):
            sys.stderr.write(f"\r\x1b[Kdistlaunch: {text}" + ("\n" if final else ""))
            sys.stderr.flush()
            self._last = text


_reporter = Reporter()


def install(reporter: Reporter) -> None:
    """Make ``reporter`` the one every later ``say``/``progress`` goes to (process-wide)."""
    global _reporter
    _reporter = reporter


def say(msg: str) -> None:
    """One launcher line through the installed reporter."""
    _reporter.say(msg)


def progress(text: str, final: bool) -> None:
    """The live status through the installed reporter (nothing unless it is live)."""
    _reporter.progress(text, final)


def live() -> bool:
    """Whether the installed reporter shows a live status (worth computing one)."""
    return _reporter.live
