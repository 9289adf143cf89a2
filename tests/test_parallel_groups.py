"""How the suite is split between pytest-xdist workers (tests/conftest.py, `make test`): checked on
this very session's collection, so a new cluster test that would run beside another one is
caught."""

from __future__ import annotations

import os

from tests.conftest import CLUSTER_GROUP, math_threads_per_worker


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


def test_parallel_workers_split_the_cores_between_them():
    assert math_threads_per_worker(2, 2) == 1
    assert math_threads_per_worker(16, 2) == 8
    assert math_threads_per_worker(2, 4) == 1     # never zero threads
    assert math_threads_per_worker(8, 1) is None  # serial: the default stays
    assert math_threads_per_worker(8, 0) is None
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        # This worker's own math and the training processes it starts agree on the count.
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
