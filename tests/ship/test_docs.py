"""The docs that defend each default: present, linked from where people look, links that land.

docs/defaults.md has a section per default the issue names; `crucible plan` (where defaults are
chosen) and the chart's NOTES point to it; alert runbooks point into docs/runbooks.md
(test_alerts.py); every relative link in these pages reaches an existing file and heading.
"""

from __future__ import annotations

import re

import pytest

from tests.ship.conftest import CHART, REPO
from tests.ship.test_alerts import _anchors

DOCS = REPO / "docs"
PAGES = ["defaults.md", "runbooks.md"]


def test_defaults_page_has_a_section_per_default():
    anchors = _anchors((DOCS / "defaults.md").read_text())
    assert {"token-budget", "vocabulary-size", "sharding-stage", "checkpoint-interval",
            "spike-policy", "restart-policy"} <= anchors


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_reach_a_file_and_a_heading(page):
    text = (DOCS / page).read_text()
    links = re.findall(r"\]\(([^)#]+\.md)(?:#([^)]+))?\)", text)
    assert links
    for target, anchor in links:
        path = DOCS / target
        assert path.is_file(), (page, target)
        if anchor:
            assert anchor in _anchors(path.read_text()), (page, target, anchor)


def test_plan_output_and_chart_notes_point_to_the_defaults(capsys):
    from crucible.trainer.cli import main

    assert main(["plan", "--params", "124M", "--gpus", "8"]) == 0
    assert "docs/defaults.md" in capsys.readouterr().out
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "docs/defaults.md" in notes and "docs/runbooks.md" in notes
