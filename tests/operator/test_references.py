"""Objects a job names but does not own (`references.py`): a missing Secret or PriorityClass is a
condition naming it and one event, never a silent Pending. Pure: `decide` on built observations;
test_lifecycle.py has the same on the real control plane."""

from __future__ import annotations

from crucible.operator import manifests as m
from crucible.operator.decision import decide
from tests.operator import builders as b
from tests.operator.test_decision import acts, cond, reasons

H = m.spec_hash(b.spec())
NOT_FOUND = 'secret "s3-creds" not found'   # the kubelet's words (makeEnvironmentVariables)


def _stuck(message=NOT_FOUND):
    return [b.pod(0, i, phase="Pending", waiting="CreateContainerConfigError",
                  waiting_message=message, spec_hash=H) for i in range(4)]


def test_a_missing_secret_is_a_condition_naming_it_and_one_event_then_fails_the_job():
    first = decide(b.job(), b.observed(_stuck()), b.at(5))
    missing = cond(first, "CredentialsMissing")
    assert missing["status"] == "True" and missing["reason"] == "SecretNotFound"
    assert "Secret s3-creds" in missing["message"] and "create it" in missing["message"]
    assert reasons(first).count("CredentialsMissing") == 1
    assert first.status["phase"] == "Pending"
    again = decide(b.job(status=first.status), b.observed(_stuck()), b.at(10))
    assert "CredentialsMissing" not in reasons(again)          # one event, not one per pass
    failed = decide(b.job(status=again.status), b.observed(_stuck()), b.at(601))
    assert failed.status["phase"] == "Failed"
    assert cond(failed, "Failed")["reason"] == "CredentialsMissing"


def test_another_config_error_is_not_called_missing_credentials():
    outcome = decide(b.job(), b.observed(_stuck('configmap "x" not found')), b.at(5))
    assert "CredentialsMissing" not in {c["type"] for c in outcome.status["conditions"]}
    assert outcome.status["phase"] == "Pending"


def test_the_condition_clears_once_the_pods_start():
    first = decide(b.job(), b.observed(_stuck()), b.at(5))
    # Pods not reporting yet (say, recreated) say nothing either way.
    unsure = decide(b.job(status=first.status), b.observed([]), b.at(6))
    assert cond(unsure, "CredentialsMissing")["status"] == "True"
    fixed = decide(b.job(status=first.status), b.observed(b.running(0, 4, H)), b.at(20))
    assert cond(fixed, "CredentialsMissing")["status"] == "False"
    assert fixed.status["phase"] == "Running"


def test_a_missing_priority_class_creates_no_pod_and_says_so_once():
    job = dict(scheduling={"priorityClassName": "training-high"})
    known = frozenset({"system-cluster-critical", "system-node-critical"})
    first = decide(b.job(**job), b.observed(priority_classes=known), b.at(0))
    assert acts(first, "create", "Pod") == []
    missing = cond(first, "PriorityClassMissing")
    assert missing["status"] == "True" and "PriorityClass training-high" in missing["message"]
    assert reasons(first).count("PriorityClassMissing") == 1
    again = decide(b.job(status=first.status, **job), b.observed(priority_classes=known), b.at(5))
    assert "PriorityClassMissing" not in reasons(again) and acts(again, "create", "Pod") == []
    made = decide(b.job(status=again.status, **job),
                  b.observed(priority_classes=known | {"training-high"}), b.at(9))
    assert acts(made, "create", "Pod") == [("create", "Pod", "gpt-0-0")]
    assert cond(made, "PriorityClassMissing")["status"] == "False"


def test_an_index_still_filling_never_holds_pods_back():
    job = dict(scheduling={"priorityClassName": "training-high"})
    outcome = decide(b.job(**job), b.observed(priority_classes=None), b.at(0))
    assert acts(outcome, "create", "Pod") == [("create", "Pod", "gpt-0-0")]
    assert "PriorityClassMissing" not in {c["type"] for c in outcome.status["conditions"]}
