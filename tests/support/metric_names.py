"""Every Prometheus series name Crucible's code can export (trainer and operator)."""

from __future__ import annotations


def exported_metric_names() -> set[str]:
    """Every series name the code can export: the trainer's registry (trainer/metrics.py) and
    the operator's (operator/metrics.py, per-job families included), read from their own
    exposition output, with the suffixes Prometheus stores (_total, _bucket, _sum, _count)."""
    from prometheus_client import generate_latest

    from crucible.operator import metrics as operator_metrics
    from crucible.trainer.metrics import Metrics

    trainer = Metrics("j", 0, enabled=False, port=None, jsonl_path=None).registry
    record = operator_metrics.JobRecord("ns", "j", {"phase": "Running"}, 600.0)
    text = generate_latest(trainer).decode()
    text += generate_latest(operator_metrics.REGISTRY).decode()
    for collector in (operator_metrics.JobsByPhase(lambda: {}),
                      operator_metrics.JobStatus(lambda: {"u": record})):
        for family in collector.collect():
            text += f"# TYPE {family.name} {family.type}\n"
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                        "summary": ["_sum", "_count", ""]}.get(kind, [""])
            names.update(name.removesuffix("_total") + s if kind == "counter" else name + s
                         for s in suffixes)
    return names
