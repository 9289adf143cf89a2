"""`crucible plan`: flags in, a plan out (table, --json, or a PretrainJob with --emit-job).

Thin adapter: parses quantities, calls `planner.make_plan`, prints. Errors become
`cli.UserError` (one line and a hint, no traceback).
"""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import replace
from pathlib import Path

import yaml

from crucible.api.arch import PRESETS, preset
from crucible.api.names import job_name_problem
from crucible.trainer.hardware import ACCELERATORS
from crucible.trainer.plan import configs
from crucible.trainer.plan import cost as costs
from crucible.trainer.plan import emit_job, planner, scaling
from crucible.trainer.plan.precision import PRECISIONS
from crucible.trainer.plan.quantities import QuantityError, parse_fraction, parse_quantity
from crucible.trainer.plan.report import render, to_json

EPILOG = f"""\
Numbers accept 1.3e9, 1.3B, 20T, 6e23 (suffixes k M B T P).
Give any two of --params/--model, --tokens, --compute/--gpu-hours; with one, the other two follow
from the compute-optimal split.

Why not the Chinchilla paper's printed constants? {scaling.ROUNDING_NOTE}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--params", help="parameters N (e.g. 1.3B)")
    parser.add_argument("--tokens", help="training tokens D (e.g. 26B)")
    parser.add_argument("--compute", help="training compute C in FLOPs (e.g. 6e23)")
    parser.add_argument("--gpu-hours", help="compute budget as GPU-hours (× --gpu peak × --mfu)")
    parser.add_argument("--model", help=f"model preset ({', '.join(sorted(PRESETS))}) or a "
                        "PretrainJob / job config / torchtitan / nanoGPT file to take the shape "
                        "from")
    parser.add_argument("--gpu", default="h100",
                        help=f"accelerator: {', '.join(sorted(ACCELERATORS))}")
    parser.add_argument("--gpus", default="8", help="number of GPUs (default 8)")
    parser.add_argument("--mfu", default=str(costs.DEFAULT_MFU),
                        help="expected model FLOPs utilisation, 0.4 or 40%% (default 0.4)")
    parser.add_argument("--seq-len", help="sequence length (default: the preset's, else 2048)")
    parser.add_argument("--micro-batch", default="4", help="sequences per GPU per micro-step")
    parser.add_argument("--batch-tokens", help="global batch in tokens (default: GPT-3 Table 2.1)")
    parser.add_argument("--mtbf-hours", help="job mean time between failures in hours "
                        "(default: Llama 3's rate, 50,700 GPU-hours per failure / GPUs)")
    parser.add_argument("--save-seconds", help="measured blocking checkpoint save time")
    parser.add_argument("--restart-seconds",
                        help="time from failure to training again (default 300)")
    parser.add_argument("--price", help="USD per GPU-hour (default: the table's assumption)")
    parser.add_argument("--inference-tokens", help="tokens to be served over the model's life "
                        "(inference-aware sizing, Sardana et al. 2024)")
    parser.add_argument("--precision", default=None, choices=sorted(PRECISIONS),
                        help="what the states are kept in: bf16 (mixed, with an fp32 master: "
                        "16 bytes a parameter; Crucible's default), bf16-sr (bf16 weights "
                        "rounded stochastically, fp32 AdamW moments, no master: 12 bytes; "
                        "training.optimizer.bf16StochasticRounding), bf16-pure (everything "
                        "bf16, torchtitan's training.dtype = bfloat16: 8 bytes) or fp32 (16 "
                        "bytes). Default: what a --model file asks for, else bf16")
    parser.add_argument("--eager", action="store_true", help="count activations as eager "
                        "PyTorch keeps them (training.compile: false); by default as compiled "
                        "blocks and loss do, the default on GPUs")
    parser.add_argument("--json", action="store_true", help="all figures as JSON (SI units)")
    parser.add_argument("--emit-job", action="store_true", help="print a PretrainJob manifest")
    parser.add_argument("--name", default=None, help="job name for --emit-job (default: the "
                        "preset's name, else 'plan')")
    parser.add_argument("--image", default="registry.example/crucible-trainer:0.1")
    parser.add_argument("--data", default="s3://change-me/tokens/train", help="training shards")
    parser.add_argument("--val", default="s3://change-me/tokens/val", help="held-out shards")
    parser.add_argument("--tokenizer", default="s3://change-me/tokenizer.json",
                        help="tokenizer.json the shards were encoded with")
    parser.add_argument("--checkpoint-uri", default=None, help="default s3://change-me/runs/<name>")


def _num(args, name: str, **kw):
    value = getattr(args, name)
    if value is None:
        return None
    return parse_quantity(value, name="--" + name.replace("_", "-"), **kw)


def _int(args, name: str) -> int | None:
    value = _num(args, name)
    if value is None:
        return None
    if value != int(value):
        raise QuantityError(f"--{name.replace('_', '-')} must be a whole number, got {value:g}")
    return int(value)


def inputs_from_args(args) -> planner.PlanInputs:
    from crucible.trainer.cli import UserError

    try:
        cfg, preset_name, precision = None, None, args.precision
        seq = _int(args, "seq_len")
        if args.model in PRESETS:
            preset_name = args.model
            cfg = preset(args.model, **({"seq_len": seq} if seq else {}))
        elif args.model:
            if not Path(args.model).is_file():
                raise ValueError(f"--model {args.model!r} is neither a preset "
                                 f"({', '.join(sorted(PRESETS))}) nor a config file")
            setup = configs.load(args.model)
            cfg = setup.model
            if cfg is None:
                raise ValueError(f"{args.model} does not pin down a model shape")
            # A job that rounds stochastically (or a config that keeps everything in bf16)
            # is planned with the states it keeps, unless --precision says otherwise.
            if precision is None and setup.precision in PRECISIONS:
                precision = setup.precision
            cfg = replace(cfg, seq_len=seq) if seq else cfg
        return planner.PlanInputs(
            params=_num(args, "params"), tokens=_num(args, "tokens"),
            compute_flops=_num(args, "compute"), gpu_hours=_num(args, "gpu_hours"),
            model=cfg, preset=preset_name, gpu=args.gpu, gpus=_int(args, "gpus"),
            mfu=parse_fraction(args.mfu, name="--mfu"),
            seq_len=cfg.seq_len if cfg else (_int(args, "seq_len") or 2048),
            micro_batch=_int(args, "micro_batch"), global_batch_tokens=_num(args, "batch_tokens"),
            mtbf_hours=_num(args, "mtbf_hours"), save_seconds=_num(args, "save_seconds"),
            restart_seconds=_num(args, "restart_seconds", allow_zero=True),
            price_usd_per_gpu_hour=_num(args, "price", allow_zero=True),
            inference_tokens=_num(args, "inference_tokens", allow_zero=True) or 0.0,
            precision=precision or "bf16", compiled=not args.eager)
    except (QuantityError, ValueError) as err:  # ConfigReadError is a ValueError
        raise UserError(str(err), "see `crucible plan --help`") from None


DEFAULTS_DOC = ("Why the defaults are what they are (token budget, vocabulary, sharding, "
                "checkpoint interval, spike and restart policy): docs/defaults.md")


def run(args) -> int:
    from crucible.trainer.cli import UserError

    inp = inputs_from_args(args)
    if args.emit_job:
        # Checked before planning so a bad name fails fast, in the CRD's words, on one line.
        problem = job_name_problem(_job_name(args, inp))
        if problem:
            raise UserError(problem, "pick another --name")
    try:
        plan = planner.make_plan(inp)
    except ValueError as err:
        hint = ("known GPUs: " + ", ".join(sorted(ACCELERATORS))) if "GPU" in str(err) else \
            "see `crucible plan --help`"
        raise UserError(str(err), hint) from None
    if args.emit_job:
        for note in job_notes(plan):
            print("\n".join(textwrap.wrap(note, 96, initial_indent="# ",
                                           subsequent_indent="# ")))
        print(yaml.safe_dump(emit(plan, inp, args), sort_keys=False), end="")
        return 0
    if args.json:
        extra = {"recommendation": plan.recommendation.best.layout.describe()
                 if plan.recommendation.best else None,
                 "job_layout": plan.job.cost.layout.describe() if plan.job else None}
        print(to_json(plan.sections, extra))
        return 0
    print(render(plan.sections), end="")
    print(DEFAULTS_DOC)
    return 0


def _job_name(args, inp: planner.PlanInputs) -> str:
    """--name as given (an empty one is refused, not replaced), else one made from the preset
    that passes the job-name rule: `1.3b` becomes `gpt-1-3b`."""
    if args.name is not None:
        return args.name
    base = (inp.preset or "plan").replace(".", "-").lower()
    return base if job_name_problem(base) is None else f"gpt-{base}"


def job_notes(plan: planner.Plan) -> list[str]:
    """What the emitted job runs and where it departs from the recommendation, as comment
    lines above the manifest."""
    best, job = plan.recommendation.best, plan.job
    if job is not None:
        lay = job.cost.layout
        head = (f"Layout: {lay.describe()}" + (f", {job.schedule} schedule" if lay.pp > 1 else "")
                + f", {job.cost.microbatches} micro-batches a step per data-parallel rank, "
                f"{job.cost.memory.total_bytes / 2**30:.1f} GiB per GPU (estimated).")
        return [head, *job.notes]
    if best is not None and best.layout.tp * best.layout.pp > 1:
        return [f"The recommended {best.layout.describe()} has no runnable counterpart on "
                "Crucible's trainer that fits; the job runs FSDP over every GPU."]
    return []


def emit(plan: planner.Plan, inp: planner.PlanInputs, args) -> dict:
    from crucible.trainer.cli import UserError

    name = _job_name(args, inp)
    fsdp, job = plan.fsdp, plan.job
    # The recommended tensor/pipeline layout as the trainer runs it (planner `job`), else FSDP
    # over every GPU.
    layout = job.cost.layout if job is not None else (fsdp.layout if fsdp else None)
    parallel = ({"tensor": job.cost.layout.tp, "pipeline": job.cost.layout.pp,
                 "schedule": job.schedule, "virtual_stages": job.virtual_stages}
                if job is not None else {})
    try:
        return emit_job.pretrain_job(
            name=name, image=args.image, cfg=job.model if job is not None else plan.model,
            preset=inp.preset, params=plan.params,
            tokens=plan.tokens, gpus=inp.gpus, gpus_per_node=plan.gpu.gpus_per_node,
            gpu_resource=plan.gpu.resource,
            micro_batch=inp.micro_batch, checkpoint_minutes=plan.checkpoint.daly_s / 60,
            activation_checkpointing=bool(layout and layout.recompute == "full"), **parallel,
            sharding=plan.sharding,
            global_batch_tokens=inp.global_batch_tokens, data_train=args.data, data_val=args.val,
            tokenizer=args.tokenizer,
            checkpoint_uri=args.checkpoint_uri or f"s3://change-me/runs/{name}",
            precision=planner.crucible_precision(PRECISIONS[inp.precision]).name)
    except ValueError as err:
        raise UserError(str(err), "pick another --name or fix the flags above") from None
