"""`crucible review FILE`: findings for a PretrainJob, job config, torchtitan TOML or nanoGPT
config.

Thin adapter: reads with `configs.load`, judges with `review.review`, prints a table (or --json).
Exit code 1 when any finding is an error (so it can gate CI), 0 otherwise, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from crucible.trainer.hardware import ACCELERATORS, accelerator
from crucible.trainer.plan import configs
from crucible.trainer.plan import review as rv
from crucible.trainer.plan.quantities import QuantityError, parse_fraction, parse_quantity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="PretrainJob YAML, Crucible job config, torchtitan .toml "
                        "or nanoGPT .py config")
    parser.add_argument("--gpu", default="h100", help=f"accelerator the job runs on: "
                        f"{', '.join(sorted(ACCELERATORS))} (default h100)")
    parser.add_argument("--gpus", help="world size, when the file does not fix it")
    parser.add_argument("--mtbf-hours", help="job mean time between failures (default: Llama 3's "
                        "rate for the GPU count)")
    parser.add_argument("--save-seconds", help="measured blocking checkpoint save time")
    parser.add_argument("--mfu", default="0.4", help="assumed MFU for time estimates")
    parser.add_argument("--json", action="store_true", help="findings as JSON")


def run(args) -> int:
    from crucible.trainer.cli import UserError

    try:
        gpu = accelerator(args.gpu)
    except ValueError as err:
        raise UserError(str(err)) from None
    try:
        gpus = parse_quantity(args.gpus, name="--gpus") if args.gpus else None
        if gpus is not None and gpus != int(gpus):
            raise QuantityError(f"--gpus must be a whole number, got {gpus:g}")
        mtbf = (parse_quantity(args.mtbf_hours, name="--mtbf-hours") * 3600
                if args.mtbf_hours else None)
        save = (parse_quantity(args.save_seconds, name="--save-seconds")
                if args.save_seconds else None)
        mfu = parse_fraction(args.mfu, name="--mfu")
    except QuantityError as err:
        raise UserError(str(err), "see `crucible review --help`") from None
    try:
        setup = configs.load(args.config, gpus=int(gpus) if gpus else None)
    except configs.ConfigReadError as err:
        raise UserError(str(err), "fix the file, or check it is one of the supported formats") \
            from None
    findings = rv.review(setup, rv.Context(gpu, mtbf, mfu, save))
    errors = sum(f.severity == "error" for f in findings)
    if args.json:
        print(json.dumps({"config": setup.path, "format": setup.source, "errors": errors,
                          "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(render(setup, findings), end="")
    return 1 if errors else 0


def render(setup: configs.Setup, findings: list[rv.Finding]) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buffer = StringIO()
    console = Console(file=buffer, width=120, color_system=None, highlight=False)
    params = f", {setup.params / 1e6:,.0f}M params" if setup.params else ""
    tokens = f", {setup.tokens:.3g} tokens" if setup.tokens else ""
    console.print(f"review of {setup.path} ({setup.source}{params}{tokens})")
    if not findings:
        console.print("no findings")
        return buffer.getvalue()
    table = Table(show_lines=True)
    for col in ("severity", "stage", "finding", "why", "source"):
        table.add_column(col, overflow="fold")
    for f in findings:
        table.add_row(f.severity.upper(), f.stage, f.message, f.reason, f.source)
    console.print(table)
    counts = {sev: sum(f.severity == sev for f in findings) for sev in rv.SEVERITY_ORDER}
    console.print(f"{counts['error']} error(s), {counts['warning']} warning(s), "
                  f"{counts['note']} note(s)")
    return buffer.getvalue()
