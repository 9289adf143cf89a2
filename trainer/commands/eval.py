"""`crucible eval --config job.yaml [--step N]`: score a committed checkpoint on held-out text.

Builds the job's model exactly as training does (sharded, so it runs under torchrun on any world
size), loads only the model weights of the newest commit under `checkpoint.uri` (or the newest at
or below --step), verified like a resume, and prints the held-out loss and bits per byte.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="the job config (or PretrainJob) trained with")
    parser.add_argument("--step", type=int,
                        help="newest commit at or below this step (default: newest)")
    parser.add_argument("--tokens", type=int, help="held-out tokens to score (default: "
                        "training.evalTokens)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.cli import UserError, load_checkpointed_job

    cfg = load_checkpointed_job(args.config, "evaluate")
    if not cfg.data.val:
        raise UserError("the config has no data.val: there is no held-out text to score")

    from crucible.trainer import parallel
    from crucible.trainer.checkpoint import CheckpointError
    from crucible.trainer.data import DataError, ShardSet
    from crucible.trainer.evaluate import evaluate
    from crucible.trainer.weights import NoCommit, load_committed

    env = parallel.init_distributed()
    try:
        model_cfg = cfg.model.to_arch()
        val = ShardSet(cfg.data.val)
        val.check_compatible(model_cfg.vocab_size)
        model, commit_manifest = load_committed(cfg, env, step=args.step)
        result = evaluate(model, val, seq_len=model_cfg.seq_len,
                          micro_batch=cfg.training.micro_batch,
                          tokens=args.tokens or cfg.training.eval_tokens, rank=env.rank,
                          world_size=env.world_size, device=env.device)
    except (DataError, CheckpointError, NoCommit) as err:
        raise UserError(str(err)) from None
    finally:
        parallel.shutdown()
    if env.is_main:
        step = commit_manifest["step"]
        out = {"step": step, "checkpoint": f"{cfg.checkpoint.uri}/step_{step}",
               "loss": result.loss, "bits_per_byte": result.bits_per_byte, "tokens": result.tokens}
        if args.json:
            print(json.dumps(out))
        else:
            print(f"step {out['step']} ({out['checkpoint']}): held-out loss {result.loss:.4f} "
                  f"nats/token, {result.bits_per_byte:.4f} bits/byte over {result.tokens:,} tokens")
    return 0
