"""Fault injection for chaos tests of the stability guard, switched on by an environment variable.

  CRUCIBLE_INJECT="garbage@20,lr_x100@40,nan@60"

makes step 20 train on uniformly random token ids (a corrupt batch), step 40 use 100x the
scheduled learning rate (a bad update), and step 60 produce a NaN loss. Each fault fires once per
process, so a rollback that re-runs the step does not meet it again (as a transient hardware or
data glitch would not recur). Unset in production; costs a dict lookup per step.
"""

from __future__ import annotations

import os

KINDS = ("garbage", "lr_x100", "nan")


class Faults:
    def __init__(self, spec: str = ""):
        self.pending: dict[int, set[str]] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, step = item.partition("@")
            if kind not in KINDS or not step.isdigit():
                raise ValueError(f"CRUCIBLE_INJECT item {item!r}: use <{'|'.join(KINDS)}>@<step>")
            self.pending.setdefault(int(step), set()).add(kind)

    @classmethod
    def from_env(cls) -> "Faults":
        return cls(os.environ.get("CRUCIBLE_INJECT", ""))

    def take(self, step: int) -> set[str]:
        """The faults to inject at `step` (the step being computed), each only once."""
        return self.pending.pop(step, set())
