"""`crucible simulate`: goodput of a job at scale under failures, by discrete-event simulation.

Thin adapter over `crucible.trainer.plan.simulate`: flags (or Llama 3's published scale and
failure mix with --llama3) in; a table of where the wall time goes, --json, and --plot (goodput
against the checkpoint interval) out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from crucible.trainer.plan import reliability
from crucible.trainer.plan import simulate as sim

EPILOG = """\
Without --llama3 the failure mix is still Llama 3's (Table 5 of their paper: 419 interruptions in
54 days on 16,384 GPUs), at their per-node rate unless --node-mtbf-hours is given, and recovery
takes Crucible's measured times. --llama3 takes their scale and their (assumed) recovery times;
--recovery crucible keeps their scale and mix with Crucible's times. Any flag given wins.

Examples:
  crucible simulate --llama3
  crucible simulate --llama3 --recovery crucible --in-memory-minutes 1 --plot goodput.png
  crucible simulate --gpus 512 --checkpoint-minutes 30 --save-seconds 20 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--llama3", action="store_true",
                        help="Llama 3 405B's run: 16,384 GPUs, 8 per node, 54 days, its failure "
                        "rate and mix, its recovery times (assumed where unpublished)")
    parser.add_argument("--recovery", choices=sorted(sim.RECOVERY),
                        help="whose detection, restart, save and restore times (default: llama3 "
                        "with --llama3, else crucible)")
    parser.add_argument("--gpus", type=int, help="GPUs in the job (default 64)")
    parser.add_argument("--gpus-per-node", type=int, help="default 8")
    parser.add_argument("--node-mtbf-hours", type=float,
                        help="mean time between failures of one node (default: Llama 3's rate, "
                        f"{reliability.LLAMA3_GPU_HOURS_PER_FAILURE:,.0f} GPU-hours per failure)")
    parser.add_argument("--days", type=float, help="wall time simulated (default 30)")
    parser.add_argument("--checkpoint-minutes", type=float,
                        help="compute between persistent (S3) saves (default: Daly's optimum)")
    parser.add_argument("--save-seconds", type=float, help="blocking part of a persistent save")
    parser.add_argument("--restart-seconds", type=float,
                        help="from detection to processes ready to restore")
    parser.add_argument("--restore-seconds", type=float, help="restore from S3")
    parser.add_argument("--in-memory-minutes", type=float,
                        help="compute between in-memory snapshots replicated to a peer (off "
                        "unless given); the S3-only run is shown beside it")
    parser.add_argument("--in-memory-save-seconds", type=float, default=None,
                        help="blocking part of an in-memory snapshot")
    parser.add_argument("--memory-restore-seconds", type=float, default=None,
                        help="restore from the rank's own host memory")
    parser.add_argument("--peer-restore-seconds", type=float, default=None,
                        help="restore of a replaced node's shards from its peer")
    parser.add_argument("--spares", type=int, help="idle nodes ready to replace a lost one "
                        "(default 0; 64 with --llama3)")
    parser.add_argument("--repair-hours", type=float,
                        help="until a lost node is back in the spare pool (default 24; 72 with "
                        "--llama3)")
    parser.add_argument("--calibration", metavar="JSON",
                        help="save and restore times measured by bench/restore_bench.py (its "
                        "--out file); flags given still win")
    parser.add_argument("--seed", type=int, default=0, help="first random seed (default 0)")
    parser.add_argument("--seeds", type=int, default=5,
                        help="runs averaged, seeds seed..seed+N-1 (default 5)")
    parser.add_argument("--plot", metavar="PNG", help="also plot goodput against the checkpoint "
                        "interval (0.25x to 4x the chosen one) to this PNG")
    parser.add_argument("--json", action="store_true",
                        help="all figures as JSON (goodput as a fraction 0..1, times in seconds)")


# Crucible's in-memory tier, measured on CPU at GPT-2 124M + AdamW, 2 ranks as 2 nodes
# (bench/restore_bench.py, slowest rank, median of 3): the snapshot's blocking copy, a restore
# from the node's own memory, and from the peer's copy.
IN_MEMORY_DEFAULTS = {"in_memory_save_s": 0.32, "restore_memory_s": 1.07, "restore_peer_s": 3.28}
# bench/restore_bench.py's keys -> the scenario's (a --calibration file sets them all at once).
CALIBRATION_KEYS = {"snapshot_blocking_s": "in_memory_save_s",
                    "restore_memory_s": "restore_memory_s", "restore_peer_s": "restore_peer_s",
                    "restore_storage_s": "restore_s3_s", "save_blocking_s": "save_s"}


