"""The training loop: from a validated job config to a trained, evaluated model.

Reads like torchtitan's `train.py` in outline: derive the run plan (printed at start, as nanoGPT
prints tokens per iteration), build the sharded model, optimizer and data sampler, then step:
LR from the pure schedule, gradient accumulation (FSDP gradient sync only on the last
micro-step), clip, update, log. Everything a restart needs is a `Stateful` object here (model,
optimizer, LR scale, sampler, `TrainState`); checkpointing plugs in through those.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from crucible.trainer import arch, optim, parallel
from crucible.trainer.lease import progress_lease
from crucible.trainer.data import ShardSet, Sampler
from crucible.trainer.evaluate import EvalResult, evaluate
from crucible.trainer.jobspec import TrainJobConfig
from crucible.trainer.metrics import Metrics, device_peak_flops


class PlanError(ValueError):
    """The batch arithmetic does not work out for this world size."""


@dataclass(frozen=True)
class RunPlan:
    """Quantities derived from the config and the world size, logged at start."""

    world_size: int
    seq_len: int
    micro_batch: int
    accum_steps: int
    global_batch_seqs: int
    tokens_per_step: int
    total_steps: int
    flops_per_token: float
    params: int


def plan_run(cfg: TrainJobConfig, world_size: int) -> RunPlan:
    model_cfg = cfg.model.to_arch()
    t = cfg.training
    T = model_cfg.seq_len
    if t.global_batch_tokens % T:
        raise PlanError(f"training.globalBatchTokens ({t.global_batch_tokens}) must be a multiple "
                        f"of model.seqLen ({T})")
    seqs = t.global_batch_tokens // T
    per_step = t.micro_batch * world_size
    if seqs % per_step:
        raise PlanError(f"training.globalBatchTokens is {seqs} sequences, which {world_size} "
                        f"ranks x microBatch {t.micro_batch} do not divide; choose a global batch "
                        f"that is a multiple of {per_step * T} tokens, or another microBatch")
    return RunPlan(world_size=world_size, seq_len=T, micro_batch=t.micro_batch,
                   accum_steps=seqs // per_step, global_batch_seqs=seqs,
                   tokens_per_step=t.global_batch_tokens,
                   total_steps=max(1, math.ceil(t.tokens / t.global_batch_tokens)),
                   flops_per_token=arch.flops_per_token(model_cfg), params=arch.param_count(model_cfg))


@dataclass
class TrainState:
    """The loop's own counters (torchtitan's `train_state`)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass
class RunSummary:
    steps: int
    tokens: int
    final_train_loss: float
    eval: EvalResult | None
    tokens_per_second: float
    mfu: float
    elapsed_s: float
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("losses")
        return d


def _format_line(step: int, total: int, loss: float, lr: float, grad: float, tps: float,
                 mfu: float, step_s: float) -> str:
    return (f"step {step:>6}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad {grad:.3f} | "
            f"{tps / 1e3:8.1f}k tok/s | mfu {100 * mfu:5.2f}% | {1e3 * step_s:7.1f} ms")


def train(cfg: TrainJobConfig, *, progress: bool = False, max_steps: int | None = None,
          log=print) -> RunSummary:
    """Train until the planned number of steps, or `max_steps` more steps if given (the LR
    schedule still follows the full plan, so a run cut short and resumed is the same run)."""
    env = parallel.init_distributed()
    try:
        return _train(cfg, env, progress=progress, max_steps=max_steps,
                      log=log if env.is_main else (lambda *_: None))
    finally:
        parallel.shutdown()


