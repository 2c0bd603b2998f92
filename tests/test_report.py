"""The reporter (pure): launcher lines and the live status line, and which one is installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from distlaunch import report
from distlaunch.report import Reporter


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = report._reporter
    yield
    report.install(before)


def test_default_says_on_stderr_and_shows_no_status(capsys: pytest.CaptureFixture[str]) -> None:
    report.install(Reporter())
    report.say("hello")
    report.progress("1/2 ready", False)
    report.progress("2/2 ready", True)
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "distlaunch: hello\n")
    assert not report.live()


def test_live_status_is_rewritten_in_place_and_kept_once_final(capsys: pytest.CaptureFixture[str]) -> None:
    report.install(Reporter(live=True))
    assert report.live()
    report.progress("0/2 ready", False)
    report.progress("0/2 ready", False)  # unchanged: not rewritten
    report.progress("2/2 ready", True)
    report.say("next")
    assert capsys.readouterr().err == (
        "\r\x1b[Kdistlaunch: 0/2 ready\r\x1b[Kdistlaunch: 2/2 ready\ndistlaunch: next\n"
    )


def test_install_redirects_every_later_line() -> None:
    heard: list[str] = []

    class Recorder(Reporter):
        def say(self, msg: str) -> None:
            heard.append(msg)

    report.install(Recorder())
    report.say("a")
    assert heard == ["a"]
