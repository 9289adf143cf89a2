"""When the per-job daemon runs its next pass: a typed answer (`NextPass`), never a magic number.

`next_pass` is pure: after a pass that went through, a transient API failure retries soon, a
status-only decision runs again at once, a time-based decision wakes the daemon just after it
falls due (unless the resync comes first), and otherwise the periodic resync applies.
"""

from __future__ import annotations

import pytest

from crucible.operator.handlers import DUE_SLACK_S, RETRY_S, After, NextPass, next_pass
from crucible.operator.kube import Applied
from crucible.operator.outcome import Outcome

INTERVAL_S = 10.0


@pytest.mark.parametrize("outcome, applied, expected", [
    (Outcome(), Applied(transient=["pods: 503"]), NextPass(After.RETRY, RETRY_S)),
    (Outcome(requeue=True), Applied(transient=["pods: 503"]), NextPass(After.RETRY, RETRY_S)),
    (Outcome(requeue=True, wake_in_s=3.0), Applied(), NextPass(After.NOW, 0.0)),
    (Outcome(wake_in_s=3.0), Applied(), NextPass(After.DUE, 3.0 + DUE_SLACK_S)),
    (Outcome(wake_in_s=0.0), Applied(), NextPass(After.DUE, DUE_SLACK_S)),
    (Outcome(wake_in_s=30.0), Applied(), NextPass(After.RESYNC, INTERVAL_S)),
    (Outcome(), Applied(rejected=["pods: 422"]), NextPass(After.RESYNC, INTERVAL_S)),
    # A pod held back because the NetworkPolicy it comes after was refused: retried.
    (Outcome(), Applied(rejected=["networkpolicies: 403"], held=["create Pod/gpt-0-0"]),
     NextPass(After.RETRY, RETRY_S)),
])
def test_next_pass(outcome, applied, expected):
    assert next_pass(outcome, applied, INTERVAL_S) == expected


def test_a_due_decision_shortens_a_retry_but_never_below_the_first_backoff():
    failing = Applied(transient=["pods: 429"])
    # The fifth failure in a row would wait 30 s; a decision due in 5 s comes first.
    assert next_pass(Outcome(wake_in_s=5.0), failing, INTERVAL_S, failures=5) == \
        NextPass(After.RETRY, 5.0 + DUE_SLACK_S)
    # One due now (a pod past its terminating timeout whose force-delete is throttled): not
    # every 50 ms, but every RETRY_S.
    assert next_pass(Outcome(wake_in_s=0.0), failing, INTERVAL_S, failures=5) == \
        NextPass(After.RETRY, RETRY_S)
