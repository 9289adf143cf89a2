"""Checks on an in-process operator run (kopf's `KopfRunner`) once it has stopped."""

from __future__ import annotations


def assert_clean_exit(runner, *lines: str) -> None:
    """kopf's docs/testing.rst: no exception, exit code 0, and the log says what happened."""
    assert runner.exception is None, runner.output[-3000:]
    assert runner.exit_code == 0, runner.output[-3000:]
    for line in lines:
        assert line in runner.output, (f"{line!r} not in the operator's log:\n"
                                       f"{runner.output[-3000:]}")