def calibration(path: str | None) -> dict[str, float]:
    """Scenario values from a bench/restore_bench.py result file."""
    if not path:
        return {}
    from crucible.trainer.cli import UserError

    try:
        measured = json.loads(Path(path).read_text())
        return {ours: float(measured[theirs]) for theirs, ours in CALIBRATION_KEYS.items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"--calibration {path}: not a bench/restore_bench.py result ({err})",
                        hint="run python bench/restore_bench.py --out FILE first") from None


def build_scenario(args: argparse.Namespace) -> sim.Scenario:
    """Preset values, then a calibration file's, then every flag given; the interval defaults to
    Daly's optimum."""
    times = {**sim.RECOVERY[args.recovery or ("llama3" if args.llama3 else "crucible")]}
    measured = calibration(args.calibration)
    times.update({k: v for k, v in measured.items() if k in times})
    gpus = _given(args.gpus, sim.LLAMA3_GPUS if args.llama3 else 64)
    per_node = _given(args.gpus_per_node, sim.LLAMA3_GPUS_PER_NODE)
    if gpus < 1 or per_node < 1:
        raise ValueError(f"gpus ({gpus}) and gpus per node ({per_node}) must be >= 1")
    node_mtbf_h = _given(args.node_mtbf_hours, reliability.LLAMA3_GPU_HOURS_PER_FAILURE / per_node)
    save_s = _given(args.save_seconds, times["save_s"])
    mtbf_s = node_mtbf_h * sim.HOUR / -(-gpus // per_node)
    checkpoint_s = (args.checkpoint_minutes * 60 if args.checkpoint_minutes is not None
                    else reliability.daly_interval_s(max(save_s, 1e-3), mtbf_s))
    memory = {name: _given(getattr(args, flag), measured.get(name, IN_MEMORY_DEFAULTS[name]))
              for name, flag in
              (("in_memory_save_s", "in_memory_save_seconds"),
               ("restore_memory_s", "memory_restore_seconds"),
               ("restore_peer_s", "peer_restore_seconds"))}
    return sim.Scenario(
        gpus=gpus, gpus_per_node=per_node, node_mtbf_h=node_mtbf_h,
        days=_given(args.days, sim.LLAMA3_DAYS if args.llama3 else 30.0),
        checkpoint_s=checkpoint_s, save_s=save_s,
        restart_s=_given(args.restart_seconds, times["restart_s"]),
        restore_s3_s=_given(args.restore_seconds, times["restore_s3_s"]),
        kinds=sim.failure_mix(times["crash_detect_s"], times["node_detect_s"],
                              times["hang_detect_s"]),
        in_memory_s=None if args.in_memory_minutes is None else args.in_memory_minutes * 60,
        spares=_given(args.spares, sim.LLAMA3_SPARES if args.llama3 else 0),
        repair_h=_given(args.repair_hours, sim.LLAMA3_REPAIR_H if args.llama3 else 24.0),
        **memory)


def _given(value, default):
    return default if value is None else value


def summarise(scenario: sim.Scenario, seeds: int, first_seed: int) -> dict:
    """Mean figures over `seeds` runs: goodput (and its spread), seconds by bucket, counts."""
    runs = [sim.simulate(scenario, first_seed + i) for i in range(seeds)]
    mean, spread = sim.mean_and_spread([r.goodput for r in runs])
    return {
        "goodput": mean, "goodput_sd": spread,
        "wall_s": sum(r.wall_s for r in runs) / seeds,
        "seconds": {b: sum(r.seconds[b] for r in runs) / seeds for b in sim.BUCKETS},
        "failures": {k.name: sum(r.failures.get(k.name, 0) for r in runs) / seeds
                     for k in scenario.kinds},
        "restores": {src: sum(r.restores[src] for r in runs) / seeds for src in sim.SOURCES},
    }


def plot(scenario: sim.Scenario, seeds: int, first_seed: int, png: Path) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = scenario.checkpoint_s
    intervals = [chosen * 2 ** (e / 3) for e in range(-6, 7)]
    curves = {"S3 only": replace(scenario, in_memory_s=None)}
    if scenario.in_memory_s is not None:
        curves[f"in-memory every {scenario.in_memory_s / 60:g} min"] = scenario
    rows = []
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for label, base in curves.items():
        points = []
        for n, tau in enumerate(intervals, 1):
            print(f"  plot: {label}, interval {n}/{len(intervals)}", file=sys.stderr, end="\r")
            points.append(sim.mean_goodput(replace(base, checkpoint_s=tau), seeds, first_seed)[0])
        rows += [{"curve": label, "checkpoint_s": t, "goodput": g} for t, g in zip(intervals, points)]
        ax.plot([t / 60 for t in intervals], [100 * g for g in points], marker="o", label=label)
    print(file=sys.stderr)
    daly = [100 * sim.daly_goodput(replace(scenario, checkpoint_s=t)) for t in intervals]
    ax.plot([t / 60 for t in intervals], daly, ls="--", color="grey",
            label="Daly 2006 closed form (S3 only, one failure kind)")
    ax.axvline(chosen / 60, color="black", lw=0.8, alpha=0.6)
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks([round(t / 60, 1) for t in intervals[::2]])
    ax.set_xlabel("compute between persistent checkpoints (minutes, log scale)")
    ax.set_ylabel("goodput (%)")
    ax.set_title(f"{scenario.gpus:,} GPUs, job MTBF {scenario.job_mtbf_s / 3600:.2f} h, "
                 f"{scenario.days:g} days, {seeds} seeds per point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return rows


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h"


def render(scenario: sim.Scenario, results: dict[str, dict]) -> str:
    labels = list(results)
    lines = [f"{scenario.gpus:,} GPUs on {scenario.nodes:,} nodes, node MTBF "
             f"{scenario.node_mtbf_h:,.0f} h -> a job interruption every "
             f"{scenario.job_mtbf_s / 3600:.2f} h; {scenario.days:g} days simulated",
             f"persistent checkpoint every {scenario.checkpoint_s / 60:.1f} min of compute "
             f"(Young {reliability.young_interval_s(max(scenario.save_s, 1e-3), scenario.job_mtbf_s) / 60:.1f}, "
             f"Daly {reliability.daly_interval_s(max(scenario.save_s, 1e-3), scenario.job_mtbf_s) / 60:.1f}), "
             f"{scenario.save_s:g} s blocking; restart {scenario.restart_s:g} s, "
             f"S3 restore {scenario.restore_s3_s:g} s",
             ""]
    width = max(22, *(len(label) + 2 for label in labels))
    first = 2 + max(len(f"failures: {k.name}") for k in scenario.kinds)
    lines.append(f"{'':<{first}}" + "".join(f"{label:>{width}}" for label in labels))

    def row(name: str, cell) -> None:
        lines.append(f"{name:<{first}}" + "".join(f"{cell(results[label]):>{width}}"
                                                  for label in labels))

    row("goodput", lambda r: f"{100 * r['goodput']:.2f}% ± {100 * r['goodput_sd']:.2f}")
    for bucket in sim.BUCKETS:
        row(f"  {bucket}", lambda r, b=bucket: f"{_hours(r['seconds'][b])} "
            f"({100 * r['seconds'][b] / r['wall_s']:.2f}%)")
    for kind in scenario.kinds:
        row(f"failures: {kind.name}", lambda r, k=kind.name: f"{r['failures'][k]:.1f}")
    for src in sim.SOURCES:
        row(f"restores from {src}", lambda r, s=src: f"{r['restores'][s]:.1f}")
    lines.append("")
    lines.append(f"Daly 2006 closed form, S3 only, the mix folded into one kind: "
                 f"{100 * sim.daly_goodput(scenario):.2f}%")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.cli import UserError

    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    try:
        scenario = build_scenario(args)
    except ValueError as err:
        raise UserError(str(err), hint="every time and count must be a finite number >= 0, "
                        "and --gpus, --gpus-per-node, --days, intervals and MTBF > 0") from None
    variants = {"S3 only": replace(scenario, in_memory_s=None)}
    if scenario.in_memory_s is not None:
        variants[f"in-memory {scenario.in_memory_s / 60:g} min"] = scenario
    results = {label: summarise(s, args.seeds, args.seed) for label, s in variants.items()}
    sweep = plot(scenario, args.seeds, args.seed, Path(args.plot)) if args.plot else None
    if args.json:
        main = results[list(results)[-1]]
        print(json.dumps({"scenario": {**asdict(scenario), "nodes": scenario.nodes,
                                       "job_mtbf_s": scenario.job_mtbf_s},
                          "goodput": main["goodput"], "results": results,
                          "daly_goodput": sim.daly_goodput(scenario),
                          **({"sweep": sweep} if sweep else {})}, indent=1))
        return 0
    print(render(scenario, results))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
