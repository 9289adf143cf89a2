"""The per-step record and its sinks, without training: every `StepMetrics` field is a sample
`crucible_<field>` on the exporter and a key of the JSONL "train" record, with the same value;
the names the dashboard, the alert rules and the JSONL readers use are all still there; the
log line reads the record; the run's shape does its batch arithmetic or says why it cannot.
"""

from __future__ import annotations

import json
import math
import urllib.request
from dataclasses import fields

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from crucible.api.spec import TrainJobConfig
from crucible.trainer.loop import BatchError, _format_line, run_shape
from crucible.trainer.metrics import Metrics, StepMetrics

LABELS = {"job": "j", "rank": "0"}

# Series the dashboard, the alert rules (and their tests) and the chart query: a rename would
# leave them empty without any error, so they are pinned here.
EXPORTED = {
    "crucible_train_loss", "crucible_grad_norm", "crucible_update_norm", "crucible_learning_rate",
    "crucible_tokens_per_second", "crucible_mfu", "crucible_step", "crucible_tokens_total",
    "crucible_step_seconds", "crucible_eval_loss", "crucible_eval_bits_per_byte",
    "crucible_checkpoint_blocking_seconds", "crucible_checkpoint_upload_seconds",
    "crucible_checkpoint_bytes", "crucible_last_checkpoint_step", "crucible_checkpoint_age_seconds",
    "crucible_restarts_total", "crucible_lr_scale", "crucible_spikes_total",
    "crucible_rollbacks_total", "crucible_skipped_steps_total", "crucible_skipped_saves_total",
}
# Keys of the "train" record that `crucible diagnose`, the demo's plot, the benches and the
# training tests read, and that metrics.jsonl files already written hold.
TRAIN_KEYS = {"step", "tokens", "world_size", "loss", "grad_norm", "lr", "applied",
              "update_norm", "tokens_per_second", "mfu", "step_seconds"}


def jsonl_key(f) -> str:
    return f.metadata["jsonl"] or f.name


def a_step(**overrides) -> StepMetrics:
    """A record with a different value in every field, so a field read as another shows."""
    values = {f.name: True if f.type == "bool" else 10 * (i + 1) if f.type == "int"
              else 10 * (i + 1) + 0.5 for i, f in enumerate(fields(StepMetrics))}
    return StepMetrics(**{**values, **overrides})


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_field_of_a_step_reaches_the_exporter_and_the_jsonl(tmp_path):
    metrics = Metrics("j", 0, enabled=True, port=0, jsonl_path=tmp_path / "metrics.jsonl")
    try:
        step = a_step()
        metrics.log_step(step)
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
    finally:
        metrics.close()
    scraped = {s.name: s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.labels == LABELS}
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line.keys() == {"time", "kind"} | {jsonl_key(f) for f in fields(StepMetrics)}
    assert line["kind"] == "train"
    for f in fields(StepMetrics):
        value = getattr(step, f.name)
        assert line[jsonl_key(f)] == value, f.name
        assert type(line[jsonl_key(f)]) is type(value), f.name  # `applied` stays a JSON bool
        assert scraped.get(f"crucible_{f.name}") == float(value), f.name


def test_the_names_readers_depend_on_are_kept():
    registry = Metrics("j", 0, enabled=False, port=None, jsonl_path=None).registry
    # A counter's family name may come with or without its _total suffix: compare without.
    exported = {line.split()[2].removesuffix("_total")
                for line in generate_latest(registry).decode().splitlines()
                if line.startswith("# TYPE ")}
    assert {name.removesuffix("_total") for name in EXPORTED} - exported == set()
    assert TRAIN_KEYS - set(a_step().jsonl()) == set()


def test_a_missing_or_nan_value_is_no_sample_but_is_in_the_jsonl(tmp_path):
    metrics = Metrics("j", 0, enabled=True, port=None, jsonl_path=tmp_path / "metrics.jsonl")
    try:
        metrics.log_step(a_step(train_loss=2.5))
        metrics.log_step(a_step(train_loss=float("nan"), checkpoint_age_seconds=None))
        # NaN and "no commit yet" keep the series' last value rather than exporting nonsense.
        get = metrics.registry.get_sample_value
        assert get("crucible_train_loss", LABELS) == 2.5
        assert get("crucible_checkpoint_age_seconds", LABELS) == a_step().checkpoint_age_seconds
    finally:
        metrics.close()
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    assert math.isnan(last["loss"]) and last["checkpoint_age_seconds"] is None


def test_ranks_other_than_0_export_and_write_nothing(tmp_path):
    metrics = Metrics("j", 1, enabled=False, port=None, jsonl_path=tmp_path / "metrics.jsonl")
    metrics.log_step(a_step())
    metrics.close()
    assert metrics.registry.get_sample_value("crucible_step", {"job": "j", "rank": "1"}) is None
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_log_line_reads_the_record():
    step = a_step(step=12, train_loss=3.14159, learning_rate=6e-4, grad_norm=0.25,
                  tokens_per_second=45600.0, mfu=0.4321, step_seconds=0.0897)
    assert _format_line(step, 100) == ("step     12/100 | loss 3.1416 | lr 6.00e-04 | "
                                       "grad 0.250 |     45.6k tok/s | mfu 43.21% |    89.7 ms")


def config(**training) -> TrainJobConfig:
    return TrainJobConfig.model_validate({
        "model": {"preset": "tiny", "vocabSize": 2048}, "data": {"train": "shards"},
        "training": {"tokens": 40960, "globalBatchTokens": 4096, "microBatch": 8, **training}})


def test_the_run_shape_splits_the_global_batch_over_ranks_and_micro_steps():
    seq_len = config().model.to_arch().seq_len
    shape = run_shape(config(), dp_size=2)
    assert shape.global_batch_seqs == 4096 // seq_len
    assert shape.accum_steps * shape.dp_size * shape.micro_batch == shape.global_batch_seqs
    assert shape.tokens_per_step == 4096 and shape.total_steps == 10
    with pytest.raises(BatchError, match="must be a multiple of model.seqLen"):
        run_shape(config(globalBatchTokens=4000), dp_size=2)
    with pytest.raises(BatchError, match="do not divide"):
        run_shape(config(), dp_size=3)
