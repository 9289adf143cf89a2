"""`crucible diagnose RUN.jsonl|RUN.csv`: replay the stability guard over a run's history.

Reads a run's loss and gradient-norm history, from Crucible's metrics JSONL (the "train"
records) or any CSV with step, loss and grad_norm columns (e.g. exported from W&B or
TensorBoard), and prints, for each anomaly, the verdict the guard gives and why, plus a PNG
with the loss and gradient norm and every verdict marked. The replay is `guard.replay`: the
same code the training loop runs, so an online run's own verdicts come out again.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

COLORS = {"skip": "tab:orange", "transient": "tab:green", "rollback": "tab:red", "abort": "black"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("history", help="metrics.jsonl written by `crucible train`, or a CSV with "
                        "step, loss, grad_norm columns")
    parser.add_argument("--config", help="job config or PretrainJob whose "
                        "faultTolerance.spikeGuard settings to use (default: the defaults)")
    parser.add_argument("--png", help="plot path (default: <history>.diagnose.png)")
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")


def read_history(path: Path) -> list[dict]:
    """Records with step, loss, grad_norm (floats; NaN/inf allowed), in the order they ran."""
    from crucible.trainer.cli import UserError

    if not path.exists():
        raise UserError(f"{path} does not exist")
    rows: list[dict] = []
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = {c.strip().lower(): c for c in reader.fieldnames or []}
            missing = {"step", "loss", "grad_norm"} - set(columns)
            if missing:
                raise UserError(f"{path} lacks column(s) {', '.join(sorted(missing))}",
                                hint="the CSV needs a header row with step, loss, grad_norm")
            for n, row in enumerate(reader, start=2):
                try:
                    rows.append({k: float(row[columns[k]]) for k in ("step", "loss", "grad_norm")})
                except (TypeError, ValueError):
                    raise UserError(f"{path}, line {n}: not a number in "
                                    "step/loss/grad_norm") from None
        return rows
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}, line {n}: not JSON") from None
        if record.get("kind") == "train":
            rows.append({k: float(record[k]) for k in ("step", "loss", "grad_norm")})
    if not rows:
        raise UserError(f"{path} has no training records (kind \"train\")")
    return rows


def _guard_spec(config: str | None):
    from crucible.api.spec import ConfigError, SpikeGuardSpec, load_train_config

    if not config:
        return SpikeGuardSpec()
    try:
        return load_train_config(config).fault_tolerance.spike_guard
    except ConfigError as err:
        from crucible.trainer.cli import UserError

        raise UserError(str(err)) from None


def plot(rows: list[dict], verdicts, png: Path) -> None:
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(1, len(rows) + 1))
    fig, (ax_loss, ax_grad) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    def finite(key: str) -> list[float]:
        return [r[key] if math.isfinite(r[key]) else float("nan") for r in rows]

    ax_loss.plot(x, finite("loss"), lw=1)
    ax_grad.plot(x, finite("grad_norm"), lw=1, color="tab:purple")
    ax_grad.set_yscale("log")
    # A verdict is drawn at the record that produced it (steps repeat after a rollback).
    position = {}
    index = 0
    for v in verdicts:
        while index < len(rows) and int(rows[index]["step"]) != v.step:
            index += 1
        position[id(v)] = index + 1 if index < len(rows) else len(rows)
    for kind, color in COLORS.items():
        marks = [position[id(v)] for v in verdicts if v.kind == kind]
        for ax in (ax_loss, ax_grad):
            for m in marks:
                ax.axvline(m, color=color, alpha=0.6, lw=1)
        if marks:
            ax_loss.plot([], [], color=color, label=f"{kind} ({len(marks)})")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_grad.set_ylabel("gradient norm")
    ax_grad.set_xlabel("executed step (a rollback repeats step numbers)")
    ax_loss.set_title("stability guard verdicts")
    if verdicts:
        ax_loss.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.guard import replay

    path = Path(args.history)
    rows = read_history(path)
    verdicts = replay(rows, _guard_spec(args.config))
    png = Path(args.png) if args.png else path.with_suffix(".diagnose.png")
    plot(rows, verdicts, png)
    if args.json:
        print(json.dumps([{"step": v.step, "verdict": v.kind, "onset": v.onset, "reason": v.reason}
                          for v in verdicts], indent=1))
        return 0
    print(f"{len(rows)} steps from {path}; {len(verdicts)} verdict(s) other than ok")
    if verdicts:
        print(f"{'step':>8}  {'verdict':<9}  {'onset':>6}  reason")
        for v in verdicts:
            onset = "" if v.onset is None else str(v.onset)
            print(f"{v.step:>8}  {v.kind:<9}  {onset:>6}  {v.reason}")
    counts = {k: sum(v.kind == k for v in verdicts) for k in COLORS}
    print("summary: " + ", ".join(f"{k} {n}" for k, n in counts.items()) + f"; plot: {png}")
    return 0
