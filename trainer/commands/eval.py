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


class _Weights:
    """Only the model's part of the checkpoint (`app.model.*`): evaluation needs no optimizer."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])


def run(args: argparse.Namespace) -> int:
    from crucible.api.spec import ConfigError, load_train_config
    from crucible.trainer.cli import UserError

    try:
        cfg = load_train_config(args.config)
    except ConfigError as err:
        raise UserError(str(err)) from None
    if not cfg.checkpoint.uri:
        raise UserError("the config has no checkpoint.uri: there is nothing to evaluate")
    if not cfg.data.val:
        raise UserError("the config has no data.val: there is no held-out text to score")

    from crucible.trainer import parallel
    from crucible.trainer.checkpoint import Checkpointer, CheckpointError, job_hashes
    from crucible.trainer.data import DataError, ShardSet
    from crucible.trainer.evaluate import evaluate

    env = parallel.init_distributed()
    try:
        model_cfg = cfg.model.to_arch()
        val = ShardSet(cfg.data.val)
        val.check_compatible(model_cfg.vocab_size)
        model = parallel.build_sharded_model(model_cfg, env, parallel.build_mesh(env),
                                             precision=cfg.training.precision,
                                             seed=cfg.training.seed)
        model_hash, config_hash = job_hashes(cfg)
        ckpt = Checkpointer(cfg.checkpoint, job=cfg.name, rank=env.rank,
                            world_size=env.world_size, local_rank=env.local_rank,
                            model_hash=model_hash, config_hash=config_hash)
        commit_manifest = ckpt.load(_Weights(model), max_step=args.step)
        if commit_manifest is None:
            raise UserError(f"no committed checkpoint under {cfg.checkpoint.uri}"
                            + (f" at or below step {args.step}" if args.step is not None else ""))
        result = evaluate(model, val, seq_len=model_cfg.seq_len,
                          micro_batch=cfg.training.micro_batch,
                          tokens=args.tokens or cfg.training.eval_tokens, rank=env.rank,
                          world_size=env.world_size, device=env.device)
    except (DataError, CheckpointError) as err:
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
