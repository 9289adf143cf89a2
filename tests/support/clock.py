"""A clock the test moves by hand (`clock.now += 30`), for code that takes a `clock` callable."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
