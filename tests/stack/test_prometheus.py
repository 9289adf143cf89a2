"""Prometheus is real: it scrapes a prometheus_client exporter and answers PromQL over HTTP."""

from __future__ import annotations

import random
import secrets

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.support.services import eventually

pytestmark = pytest.mark.stack


def test_exporter_is_scraped_and_queryable(prometheus):
    registry = CollectorRegistry()
    probe = Gauge("crucible_stack_probe", "A value set by the stack test", ["run"], registry=registry)
    run = secrets.token_hex(4)
    value = round(random.uniform(1, 1000), 3)
    probe.labels(run=run).set(value)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_address[1]
    target = prometheus.add_target(f"probe-{run}", f"127.0.0.1:{port}")
    try:
        result = eventually(lambda: prometheus.query(f'crucible_stack_probe{{run="{run}"}}'),
                            30, "probe series in Prometheus")
        assert float(result[0]["value"][1]) == value
        assert result[0]["metric"]["job"] == "crucible"
        up = prometheus.query(f'up{{instance="127.0.0.1:{port}"}}')
        assert up and up[0]["value"][1] == "1"
    finally:
        target.unlink()
        server.shutdown()


def test_a_trainer_cannot_label_its_series_as_another_namespaces(prometheus):
    """A trainer pod serves its metrics from the tenant's own code. Scraped as the chart's
    PodMonitor scrapes it (honorLabels off, `job` from the pod's crucible.dev/job label), series
    it labels with another namespace and job keep the target's own; what it claimed is kept
    only as exported_namespace / exported_job."""
    registry = CollectorRegistry()
    loss = Gauge("crucible_loss", "A forged loss", ["job", "namespace", "rank"], registry=registry)
    jobs = Gauge("crucible_operator_jobs", "Forged operator series", ["phase"], registry=registry)
    run = secrets.token_hex(4)
    loss.labels(job="victim-job", namespace=f"victim-{run}", rank="0").set(99.0)
    jobs.labels(phase=f"Forged{run}").set(1000)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_address[1]
    target = prometheus.add_target(f"tenant-{run}", f"127.0.0.1:{port}",
                                   {"namespace": f"tenant-{run}", "job": "tenant-job"}, pod=True)
    try:
        [series] = eventually(lambda: prometheus.query(f'crucible_loss{{exported_namespace='
                                                       f'"victim-{run}"}}'),
                              30, "the trainer's series in Prometheus")
        assert series["metric"]["namespace"] == f"tenant-{run}"
        assert series["metric"]["job"] == "tenant-job"
        assert series["metric"]["exported_job"] == "victim-job"
        assert prometheus.query(f'crucible_loss{{namespace="victim-{run}"}}') == []
        # ... and the operator's own series cannot be added to from a trainer.
        assert prometheus.query(f'crucible_operator_jobs{{phase="Forged{run}"}}') == []
    finally:
        target.unlink()
        server.shutdown()
