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
