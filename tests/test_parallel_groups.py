"""How the suite is split between pytest-xdist workers (tests/conftest.py, `make test`): checked on
this very session's collection, so a new cluster test that would run beside another one is
caught."""

from __future__ import annotations

import os

from tests.conftest import CLUSTER_GROUP


def group(item) -> str:
    marks = list(item.iter_markers("xdist_group"))
    assert len(marks) == 1, (item.nodeid, marks)
    return marks[0].args[0]


def test_cluster_tests_share_one_group_and_the_rest_go_by_module(request):
    items = request.session.items
    assert request.node in items
    # In a worker of `pytest -n N --dist loadgroup`, xdist schedules by the group it appended to
    # each test's id: the marks must be in place before it reads them.
    in_loadgroup_worker = ("PYTEST_XDIST_WORKER" in os.environ
                           and getattr(request.config.option, "loadgroup", False))
    for item in items:
        uses_cluster = "kube" in getattr(item, "fixturenames", ())
        module = item.nodeid.split("::")[0]
        assert group(item) == (CLUSTER_GROUP if uses_cluster else module), item.nodeid
        if in_loadgroup_worker:
            assert item.nodeid.endswith(f"@{group(item)}"), item.nodeid
    assert group(request.node) == "tests/test_parallel_groups.py"
