"""Training metrics: the per-step record every sink reads, rank 0's Prometheus exporter and
JSONL file, and the device peak that MFU is measured against.

`StepMetrics` is one optimizer step's numbers. Each quantity is declared there once, with its
help text: the exporter's gauge is `crucible_<field>`, the JSONL "train" record's key is the
field's name (three older keys excepted, see the class), and the loop's log line, progress bar
and progress Lease read the same fields. Adding a per-step metric is adding a field (and
computing it in the loop).
Quantities reported at other moments (eval, checkpoint, restarts) are `EVENT_GAUGES`; the
stability guard's events are `COUNTERS`, exposed with a `_total` suffix. Every series carries
the labels `job` and `rank`. A unit is in the name where a name can carry it (`_seconds`,
`_bytes`, `tokens_per_second`), and in the help text otherwise (nats/token).

MFU's peak comes from `hardware.py` for known GPUs. On a CPU (or an unknown device) the peak is
measured once with a fp32 matmul, and the log says so: CPU MFU is against that measured peak.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from crucible.trainer import hardware


def _metric(help_text: str, *, jsonl: str | None = None):
    """A `StepMetrics` field: its help text, and the JSONL key where it is not the field name."""
    return field(metadata={"help": help_text, "jsonl": jsonl})


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step as every sink sees it (built once per step by the training loop).

    Three quantities keep an older JSONL key (`loss`, `lr`, `tokens`): `crucible diagnose`, the
    demo's plot, the benches and every metrics.jsonl already written read them under those keys,
    while the dashboard and the alert rules read the exported names. Any new field has one name.
    """

    step: int = _metric("Optimizer steps completed")
    # A gauge despite the suffix: it resumes from checkpoints, and goes back on a rollback.
    tokens_total: int = _metric("Tokens trained on so far", jsonl="tokens")
    world_size: int = _metric("Ranks that trained the last step")
    train_loss: float = _metric("Mean training cross-entropy of the last step (nats/token)",
                                jsonl="loss")
    grad_norm: float = _metric("Global gradient L2 norm before clipping")
    learning_rate: float = _metric("Learning rate of the last step", jsonl="lr")
    applied: bool = _metric("1 if the last step's update was applied, 0 if the stability guard "
                            "skipped it")
    # lr·m̂/(√v̂+ε) from the optimizer state (optim.next_update_sq), all-reduced.
    # None (null in the JSONL, the gauge keeps its value) on steps that do not log: measuring
    # it is a pass over the optimizer state.
    update_norm: float | None = _metric("L2 norm of the last AdamW update (0 when the guard "
                                        "skipped it), measured on logging steps")
    tokens_per_second: float = _metric("Training tokens per second of the last step (all ranks)")
    # Model FLOPs per token as arch.flops_per_token counts them; the peak from device_peak_flops.
    mfu: float = _metric("Model FLOPs utilisation (0..1) against the device peak")
    step_seconds: float = _metric("Wall time of the last optimizer step (s)")
    lr_scale: float = _metric("Multiplier the stability guard applies to the LR schedule (1 "
                              "unless lowered)")
    # None until the run has a commit: no sample, and null in the JSONL.
    checkpoint_age_seconds: float | None = _metric(
        "Seconds since the newest checkpoint was committed")

    def jsonl(self) -> dict:
        """The JSONL "train" record's fields, in declaration order."""
        return {f.metadata["jsonl"] or f.name: getattr(self, f.name) for f in fields(self)}


# Gauges set when something other than a step happens (an eval, a save, a commit, a start).
EVENT_GAUGES = {
    "eval_loss": "Held-out loss of the last eval (nats/token)",
    "eval_bits_per_byte": "Held-out loss in bits per byte of UTF-8 text",
    "checkpoint_blocking_seconds": "Training time blocked by the last checkpoint save (s)",
    "checkpoint_upload_seconds": "Write + upload + commit time of the last checkpoint (s)",
    "checkpoint_bytes": "Size of the last committed checkpoint (bytes)",
    "last_checkpoint_step": "Step of the newest committed checkpoint",
    "memory_snapshot_blocking_seconds": "Training time blocked by the last in-memory snapshot (s)",
    "restore_seconds": "Time the last restore took, from any source (s)",
    "slowest_rank_ratio": "Largest ratio of a rank's own-work time per step to the other "
                          "ranks' median (median over the straggler window)",
    "restarts_total": "Worker-group restarts by torchrun in this agent "
                      "(TORCHELASTIC_RESTART_COUNT)",
}
STEP_GAUGES = {f.name: f.metadata["help"] for f in fields(StepMetrics)}
# Checked at import, so a clash fails every test rather than overwriting a series or a key.
assert not STEP_GAUGES.keys() & EVENT_GAUGES.keys(), "a gauge is declared twice"
_JSONL_KEYS = [f.metadata["jsonl"] or f.name for f in fields(StepMetrics)]
assert len(set(_JSONL_KEYS)) == len(_JSONL_KEYS) and not {"kind", "time"} & set(_JSONL_KEYS)
GAUGES = {**STEP_GAUGES, **EVENT_GAUGES}

