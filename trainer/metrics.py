"""Training metrics: a Prometheus exporter on rank 0, a JSONL file, and MFU.

Metric names, units and labels (every series carries `job` and `rank`):
  crucible_train_loss            mean cross-entropy of the last step, nats/token
  crucible_grad_norm             global gradient L2 norm before clipping
  crucible_update_norm           L2 norm of the last AdamW update, lr·m̂/(√v̂+ε) (0 if skipped)
  crucible_learning_rate         learning rate of the last step
  crucible_tokens_per_second     training throughput of the last log interval, all ranks
  crucible_mfu                   model FLOPs utilisation, 0..1 (PaLM App. B definition)
  crucible_step                  optimizer steps completed
  crucible_tokens_total          tokens trained on so far (a gauge: it resumes from checkpoints)
  crucible_step_seconds          wall time of the last optimizer step, seconds
  crucible_eval_loss             held-out loss of the last eval, nats/token
  crucible_eval_bits_per_byte    held-out loss in bits per UTF-8 byte of text
  crucible_checkpoint_blocking_seconds  training time blocked by the last save, seconds
  crucible_checkpoint_upload_seconds    write + upload + commit of the last save, seconds
  crucible_checkpoint_bytes             size of the last committed checkpoint, bytes
  crucible_last_checkpoint_step         step of the newest committed checkpoint
  crucible_checkpoint_age_seconds       seconds since the newest commit
  crucible_restarts_total               torchrun worker-group restarts (this agent)
  crucible_lr_scale                     the stability guard's multiplier on the LR schedule
  crucible_spikes_total{verdict}        stability-guard verdicts other than ok (counter)
  crucible_rollbacks_total              rollbacks to an earlier checkpoint (counter)
  crucible_skipped_steps_total          updates not applied (counter)

MFU's peak comes from `hardware.py` for known GPUs. On a CPU (or an unknown device) the peak is
measured once with a fp32 matmul, and the log says so: CPU MFU is against that measured peak.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from crucible.trainer import hardware

TRAIN_GAUGES = {
    "train_loss": "Mean training cross-entropy of the last step (nats/token)",
    "grad_norm": "Global gradient L2 norm before clipping",
    "update_norm": "L2 norm of the last AdamW update (0 when the guard skipped it)",
    "learning_rate": "Learning rate of the last step",
    "tokens_per_second": "Training tokens per second over the last log interval (all ranks)",
    "mfu": "Model FLOPs utilisation (0..1) against the device peak",
    "step": "Optimizer steps completed",
    "tokens_total": "Tokens trained on so far",
    "step_seconds": "Wall time of the last optimizer step (s)",
    "eval_loss": "Held-out loss of the last eval (nats/token)",
    "eval_bits_per_byte": "Held-out loss in bits per byte of UTF-8 text",
    "checkpoint_blocking_seconds": "Training time blocked by the last checkpoint save (s)",
    "checkpoint_upload_seconds": "Write + upload + commit time of the last checkpoint (s)",
    "checkpoint_bytes": "Size of the last committed checkpoint (bytes)",
    "last_checkpoint_step": "Step of the newest committed checkpoint",
    "checkpoint_age_seconds": "Seconds since the newest checkpoint was committed",
    "restarts_total": "Worker-group restarts by torchrun in this agent (TORCHELASTIC_RESTART_COUNT)",
    "lr_scale": "Multiplier the stability guard applies to the LR schedule (1 unless lowered)",
}

# Counters (exposed with a _total suffix): name -> (help, extra labels beyond job and rank).
COUNTERS = {
    "spikes": ("Loss/gradient-norm anomalies by the stability guard's verdict", ("verdict",)),
    "rollbacks": ("Rollbacks to an earlier checkpoint by the stability guard", ()),
    "skipped_steps": ("Optimizer updates the stability guard did not apply", ()),
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
                       for name, doc in TRAIN_GAUGES.items()}
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
        if not self.enabled:
            return
        for name, value in values.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self.gauges[name].labels(**self.labels).set(value)

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
