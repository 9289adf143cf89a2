"""The docs that defend each default: present, linked from where people look, links that land.

docs/defaults.md has a section per default (token budget, vocabulary size, sharding stage,
checkpoint interval, spike policy, restart policy); `crucible plan` (where defaults are chosen)
and the chart's NOTES point to it; alert runbooks point into docs/runbooks.md (test_alerts.py);
every relative link in README.md and the pages of docs/ reaches an existing file and heading.

Module docstrings are documentation too: every module of api/, operator/ and trainer/ opens with
one, cites only what the repository holds (its files, papers, public projects), and every
repository path it names (a token with a '/' ending in .py, .md, .yaml, .json or .sh whose first
folder is one of the repository's) exists. Paths relative to a module's own package
(`checkpoint.py`, `plan/memory.py`) and other projects' files (`megatron/training/arguments.py`)
are not checked: their first folder is not one of the repository's.
"""

from __future__ import annotations

import ast
import re

import pytest

from tests.ship.test_alerts import _anchors
from tests.support.chart import CHART
from tests.support.repo import REPO

DOCS = REPO / "docs"
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in DOCS.glob("*.md"))]
PACKAGES = ("api", "operator", "trainer")
MODULES = sorted(str(p.relative_to(REPO)) for package in PACKAGES
                 for p in (REPO / package).rglob("*.py"))
# Documents that are not in the repository: design notes, style guides, research notes, issue
# numbers of a tracker the code does not ship with, files beside the checkout. A public project
# whose name ends in "research" (epoch-research/analyzing-chinchilla) is not one of them.
OUTSIDE = re.compile(r"DESIGN\.md|STYLE\.md|(?<![\w-])research/|[Rr]esearch notes?|[Ii]ssue [0-9]+"
                     r"|\.\./shared")
# A path-like token: not inside another token (no absolute paths, no `~/...`), at least one '/'.
PATH_TOKEN = re.compile(r"(?<![\w./~-])[\w.-]+(?:/[\w.-]+)+")
EXTENSIONS = (".py", ".md", ".yaml", ".json", ".sh")
TOP_FOLDERS = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}


def test_defaults_page_has_a_section_per_default():
    anchors = _anchors((DOCS / "defaults.md").read_text())
    assert {"token-budget", "vocabulary-size", "sharding-stage", "checkpoint-interval",
            "spike-policy", "restart-policy"} <= anchors


def _relative_links(markdown: str) -> list[tuple[str, str]]:
    """(path, anchor) of every Markdown link that is not a URL; path "" is the page itself."""
    links = []
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        links.append((path, anchor))
    return links


def test_the_link_pattern_finds_links():
    for page in ("README.md", "docs/defaults.md", "docs/runbooks.md"):
        assert _relative_links((REPO / page).read_text()), page


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_reach_a_file_and_a_heading(page):
    source = REPO / page
    for target, anchor in _relative_links(source.read_text()):
        path = (source.parent / target) if target else source
        assert path.exists(), (page, target)
        if anchor:
            assert path.suffix == ".md", (page, target, anchor)
            assert anchor in _anchors(path.read_text()), (page, target, anchor)


def _repository_paths(text: str) -> list[str]:
    """Tokens of `text` that name a file of this repository by its path from the root."""
    paths = []
    for token in PATH_TOKEN.findall(text):
        token = token.rstrip(".,;:")
        if token.endswith(EXTENSIONS) and token.split("/", 1)[0] in TOP_FOLDERS:
            paths.append(token)
    return paths


def test_path_detection_takes_repository_paths_only():
    text = ("see docs/operator.md, trainer/checkpoint.py and `tests/trainer/test_data.py`. Not "
            "checkpoint.py, plan/memory.py, /usr/lib/python3/json/encoder.py, ~/.cache/x/y.json, "
            "step_<N>/manifest.json, megatron/training/arguments.py or manifests/crd/ (a folder)")
    assert _repository_paths(text) == ["docs/operator.md", "trainer/checkpoint.py",
                                       "tests/trainer/test_data.py"]


def test_outside_citations_are_recognised():
    for cited in ("DESIGN.md", "STYLE.md section 5", "research/operator.md", "our research notes",
                  "issue 6", "Issue 10", "../shared/x"):
        assert OUTSIDE.search(cited), cited
    for public in ("epoch-research/analyzing-chinchilla", "kubeflow/trainer#2045", "docs/"):
        assert not OUTSIDE.search(public), public


def _docstring(module: str) -> str | None:
    return ast.get_docstring(ast.parse((REPO / module).read_text(), filename=module))


@pytest.mark.parametrize("module", MODULES)
def test_module_docstring_exists_and_cites_only_the_repository(module):
    doc = _docstring(module)
    assert doc, f"{module} does not open with a docstring"
    outside = [line.strip() for line in doc.splitlines() if OUTSIDE.search(line)]
    assert not outside, f"{module} cites documents outside the repository: {outside}"
    missing = [p for p in _repository_paths(doc) if not (REPO / p).exists()]
    assert not missing, f"{module} names repository paths that do not exist: {missing}"


def test_plan_output_and_chart_notes_point_to_the_defaults(capsys):
    from crucible.trainer.cli import main

    assert main(["plan", "--params", "124M", "--gpus", "8"]) == 0
    assert "docs/defaults.md" in capsys.readouterr().out
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "docs/defaults.md" in notes and "docs/runbooks.md" in notes
