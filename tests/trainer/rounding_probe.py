"""bf16 parameters with and without stochastic rounding against fp32 master weights: the same
`tiny` run three ways, run as its own process by test_stochastic_rounding.py (one process group
of one, gloo, FSDP2 as the trainer builds it); one JSON line per variant on stdout.

    python -m tests.trainer.rounding_probe <train shards> <val shards> <steps> <peak lr>

- `fp32-master`: the trainer's default bf16 mixed precision (fp32 parameters, bf16 compute);
- `bf16-stochastic`: `training.optimizer.bf16StochasticRounding` (what the trainer builds);
- `bf16-nearest`: the same bf16 parameters and fp32 moments, each update rounded to nearest
  (plain bf16 training with no master copy: updates under half a bf16 step are lost).

Each trains with the loop's own parts (the LR schedule, clipping, the optimizer the spec builds)
on the same batches, and is scored on the held-out shards.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import torch
import torch.distributed as dist

VARIANTS = ("fp32-master", "bf16-stochastic", "bf16-nearest")
# 8 sequences of 128 (the tiny preset's seq_len) a step, one micro-batch: 200 steps of the
# three variants train in about 45 s on one core (measured; 16 sequences took twice as long and
# gave the same ordering and gaps).
BATCH_SEQS = 8


def _spec(variant: str, steps: int, lr: float):
    from crucible.api.spec import TrainingSpec

    # The spec's defaults otherwise (cosine to 10% of the peak, weight decay 0.1, β2 0.95,
    # clipping at 1.0), with a warmup a tenth of the run.
    tokens = BATCH_SEQS * 128
    return TrainingSpec(tokens=steps * tokens, globalBatchTokens=tokens, microBatch=BATCH_SEQS,
                        lr=lr, warmupSteps=steps // 10,
                        optimizer={"bf16StochasticRounding": variant != "fp32-master"})


def train(variant: str, train_dir: str, val_dir: str, steps: int, lr: float) -> dict:
    from crucible.api import arch
    from crucible.trainer import optim, parallel
    from crucible.trainer.data import Sampler, ShardSet
    from crucible.trainer.evaluate import evaluate
    from crucible.trainer.stochastic_rounding import StochasticRoundingAdamW, store_params_in_bf16

    spec = _spec(variant, steps, lr)
    shards = ShardSet(train_dir)
    cfg = arch.preset("tiny", vocab_size=shards.vocab_size)
    env = parallel.DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    mesh = parallel.build_mesh(env)
    model = parallel.build_sharded_model(cfg, env, mesh, precision="bf16", seed=spec.seed)
    if variant != "fp32-master":
        store_params_in_bf16(model)
    if variant == "bf16-nearest":
        optimizer = StochasticRoundingAdamW(optim.param_groups(model, spec.weight_decay),
                                            seed=spec.seed, rounding="nearest", lr=spec.lr,
                                            betas=(spec.beta1, spec.beta2), eps=spec.eps)
    else:
        optimizer = optim.build_optimizer(model, spec)
    sampler = Sampler(shards, cfg.seq_len, spec.seed)
    started = time.perf_counter()
    losses = []
    for step in range(steps):
        optim.set_lr(optimizer, optim.lr_at(step, spec, steps))
        inputs, targets = sampler.batch(step, 0, global_batch=BATCH_SEQS,
                                        micro_batch=BATCH_SEQS, rank=0, world_size=1)
        loss = model(torch.from_numpy(inputs), torch.from_numpy(targets))
        loss.backward()
        optim.clip_grad_norm(model, spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - started
    held_out = evaluate(model, ShardSet(val_dir), seq_len=cfg.seq_len, micro_batch=16,
                        tokens=16384, rank=0, world_size=1, device=torch.device("cpu"))
    return {"variant": variant, "eval_loss": held_out.loss, "train_losses": losses,
            "final_lr": optim.lr_at(steps - 1, spec, steps), "seconds": seconds,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def main(train_dir: str, val_dir: str, steps: int, lr: float) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for variant in VARIANTS:
            print(json.dumps(train(variant, train_dir, val_dir, steps, lr)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
