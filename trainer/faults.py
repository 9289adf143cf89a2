"""Fault injection for chaos tests of the stability guard, switched on by an environment variable.

  CRUCIBLE_INJECT="garbage@20,lr_x100@40,nan@60"

makes step 20 train on uniformly random token ids (a corrupt batch), step 40 use 100x the
scheduled learning rate (a bad update), and step 60 produce a NaN loss. Each fault fires once per
process, so a rollback that re-runs the step does not meet it again (as a transient hardware or
data glitch would not recur). Unset in production; costs a dict lookup per step.

  CRUCIBLE_SLOW_RANK="1:1.3"

makes rank 1 a straggler: after each stretch of its compute (forward/backward, the optimizer
step) it computes (spins) for 0.3x that stretch's CPU time, as a device 1.3x slower would take.
A CPU test tool: on a GPU the host does not wait for the kernels it would measure.
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

    def put_back(self, step: int, faults: set[str]) -> None:
        """Faults taken for a step that was then dropped before its update (a rollback or a
        stop decided meanwhile): they fire when the step is computed again."""
        if faults:
            self.pending.setdefault(step, set()).update(faults)


def slowdown_from_env(rank: int) -> float:
    """This rank's injected slowdown factor (1.0: none), from CRUCIBLE_SLOW_RANK=<rank>:<factor>."""
    spec = os.environ.get("CRUCIBLE_SLOW_RANK", "").strip()
    if not spec:
        return 1.0
    target, _, factor = spec.partition(":")
    try:
        target_rank, slow = int(target), float(factor)
    except ValueError:
        raise ValueError(f"CRUCIBLE_SLOW_RANK={spec!r}: use <rank>:<factor>, e.g. 1:1.3") from None
    if slow < 1:
        raise ValueError(f"CRUCIBLE_SLOW_RANK={spec!r}: the factor must be >= 1")
    return slow if target_rank == rank else 1.0