# Counters (exposed with a _total suffix): name -> (help, extra labels beyond job and rank).
COUNTERS = {
    "spikes": ("Loss/gradient-norm anomalies by the stability guard's verdict", ("verdict",)),
    "rollbacks": ("Rollbacks to an earlier checkpoint by the stability guard", ()),
    "skipped_steps": ("Optimizer updates the stability guard did not apply", ()),
    "skipped_saves": ("Checkpoints not started because the previous save was still uploading "
                      "(storage slow or unreachable)", ()),
    "stragglers": ("Ranks reported as stragglers (each time one turned slow)", ()),
}
# Label values known in advance (the guard's verdicts other than ok, trainer/guard.py): their
# series exist at 0 from the start, so the first verdict is an increase Prometheus can see.
KNOWN_LABELS = {"spikes": {"verdict": ("skip", "transient", "rollback", "abort")}}


def measure_matmul_peak_flops(device, trials: int = 5, n: int = 1024) -> float:
    """Best achieved FLOP/s of a square fp32 matmul over a few trials: the CPU stand-in for a
    datasheet peak (best-of, so a busy neighbour process does not lower the bar)."""
    import torch

    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm-up: thread pool and kernels
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def device_peak_flops(device) -> tuple[float, str]:
    """(peak FLOP/s per device, where the figure comes from)."""
    import torch

    if device.type == "cuda":
        acc = hardware.from_device_name(torch.cuda.get_device_name(device))
        if acc is not None:
            return acc.peak_bf16_flops, f"{acc.name} datasheet bf16 dense peak"
    return measure_matmul_peak_flops(device), f"measured {device.type} fp32 matmul"


class Metrics:
    """Rank 0 exports and writes; other ranks hold a Metrics object that does nothing."""

    def __init__(self, job: str, rank: int, *, enabled: bool, port: int | None,
                 jsonl_path: Path | None):
        self.enabled = enabled
        self.registry = CollectorRegistry()
        self.labels = {"job": job, "rank": str(rank)}
        self.gauges = {name: Gauge(f"crucible_{name}", doc, ["job", "rank"], registry=self.registry)
                       for name, doc in GAUGES.items()}
        self.counters = {name: Counter(f"crucible_{name}", doc, ["job", "rank", *labels],
                                       registry=self.registry)
                         for name, (doc, labels) in COUNTERS.items()}
        # Counters exist from the start, at 0 (without extra labels, or with KNOWN_LABELS):
        # Prometheus' instrumentation guide asks for series known in advance, so dashboards and
        # alerts see 0 rather than nothing, and `increase` counts the first event.
        if enabled:
            for name, (_, labels) in COUNTERS.items():
                known = KNOWN_LABELS.get(name, {})
                if set(labels) == set(known):
                    for values in itertools.product(*(known[label] for label in labels)):
                        self.counters[name].labels(**self.labels, **dict(zip(labels, values)))
        self.server = None
        self.port = None
        if enabled and port is not None:
            self.server, _ = start_http_server(port, addr="0.0.0.0", registry=self.registry)
            self.port = self.server.server_address[1]
        self._jsonl = None
        if enabled and jsonl_path is not None:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(jsonl_path, "a", buffering=1)  # line-buffered: survives a kill

    def count(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if self.enabled:
            self.counters[name].labels(**self.labels, **labels).inc(amount)

    def set(self, **values: float) -> None:
        """Set gauges by name; None (not known yet) and NaN leave a series at its last value, so
        a non-finite loss the guard skipped does not blank the dashboard's panels."""
        if not self.enabled:
            return
        for name, value in values.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self.gauges[name].labels(**self.labels).set(value)

    def log_step(self, step: StepMetrics) -> None:
        """Export one step's gauges and write its JSONL "train" record."""
        self.set(**asdict(step))
        self.write({"kind": "train", **step.jsonl()})

    def write(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
