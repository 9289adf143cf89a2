"""Alert rules (manifests/prometheus/crucible-alerts.yaml): promtool's checks and unit tests,
and every runbook link lands on a section of docs/runbooks.md.

tests/ship/alerts.test.yaml holds the series: for each alert, one job that must fire and others
that must not (a healthy falling loss, a short spike, a suspended job, a resumed one, a job
without time-based checkpoints, one node loss per 30 minutes, ...). test_live.py loads the same
file into the stack's real Prometheus.
"""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.support.repo import REPO
from tests.support.tools import tool

RULES = REPO / "manifests" / "prometheus" / "crucible-alerts.yaml"
UNIT_TESTS = REPO / "tests" / "ship" / "alerts.test.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"
ISSUE_ALERTS = {"CrucibleLossSpike", "CrucibleGradNormExplosion", "CrucibleTrainingStalled",
                "CrucibleCheckpointStale", "CrucibleRestartingTooOften", "CrucibleJobFailed",
                "CrucibleStraggler"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120)


def _alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def test_promtool_check_rules():
    out = _promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in out.stdout


def test_promtool_unit_tests_fire_and_stay_quiet():
    out = _promtool("test", "rules", str(UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == {a["alert"] for a in _alerts()} == ISSUE_ALERTS


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, flags=re.M)}


def test_every_alert_has_a_runbook_section_and_a_severity():
    anchors = _anchors(RUNBOOKS.read_text())
    for alert in _alerts():
        url = alert["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert path == "docs/runbooks.md" and anchor in anchors, (alert["alert"], url)
        assert anchor == alert["alert"].lower()
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description"} <= alert["annotations"].keys()


def test_every_guard_verdict_has_a_series_from_the_start():
    """CrucibleLossSpike counts `increase(crucible_spikes_total)`; a series first seen at 1 would
    show no increase, so every verdict the guard can give is exported at 0 from the start."""
    from crucible.trainer.metrics import KNOWN_LABELS

    kinds = set(re.findall(r'Verdict\("(\w+)"', (REPO / "trainer" / "guard.py").read_text()))
    assert kinds - {"ok"} == set(KNOWN_LABELS["spikes"]["verdict"])
