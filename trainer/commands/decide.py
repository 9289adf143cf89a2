"""`crucible decide`: pretrain, continue pretraining, or fine-tune — costs, a pick, and its flips.

Thin adapter over `strategy.recommend`; budgets may be FLOPs, GPU-hours or dollars (converted
with `cost` at the given GPU, MFU and price).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from crucible.trainer.hardware import ACCELERATORS, accelerator
from crucible.trainer.plan import cost as costs
from crucible.trainer.plan import strategy
from crucible.trainer.plan.quantities import QuantityError, human, parse_fraction, parse_quantity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task-tokens", required=True, help="in-domain tokens available (e.g. 5B)")
    parser.add_argument("--distance", required=True, choices=strategy.DISTANCES,
                        help="domain distance from open web text: near (same language and genre), "
                        "mid (specialist domain: law, medicine, code), far (new language/script)")
    parser.add_argument("--base-params", default="0", help="size of the best usable base model "
                        "(0: none)")
    parser.add_argument("--base-license", choices=["ok", "forbidden"], default="ok",
                        help="does the base model's licence allow this use?")
    parser.add_argument("--target-params", help="model size to pretrain (default: the base's)")
    parser.add_argument("--budget", help="compute budget in FLOPs (e.g. 1e22)")
    parser.add_argument("--gpu-hours", help="compute budget in GPU-hours")
    parser.add_argument("--usd", help="compute budget in dollars")
    parser.add_argument("--gpu", default="h100", help=f"{', '.join(sorted(ACCELERATORS))}")
    parser.add_argument("--mfu", default=str(costs.DEFAULT_MFU))
    parser.add_argument("--price", help="USD per GPU-hour (default: the table's assumption)")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    from crucible.trainer.cli import UserError

    try:
        gpu = accelerator(args.gpu)
        mfu = parse_fraction(args.mfu, name="--mfu")
        price = parse_quantity(args.price, name="--price") if args.price else gpu.usd_per_gpu_hour
        given = [x for x in (args.budget, args.gpu_hours, args.usd) if x]
        if len(given) > 1:
            raise QuantityError("give one of --budget, --gpu-hours, --usd")
        budget = None
        if args.budget:
            budget = parse_quantity(args.budget, name="--budget")
        elif args.gpu_hours:
            hours = parse_quantity(args.gpu_hours, name="--gpu-hours")
            budget = costs.compute_from_gpu_hours(hours, gpu, mfu)
        elif args.usd:
            usd = parse_quantity(args.usd.lstrip("$"), name="--usd")
            budget = costs.compute_from_gpu_hours(usd / price, gpu, mfu)
        task = strategy.Task(
            task_tokens=parse_quantity(args.task_tokens, name="--task-tokens"),
            distance=args.distance,
            base_params=parse_quantity(args.base_params, name="--base-params", allow_zero=True),
            base_license_ok=args.base_license == "ok",
            target_params=parse_quantity(args.target_params, name="--target-params")
            if args.target_params else None,
            budget_flops=budget)
        result = strategy.recommend(task)
    except (QuantityError, ValueError) as err:
        raise UserError(str(err), "see `crucible decide --help`") from None
    rows = []
    for c in result.options:
        money = costs.training_cost(c.compute_flops, gpu, 1, mfu, price)
        rows.append({**asdict(c), "gpu_hours": money.gpu_hours, "usd": money.usd})
    if args.json:
        print(json.dumps({"choice": result.choice, "reasons": result.reasons, "flips": result.flips,
                          "budget_flops": budget, "options": rows}, indent=2))
        return 0
    print(f"recommendation: {result.choice}")
    for reason in result.reasons:
        print(f"  because {reason}")
    print(f"\n{'option':<22} {'params':>9} {'tokens':>10} {'compute':>12} {'GPU-hours':>11} "
          f"{'cost':>12}  fits budget  formula")
    for r in rows:
        print(f"{r['option']:<22} {human(r['params'], 'count'):>9} "
              f"{human(r['tokens'], 'count'):>10} {r['compute_flops']:>12.3g} "
              f"{r['gpu_hours']:>11.3g} {human(r['usd'], 'USD'):>12}  "
              f"{'yes' if r['affordable'] else 'NO':<11}  {r['formula']}")
    print(f"  ({gpu.name} at {mfu:.0%} MFU, ${price:.2f}/GPU-hour; budget "
          f"{'none' if budget is None else f'{budget:.3g} FLOP'})")
    print("\nit flips when:")
    for flip in result.flips:
        print(f"  - {flip}")
    return 0