def _train(cfg: TrainJobConfig, env: parallel.DistEnv, *, progress: bool, max_steps: int | None,
           log) -> RunSummary:
    t = cfg.training
    model_cfg = cfg.model.to_arch()
    plan = plan_run(cfg, env.world_size)
    train_shards = ShardSet(cfg.data.train)
    train_shards.check_compatible(model_cfg.vocab_size, _tokenizer_hash(cfg))
    val_shards = ShardSet(cfg.data.val) if cfg.data.val else None
    if val_shards is not None:
        val_shards.check_compatible(model_cfg.vocab_size, train_shards.tokenizer_hash)
    out = Path(cfg.output_dir)
    log(f"run {cfg.name}: {plan.params / 1e6:.2f}M params, {env.world_size} rank(s) on "
        f"{env.device.type}, {plan.tokens_per_step} tokens/step = {plan.world_size} ranks x "
        f"{plan.micro_batch} seqs x {plan.seq_len} tokens x {plan.accum_steps} accumulation, "
        f"{plan.total_steps} steps, {plan.flops_per_token / 1e6:.1f} MFLOP/token")

    torch.manual_seed(t.seed)
    mesh = parallel.build_mesh(env)
    model = parallel.build_sharded_model(model_cfg, env, mesh, precision=t.precision, seed=t.seed,
                                         activation_checkpointing=t.activation_checkpointing,
                                         compile_blocks=t.compile)
    optimizer = optim.build_optimizer(model, t, env.device)
    lr_scale = optim.LRScale()
    sampler = Sampler(train_shards, plan.seq_len, t.seed)
    state = TrainState()

    metrics = Metrics(cfg.name, env.rank, enabled=env.is_main, port=cfg.metrics.port,
                      jsonl_path=Path(cfg.metrics.jsonl) if cfg.metrics.jsonl else out / "metrics.jsonl")
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "exporter.json").write_text(json.dumps({"port": metrics.port, "pid": os.getpid()}))
        if metrics.port:
            log(f"metrics: http://127.0.0.1:{metrics.port}/metrics")
    lease = progress_lease(cfg.name) if env.is_main else None  # None outside Kubernetes
    peak_flops, peak_source = device_peak_flops(env.device)
    log(f"MFU peak: {peak_flops / 1e12:.2f} TFLOP/s per device ({peak_source})")

    def run_eval() -> EvalResult | None:
        if val_shards is None:
            return None
        result = evaluate(model, val_shards, seq_len=plan.seq_len, micro_batch=t.micro_batch,
                          tokens=t.eval_tokens, rank=env.rank, world_size=env.world_size,
                          device=env.device)
        metrics.set(eval_loss=result.loss, eval_bits_per_byte=result.bits_per_byte)
        metrics.write({"kind": "eval", "step": state.step, "loss": result.loss,
                       "bits_per_byte": result.bits_per_byte, "tokens": result.tokens})
        log(f"eval at step {state.step}: loss {result.loss:.4f}, {result.bits_per_byte:.4f} bits/byte")
        return result

    bar = None
    if progress and env.is_main:
        from tqdm import tqdm

        bar = tqdm(total=plan.total_steps, initial=state.step, unit="step", dynamic_ncols=True)
    losses: list[float] = []
    started = time.perf_counter()
    tokens_at_start = state.tokens_seen
    last_eval: EvalResult | None = None
    stop_at = plan.total_steps if max_steps is None else min(plan.total_steps, state.step + max_steps)
    try:
        while state.step < stop_at:
            step_started = time.perf_counter()
            lr = optim.lr_at(state.step, t, plan.total_steps) * lr_scale.value
            optim.set_lr(optimizer, lr)
            loss_sum = torch.zeros((), device=env.device)
            for micro in range(plan.accum_steps):
                x, y = sampler.batch(state.step, micro, global_batch=plan.global_batch_seqs,
                                     micro_batch=plan.micro_batch, rank=env.rank,
                                     world_size=env.world_size)
                inputs = torch.from_numpy(x).to(env.device, non_blocking=True)  # (B, T)
                targets = torch.from_numpy(y).to(env.device, non_blocking=True)  # (B, T)
                # Reduce-scatter gradients only once per step, after the last micro-batch.
                model.set_requires_gradient_sync(micro == plan.accum_steps - 1)
                loss = model(inputs, targets)
                (loss / plan.accum_steps).backward()
                loss_sum += loss.detach()
            grad_norm = optim.clip_grad_norm(model, t.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            (loss_mean,) = parallel.all_reduce_mean([float(loss_sum) / plan.accum_steps], env.device)
            state.step += 1
            state.tokens_seen += plan.tokens_per_step

            step_s = time.perf_counter() - step_started
            tps = plan.tokens_per_step / step_s
            mfu = tps / env.world_size * plan.flops_per_token / peak_flops
            losses.append(loss_mean)
            metrics.set(train_loss=loss_mean, grad_norm=grad_norm, learning_rate=lr,
                        tokens_per_second=tps, mfu=mfu, step=state.step,
                        tokens_total=state.tokens_seen, step_seconds=step_s)
            metrics.write({"kind": "train", "step": state.step, "tokens": state.tokens_seen,
                           "loss": loss_mean, "grad_norm": grad_norm, "lr": lr,
                           "tokens_per_second": tps, "mfu": mfu, "step_seconds": step_s})
            if lease is not None:
                lease.update(step=state.step, tokens=state.tokens_seen, loss=loss_mean,
                             world_size=env.world_size)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_mean:.3f}", tok_s=f"{tps / 1e3:.1f}k")
            elif state.step % t.log_every == 0 or state.step == plan.total_steps:
                log(_format_line(state.step, plan.total_steps, loss_mean, lr, grad_norm, tps, mfu, step_s))
            if t.eval_every and state.step % t.eval_every == 0 and state.step < stop_at:
                last_eval = run_eval()
        last_eval = run_eval() or last_eval
    finally:
        if bar is not None:
            bar.close()
        if lease is not None:
            lease.close()
        metrics.close()
    elapsed = time.perf_counter() - started
    tps_avg = (state.tokens_seen - tokens_at_start) / max(elapsed, 1e-9)
    return RunSummary(steps=state.step, tokens=state.tokens_seen,
                      final_train_loss=losses[-1] if losses else float("nan"), eval=last_eval,
                      tokens_per_second=tps_avg,
                      mfu=tps_avg / env.world_size * plan.flops_per_token / peak_flops,
                      elapsed_s=elapsed, losses=losses)


def _tokenizer_hash(cfg: TrainJobConfig) -> str | None:
    """The hash of data.tokenizer (a tokenizer.json), to check against the shard headers."""
    if not cfg.data.tokenizer:
        return None
    from crucible.trainer.tokenizer.bpe import tokenizer_hash

    return tokenizer_hash(cfg.data.tokenizer)
