"""The training loop: from a validated job config to a trained, evaluated, checkpointed model.

Reads like torchtitan's `train.py` in outline. `Run.__init__` derives the run's shape (its
batch arithmetic, printed at start as nanoGPT prints tokens per iteration), builds the sharded
model, optimizer and data sampler, proves checkpoint storage works and resumes from the newest
state there is (memory or storage: `restore.py`, which also holds the guard's rollback). One optimizer step (`_loop`, with `Run.forward_backward`, `Run.launch`,
`Run.numbers` and `Run.apply_update`): LR from the pure schedule, gradient accumulation (FSDP
reduce-scatters after every micro-batch, or only after the last: `training.gradientSync`),
clip, then one small all-reduce on the compute device carries what every rank must agree on:
the loss, the gradient norm, on logging steps the norm of the update about to be applied, rank
0's "save now" (time-based saving would otherwise diverge between ranks) and SIGTERM. The
update is applied at once, skipped or not on the device by the stability guard's limits
(`optim.skip_flag`); the numbers are read back one step later, while the device runs the next
step's forward and backward: the step's only host sync outside logging, eval and save steps,
and it does not drain the device. The guard's verdicts, the metrics, saves and stops act on
that step then (`_finish`). Micro-batches come from a one-ahead prefetch (`prefetch.py`);
garbage collection, profiler traces and memory snapshots keep a step schedule (`cadence.py`).
Each step's numbers are one `StepMetrics` record, built in `_finish`, that the exporter, the
JSONL file, the log line, the progress bar and the progress Lease all read. Everything a restart
needs is a `Stateful` part of `AppState` (model, optimizer, LR scale, sampler, `TrainState`, the
stability guard). The guard's actions (skip, rollback) stay here beside the step they act on.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from crucible.api import arch, layout
from crucible.api.batch_ramp import BatchRamp, BatchSchedule
from crucible.api.progress import Straggler
from crucible.api.spec import TrainJobConfig
from crucible.trainer import optim, parallel, pipeline, restore, tensor_parallel
from crucible.trainer.cadence import Cadence
from crucible.trainer.checkpoint import AppState, Checkpointer, Commit, job_hashes, should_save
from crucible.trainer.data import Sampler, ShardSet
from crucible.trainer.evaluate import EvalResult, evaluate
from crucible.trainer.faults import Faults, slowdown_from_env
from crucible.trainer.guard import Guard, SkipLimits, Verdict
from crucible.trainer.lease import progress_lease
from crucible.trainer.memory_checkpoint import MemoryTier
from crucible.trainer.prefetch import Prefetcher
from crucible.trainer.restore import GuardAbort, TrainState
from crucible.trainer.stochastic_rounding import store_params_in_bf16
from crucible.trainer.straggler import SegmentTimer, StragglerDetector
from crucible.trainer.metrics import Metrics, StepMetrics, device_peak_flops


NOT_ASKED = (0, float("-inf"))


class BatchError(ValueError):
    """The batch arithmetic does not work out for this world size."""


class Terminated(RuntimeError):
    """SIGTERM (a pod being deleted, a node draining): every rank stopped after the same step
    and the save in flight was finished."""


@dataclass(frozen=True)
class RunShape:
    """A run's batch arithmetic and size, derived from the config and the data-parallel size
    (the ranks that each read their own slice of the batch) and logged at start. The batch
    fields are the full batch's; with a batch ramp a step's own is `ramp`'s for the tokens
    trained on before it, and `total_steps` counts the ramp's smaller steps."""

    dp_size: int
    seq_len: int
    micro_batch: int
    accum_steps: int
    global_batch_seqs: int
    tokens_per_step: int
    total_steps: int
    flops_per_token: float
    params: int
    ramp: BatchRamp
    lr_clock: optim.LRClock | None = None   # where a step is on the LR schedule


def run_shape(cfg: TrainJobConfig, dp_size: int) -> RunShape:
    model_cfg = cfg.model.to_arch()
    t = cfg.training
    T = model_cfg.seq_len
    if t.global_batch_tokens % T:
        raise BatchError(f"training.globalBatchTokens ({t.global_batch_tokens}) must be a multiple "
                         f"of model.seqLen ({T})")
    seqs = t.global_batch_tokens // T
    per_step = t.micro_batch * dp_size
    if seqs % per_step:
        raise BatchError(f"training.globalBatchTokens is {seqs} sequences, which {dp_size} "
                         f"data-parallel ranks x microBatch {t.micro_batch} do not divide; "
                         f"choose a global batch that is a multiple of {per_step * T} tokens, or "
                         "another microBatch")
    ramp = BatchRamp.of(t.global_batch_tokens, per_step * T,
                        *((t.batch_ramp.start_tokens, t.batch_ramp.ramp_tokens)
                          if t.batch_ramp is not None else ()))
    return RunShape(dp_size=dp_size, seq_len=T, micro_batch=t.micro_batch,
                    accum_steps=seqs // per_step, global_batch_seqs=seqs,
                    tokens_per_step=t.global_batch_tokens,
                    total_steps=(total := BatchSchedule(ramp, t.tokens).total_steps),
                    flops_per_token=arch.flops_per_token(model_cfg),
                    params=arch.param_count(model_cfg), ramp=ramp, lr_clock=optim.LRClock(total))


@dataclass(frozen=True)
class InFlight:
    """A step whose numbers are summed on the device and not read yet (`Run.launch`)."""

    sums: parallel.PendingSums
    measure_update: bool


@dataclass(frozen=True)
class StepNumbers:
    """What every rank agrees on after a step's forward/backward (`Run.numbers`)."""

    loss: float          # mean over ranks and micro-batches
    grad_norm: float     # global, before clipping
    update_norm: float | None   # of the update the step would apply; None: not measured
    save: bool           # rank 0 wants a checkpoint after this step
    stop: bool           # some rank got SIGTERM
    local_seconds: list[float] = field(default_factory=list)  # each rank's own work, last step


@dataclass
class RunSummary:
    steps: int
    tokens: int
    final_train_loss: float
    eval: EvalResult | None
    tokens_per_second: float
    mfu: float
    elapsed_s: float
    resumed_from: int | None = None
    last_checkpoint: int | None = None
    losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("losses")
        return d


def _format_line(m: StepMetrics, total_steps: int) -> str:
    return (f"step {m.step:>6}/{total_steps} | loss {m.train_loss:.4f} | "
            f"lr {m.learning_rate:.2e} | grad {m.grad_norm:.3f} | "
            f"{m.tokens_per_second / 1e3:8.1f}k tok/s | mfu {100 * m.mfu:5.2f}% | "
            f"{1e3 * m.step_seconds:7.1f} ms")


def _logs(cfg: TrainJobConfig, step: int, total_steps: int) -> bool:
    """A logging step: every `training.logEvery`-th, and the last."""
    return step % cfg.training.log_every == 0 or step == total_steps


def _tokenizer_hash(cfg: TrainJobConfig) -> str | None:
    """The hash of data.tokenizer (a tokenizer.json), to check against the shard headers."""
    if not cfg.data.tokenizer:
        return None
    from crucible.trainer.tokenizer.bpe import tokenizer_hash

    return tokenizer_hash(cfg.data.tokenizer)


class Run:
    """One training process's view of the job: model, optimizer, data, metrics, checkpoints."""

    def __init__(self, cfg: TrainJobConfig, env: parallel.DistEnv, log):
        self.cfg, self.env, self.log = cfg, env, log
        t, self.model_cfg = cfg.training, cfg.model.to_arch()
        self.layout = layout.layout(t.sharding, t.shard_group_size, world_size=env.world_size,
                                    local_world_size=env.local_world_size,
                                    tensor=t.parallelism.tensor, pipeline=t.parallelism.pipeline)
        self.shape = run_shape(cfg, self.layout.dp.dp_size)
        self.train_shards = ShardSet(cfg.data.train)
        self.train_shards.check_compatible(self.model_cfg.vocab_size, _tokenizer_hash(cfg))
        self.val_shards = ShardSet(cfg.data.val) if cfg.data.val else None
        if self.val_shards is not None:
            self.val_shards.check_compatible(self.model_cfg.vocab_size,
                                             self.train_shards.tokenizer_hash)
        p = self.shape
        log(f"run {cfg.name}: {p.params / 1e6:.2f}M params, {env.world_size} rank(s) on "
            f"{env.device.type} ({self.layout.describe()}), {p.tokens_per_step} tokens/step "
            f"= {p.dp_size} data-parallel ranks x {p.micro_batch} seqs x {p.seq_len} tokens x "
            f"{p.accum_steps} accumulation, {p.total_steps} steps, "
            f"{p.flops_per_token / 1e6:.1f} MFLOP/token")
        if t.batch_ramp is not None:
            first = p.ramp.micro_steps(0)
            log(f"batch ramp: {first * p.ramp.unit_tokens} tokens/step ({first} accumulation) "
                f"growing to {p.tokens_per_step} over the first {t.batch_ramp.ramp_tokens:g} "
                f"tokens, {BatchSchedule(p.ramp, t.tokens).ramp_steps} steps")

        # Prove checkpoint storage works before anything expensive is built or trained.
        self.ckpt = self._checkpointer()
        if self.ckpt is not None:
            self.ckpt.probe()
            self.ckpt.claim()

        # Before the model: a CUDA memory snapshot must see its allocations.
        self.cadence = Cadence(t, Path(cfg.output_dir), env.rank, env.device, log)
        self._build_model()
        self.lr_scale = optim.LRScale()
        self.sampler = Sampler(self.train_shards, p.seq_len, t.seed)
        self.batches = Prefetcher(self.sampler, env.device, p.ramp, micro_batch=p.micro_batch,
                                  rank=self.dp.rank, world_size=self.dp.size)
        self.state = TrainState()
        parts = {"train": self.state, "sampler": self.sampler, "lr_scale": self.lr_scale}
        guard_spec = cfg.fault_tolerance.spike_guard
        self.guard = Guard(guard_spec) if guard_spec.enabled else None
        if self.guard is not None:
            parts["guard"] = self.guard
        self.app = AppState(self.model, self.optimizer, parts)
        self.faults = Faults.from_env()
        self.taken_faults: tuple[int, set[str]] = (0, set())
        self.slowdown = slowdown_from_env(env.rank)
        self._build_straggler_timing()
        # The step rank 0 last asked to save after, and when, until it is saved.
        self.save_asked: tuple[int, float] = NOT_ASKED
        self.metrics = self._metrics()
        self.lease = progress_lease(cfg.name) if env.is_main else None  # None outside Kubernetes
        self.peak_flops, peak_source = device_peak_flops(env.device)
        log(f"MFU peak: {self.peak_flops / 1e12:.2f} TFLOP/s per device ({peak_source})")

        self.memory = self._memory_tier()
        self.resumed_from = restore.resume(self)
        if self.lease is not None and self.timing_shared:
            # A new start has judged no one yet: clear what an earlier start reported.
            self.lease.update(step=self.state.step, tokens=self.state.tokens_seen, stragglers=())

    def _build_model(self) -> None:
        """The mesh, this rank's data-parallel place, the sharded model and its optimizer."""
        t, env = self.cfg.training, self.env
        torch.manual_seed(t.seed)
        self.mesh = parallel.build_mesh(env, self.layout)
        self.dp = parallel.data_parallel(self.mesh)  # the batch slice this rank reads
        compile_blocks = parallel.wants_compile(t.compile, env.device.type)
        self.log(f"compile: {'on' if compile_blocks else 'off'}"
                 f"{' (training.compile unset: on for CUDA only)' if t.compile is None else ''}; "
                 f"activation checkpointing: {t.activation_checkpointing_mode}")
        self.model = parallel.build_sharded_model(
            self.model_cfg, env, self.mesh, precision=t.precision, seed=t.seed,
            activation_checkpointing=t.activation_checkpointing_mode,
            checkpoint_every=t.activation_checkpointing_every, compile_blocks=compile_blocks,
            virtual_stages=t.parallelism.virtual_stages)
        if t.optimizer.bf16_stochastic_rounding:
            # No fp32 master copy: the parameters themselves are bf16, and the optimizer
            # rounds its fp32 update into them stochastically.
            store_params_in_bf16(self.model)
            self.log("parameters: bf16, no fp32 master copy; AdamW moments fp32, updates "
                     "rounded stochastically")
        self.optimizer = optim.build_optimizer(self.model, t)
        self.loss_context = functools.partial(tensor_parallel.loss_context, self.layout.tp > 1)
        self.pipeline = None
        if self.layout.pp > 1:
            self.pipeline = pipeline.Pipeline(
                self.model, self.model.pipeline_chunks, self.mesh, env.device,
                t.parallelism.schedule,
                torch.bfloat16 if t.precision == "bf16" else torch.float32)
            # Refused here, before any step, if a step the run can have cannot fill the stages
            # (or, interleaved, be split into rounds); the first such count ends the loop.
            for micro_batches in layout.counts_to_check(t.parallelism.schedule,
                                                        self.shape.ramp.counts()):
                self.pipeline.check(micro_batches)
            self.log(self.pipeline.describe())
            if t.gradient_sync == "everyMicroBatch":
                # torch's stages keep their whole gradients through the step and reduce them
                # after the last micro-batch (stage.py, `backward_maybe_with_nosync`); the
                # planner counts that (`memory.pipeline_stage_bytes`).
                self.log("gradientSync: everyMicroBatch is not what a pipeline does: its "
                         "stages reduce their gradients once, after the step's last "
                         "micro-batch")

    def _build_straggler_timing(self) -> None:
        """Every rank times its own work (straggler.SegmentTimer) and shares it in the step's
        all-reduce; rank 0 judges. With one rank there is nobody to be slower than."""
        spec, env = self.cfg.fault_tolerance.stragglers, self.env
        self.timing_shared = spec.enabled and env.world_size > 1
        self.local_timer = SegmentTimer(env.device)
        self.stragglers = (StragglerDetector(env.world_size, factor=spec.factor,
                                             window=spec.window_steps,
                                             patience=spec.patience_steps)
                           if self.timing_shared and env.is_main else None)
        self.hosts = [socket.gethostname()] * env.world_size
        if self.timing_shared:
            torch.distributed.all_gather_object(self.hosts, socket.gethostname())

    def _metrics(self) -> Metrics:
        """Rank 0's exporter and JSONL (the other ranks' Metrics record nothing)."""
        cfg, env = self.cfg, self.env
        out = Path(cfg.output_dir)
        jsonl = Path(cfg.metrics.jsonl) if cfg.metrics.jsonl else out / "metrics.jsonl"
        metrics = Metrics(cfg.name, env.rank, enabled=env.is_main, port=cfg.metrics.port,
                          jsonl_path=jsonl)
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "exporter.json").write_text(json.dumps({"port": metrics.port,
                                                           "pid": os.getpid()}))
            if metrics.port:
                self.log(f"metrics: http://127.0.0.1:{metrics.port}/metrics")
        metrics.set(restarts_total=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        # 1.0 (nobody slower) until judged: the series exists from the start, so the straggler
        # alert and the dashboard see a value, also for a job of one rank.
        metrics.set(slowest_rank_ratio=1.0)
        return metrics
    def _checkpointer(self) -> Checkpointer | None:
        spec = self.cfg.checkpoint
        if not spec.uri:
            self.log("checkpoint.uri is not set: this run keeps no checkpoints")
            return None
        model_hash, config_hash = job_hashes(self.cfg)
        return Checkpointer(spec, job=self.cfg.name, rank=self.env.rank,
                            world_size=self.env.world_size, local_rank=self.env.local_rank,
                            model_hash=model_hash, config_hash=config_hash,
                            on_commit=self.on_commit,
                            batch_tokens=self.shape.tokens_per_step,
                            batch_notes=self.batch_notes())

    def _memory_tier(self) -> MemoryTier | None:
        spec = self.cfg.checkpoint
        if not spec.in_memory_every_steps:
            return None
        model_hash, _ = job_hashes(self.cfg)
        # A snapshot is each rank's local shards: it restores only into the same layout. The
        # data-parallel mesh alone does not say it (tensor 2 and pipeline 2 on 4 ranks both
        # leave 2 data-parallel ranks), so the model-parallel degrees join the model's hash,
        # and the stages a pipeline rank holds (interleaved, rank 0 of 2 holds layers 0 and
        # 2 of 4; not, layers 0 and 1).
        lay = self.layout
        if lay.tp > 1 or lay.pp > 1:
            model_hash = f"{model_hash}:tp{lay.tp}:pp{lay.pp}"
        virtual = self.cfg.training.parallelism.virtual_stages
        if virtual > 1:
            model_hash = f"{model_hash}x{virtual}"
        return MemoryTier(job=self.cfg.name, rank=self.env.rank,
                          world_size=self.env.world_size,
                          local_world_size=self.env.local_world_size, model_hash=model_hash,
                          mesh_shape=self.layout.dp.dims, keep=spec.in_memory_keep)

    def batch_notes(self) -> dict:
        """What each checkpoint and snapshot records on how the steps are cut
        (`restore.batch_notes`)."""
        return restore.batch_notes(self.cfg.training, self.shape.lr_clock)

    def snapshot(self) -> None:
        """An in-memory snapshot of this step (every rank, at the same steps)."""
        blocking_s = self.memory.snapshot(self.app, self.state.step,
                                          notes={"global_batch_tokens": self.shape.tokens_per_step,
                                                 "tokens": self.state.tokens_seen,
                                                 **self.batch_notes()})
        self.metrics.set(memory_snapshot_blocking_seconds=blocking_s)

    def on_commit(self, commit: Commit, upload_s: float | None) -> None:
        """Rank 0, from the checkpoint thread (or at resume): publish the newest commit."""
        self.metrics.set(last_checkpoint_step=commit.step, checkpoint_bytes=commit.bytes,
                         checkpoint_upload_seconds=upload_s)
        if upload_s is not None:
            self.metrics.write({"kind": "checkpoint", "step": commit.step, "uri": commit.uri,
                                "bytes": commit.bytes, "upload_seconds": upload_s})
        if self.lease is not None:
            self.lease.update(step=self.state.step, tokens=self.state.tokens_seen,
                              checkpoint=commit.for_lease())

    # -- one optimizer step ----------------------------------------------------------------------
    def forward_backward(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward/backward over the accumulation micro-steps, then clip (not yet the update).
        Returns (this rank's mean loss, global grad norm before clipping, learning rate); the
        two numbers stay on the device for the step's one packed all-reduce (`launch`). The
        step's micro-steps are the batch ramp's for the tokens trained on so far (the full
        batch's without one); every micro-batch is as large, so the loss is the mean over every
        token of the step however many there are."""
        t, p, env = self.cfg.training, self.shape, self.env
        started = time.thread_time()
        self.local_timer.start_step()
        step = self.state.step
        faults = self.faults.take(step + 1)
        self.taken_faults = (step + 1, faults)   # given back if the step is dropped
        lr = optim.lr_at(p.lr_clock.position(step), t, p.lr_clock.total_steps) \
            * self.lr_scale.at(step)
        if "lr_x100" in faults:
            lr *= 100
        optim.set_lr(self.optimizer, lr)
        loss_sum = torch.zeros((), device=env.device)
        tokens_before = self.state.tokens_seen
        accum_steps = p.ramp.micro_steps(tokens_before)
        if self.pipeline is not None:
            loss = self._pipeline_step(tokens_before, accum_steps, faults)
            if self.slowdown > 1:
                self._slow_down(started)
            return loss, self._clip(), lr
        for micro in range(accum_steps):
            inputs, targets = self._micro_batch(tokens_before, micro, faults)  # (B, T) each
            if t.gradient_sync == "lastMicroBatch":
                # Reduce-scatter once per step, after the last micro-batch: until then each
                # rank holds full unsharded fp32 gradients.
                self.model.set_requires_gradient_sync(micro == accum_steps - 1)
            self.local_timer.start_segment()
            with self.loss_context():
                loss = self.model(inputs, targets)
                if "nan" in faults:
                    loss = loss * float("nan")
                (loss / accum_steps).backward()
            self.local_timer.end_segment()
            loss_sum += loss.detach()
        grad_norm = self._clip()
        if self.slowdown > 1:
            self._slow_down(started)
        return loss_sum / accum_steps, grad_norm, lr

    def _clip(self) -> torch.Tensor:
        """The global gradient norm, clipped to training.gradClip: over every pipeline stage's
        gradients when there are stages."""
        return optim.clip_grad_norm(self.model, self.cfg.training.grad_clip,
                                    pipeline_group=self.pipeline and self.pipeline.group)

    def _pipeline_step(self, tokens_before: int, accum_steps: int, faults: set[str]) -> torch.Tensor:
        """The step's micro-batches through the pipeline's schedule, as one batch it splits
        again; this rank's share of the mean loss (`Pipeline.train_step`)."""
        micro = [self._micro_batch(tokens_before, i, faults) for i in range(accum_steps)]
        self.local_timer.start_segment()
        with self.loss_context():
            loss = self.pipeline.train_step(torch.cat([i for i, _ in micro]),
                                            torch.cat([t for _, t in micro]), accum_steps)
        self.local_timer.end_segment()
        # The injected NaN reaches the loss the guard reads (the schedule computes the
        # gradients inside; the guard skips a step on its loss alone).
        return loss * float("nan") if "nan" in faults else loss

    def _micro_batch(self, tokens_before: int, micro: int,
                     faults: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch `micro` of the step that starts after `tokens_before` tokens, (B, T)
        inputs and targets on the device; random tokens under the injected `garbage` fault."""
        inputs, targets = self.batches.get(tokens_before, micro)
        if "garbage" in faults:
            gen = torch.Generator(device=self.env.device).manual_seed(
                self.state.step * 1000 + micro)
            inputs, targets = torch.randint(0, self.train_shards.vocab_size, (2, *inputs.shape),
                                            generator=gen, device=self.env.device)
        return inputs, targets

    def _slow_down(self, started: float) -> None:
        """The injected straggler (CRUCIBLE_SLOW_RANK): compute (spin) for the extra time a
        slower device would take, so CPU time sees it as a slow rank's own work."""
        until = time.thread_time() + (self.slowdown - 1) * (time.thread_time() - started)
        while time.thread_time() < until:
            pass

    def launch(self, loss_local: torch.Tensor, grad_norm: torch.Tensor, *, save: bool,
               stop: bool, measure_update: bool) -> InFlight:
        """The step's one collective, queued, not read: every number the ranks must agree on,
        summed in a single all-reduce on the compute device (`numbers` reads it one step
        later). The update norm, a metric, is measured only when `measure_update` (logging
        steps): it costs a pass over the optimizer state."""
        update_sq = optim.next_update_sq(self.optimizer) if measure_update else 0.0
        # The grad norm is already global (the same on every rank): rank 0's alone is summed.
        norm = grad_norm if self.env.is_main else 0.0
        # This rank's time for its own work in an earlier step (0 before there is one) rides
        # along, one slot per rank.
        slot = ((self.env.rank, self.env.world_size, self.local_timer.seconds() or 0.0)
                if self.timing_shared else None)
        pending = parallel.launch_sums([loss_local, norm, update_sq, float(save), float(stop)],
                                       self.env.device, slot)
        return InFlight(pending, measure_update)

    def numbers(self, flight: InFlight) -> StepNumbers:
        """Read a step's sums on the host: the loop's one host sync per step, one step late, so
        the device is already busy with the next step's forward and backward."""
        (loss_sum, norm, update_sq, saves, stops), local_s = flight.sums.read()
        self.local_timer.collect()  # the GPU timings that have completed by now
        # The sums run over every rank. Each rank's loss is its own batch slice's, so the mean is
        # over the world size (a rank outside the data-parallel dimensions would hold a copy of
        # its peer's loss, and the mean stay right; a pipeline's stages hold shares of it). Each
        # rank's update square counts only its share of what several ranks hold (HSDP's replicas,
        # tensor-parallel copies of a norm: `optim.next_update_sq`).
        return StepNumbers(loss=loss_sum / self.env.world_size, grad_norm=norm,
                           update_norm=(math.sqrt(update_sq)
                                        if flight.measure_update else None), save=saves > 0,
                           stop=stops > 0, local_seconds=local_s)

    def apply_update(self, flight: InFlight, limits: SkipLimits | None) -> None:
        """Take the optimizer step; with the stability guard, as decided on the device from the
        step's sums and the guard's `limits` (a skipped step changes no state), so the host
        never waits for the step's numbers to decide. The gradients are dropped after. The step
        has no collective: it is the last segment of the rank's own work."""
        self.optimizer.found_inf = (None if limits is None else optim.skip_flag(
            flight.sums.sums, self.env.world_size, limits.loss, limits.grad_norm))
        self.local_timer.start_segment()
        started = time.thread_time()
        self.optimizer.step()
        if self.slowdown > 1:
            self._slow_down(started)
        self.local_timer.end_segment()
        self.local_timer.stop()
        self.optimizer.zero_grad(set_to_none=True)

    def drop_update(self) -> None:
        """The step's gradients are not applied (a rollback or a stop decided meanwhile); the
        faults it injected fire again when it is computed again."""
        self.optimizer.zero_grad(set_to_none=True)
        self.faults.put_back(*self.taken_faults)

    def judge_stragglers(self, step: int, local_seconds: list[float]) -> None:
        """Rank 0: fold in every rank's own-work time of the previous step; report a rank that
        turned slow or recovered (log, metrics, progress Lease)."""
        events = self.stragglers.observe(step - 1, local_seconds)
        self.metrics.set(slowest_rank_ratio=float(self.stragglers.last_windowed.max()))
        for e in events:
            host = self.hosts[e.rank]
            if e.flagged:
                self.metrics.count("stragglers")
                self.log(f"straggler: rank {e.rank} on {host} takes {e.ratio:.2f}x the other "
                         f"ranks' median for its own work (median of "
                         f"{self.stragglers.window} steps, above "
                         f"{self.stragglers.factor:g}x for {self.stragglers.patience} steps)")
            else:
                self.log(f"straggler: rank {e.rank} on {host} is back to {e.ratio:.2f}x")
            self.metrics.write({"kind": "straggler", "step": e.step, "rank": e.rank,
                                "host": host, "ratio": e.ratio, "flagged": e.flagged})
        if events and self.lease is not None:
            self.lease.update(step=self.state.step, tokens=self.state.tokens_seen,
                              stragglers=tuple(Straggler(r, self.hosts[r], round(float(
                                  self.stragglers.last_windowed[r]), 3))
                                  for r in sorted(self.stragglers.flagged)))

    def record(self, verdict: Verdict) -> None:
        """Count, log and write a non-ok guard verdict (every rank reaches the same ones)."""
        self.metrics.count("spikes", verdict=verdict.kind)
        if verdict.kind == "skip":
            self.metrics.count("skipped_steps")
        self.metrics.write({"kind": "guard", "step": verdict.step, "verdict": verdict.kind,
                            "onset": verdict.onset, "reason": verdict.reason})
        self.log(f"stability guard at step {verdict.step}: {verdict.kind}: {verdict.reason}")

    def wants_save(self, step: int) -> bool:
        """Rank 0's opinion on saving after `step` (time-based saving must not be decided per
        rank)."""
        if self.ckpt is None or not self.env.is_main:
            return False
        spec, now = self.cfg.checkpoint, time.monotonic()
        # A save asked for and not made yet (the loop saves a step after it has launched the
        # next one) counts as made: counting from the older one would ask again at once.
        asked_step, asked_at = self.save_asked
        tried_step, tried_at = self.ckpt.last_attempt
        wanted = should_save(step, last_save_step=max(tried_step, asked_step),
                             seconds_since_save=now - max(tried_at, asked_at),
                             every_steps=spec.every_steps, every_minutes=spec.every_minutes)
        if wanted:
            self.save_asked = (step, now)
        return wanted

    def save(self, wait: bool = False) -> None:
        self.save_asked = NOT_ASKED
        blocking_s = self.ckpt.save(self.app, self.state.step, self.state.tokens_seen, wait=wait)
        if blocking_s is None:   # the previous save is still uploading: the checkpointer said why
            self.metrics.count("skipped_saves")
            return
        self.metrics.set(checkpoint_blocking_seconds=blocking_s)
        self.log(f"checkpoint of step {self.state.step} started ({blocking_s:.2f}s blocking)")

    def evaluate(self) -> EvalResult | None:
        if self.val_shards is None:
            return None
        t = self.cfg.training
        with self.loss_context():
            result = evaluate(self.model, self.val_shards, seq_len=self.shape.seq_len,
                              micro_batch=t.micro_batch, tokens=t.eval_tokens, rank=self.dp.rank,
                              world_size=self.dp.size, device=self.env.device,
                              loss_of=self.pipeline and self.pipeline.forward_loss)
        self.metrics.set(eval_loss=result.loss, eval_bits_per_byte=result.bits_per_byte)
        self.metrics.write({"kind": "eval", "step": self.state.step, "loss": result.loss,
                            "bits_per_byte": result.bits_per_byte, "tokens": result.tokens})
        self.log(f"eval at step {self.state.step}: loss {result.loss:.4f}, "
                 f"{result.bits_per_byte:.4f} bits/byte")
        return result

    def close(self) -> None:
        self.batches.close()
        self.cadence.close()
        if self.ckpt is not None:
            self.ckpt.wait()
        if self.memory is not None:
            self.memory.wait()
        if self.lease is not None:
            self.lease.close()
        self.metrics.close()


def train(cfg: TrainJobConfig, *, progress: bool = False, max_steps: int | None = None,
          log=print) -> RunSummary:
    """Train for the run's total steps, or `max_steps` more steps if given (the LR schedule
    still spans the whole run, so a run cut short and resumed is the same run)."""
    env = parallel.init_distributed()
    # SIGTERM only raises a flag: the ranks agree on it in the step's all-reduce, stop after the
    # same step and finish the save in flight (run.close) within the pod's grace period.
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        run = Run(cfg, env, log if env.is_main else (lambda *_: None))
        try:
            return _loop(run, progress=progress, max_steps=max_steps, stop=stop)
        finally:
            run.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
        parallel.shutdown()


@dataclass
class _Launched:
    """A step applied on the device whose numbers the host has not read yet."""

    step: int
    flight: InFlight
    lr: float
    begun: float                   # when its forward was queued (perf_counter)
    tokens: int                    # its global batch (the batch ramp's, or the full one)


class _Rollback(Exception):
    """A step's verdict rolled the run back: the step launched since is dropped."""


def _loop(run: Run, *, progress: bool, max_steps: int | None,
          stop: threading.Event | None = None) -> RunSummary:
    """Steps, pipelined one deep: step t's forward, backward and all-reduce are queued, then
    step t-1's numbers are read (the device is busy with step t meanwhile) and acted on
    (metrics, the guard's verdicts, save, stop, eval), then step t's update is applied as the
    device decides from the guard's limits. So a verdict, a save or a stop lands one step later
    than the numbers it reads, at the same step on every rank."""
    cfg, env, shape, state = run.cfg, run.env, run.shape, run.state
    bar = None
    if progress and env.is_main:
        from tqdm import tqdm

        bar = tqdm(total=shape.total_steps, initial=state.step, unit="step", dynamic_ncols=True)
    out = _Progress(losses=[], last_eval=None, started=time.perf_counter(),
                    tokens_at_start=state.tokens_seen, bar=bar)
    stop_at = (shape.total_steps if max_steps is None
               else min(shape.total_steps, state.step + max_steps))
    launched: _Launched | None = None
    try:
        while state.step < stop_at or launched is not None:
            current = None
            if state.step < stop_at:
                begun = time.perf_counter()
                run.cadence.before(state.step + 1)
                tokens = shape.ramp.micro_steps(state.tokens_seen) * shape.ramp.unit_tokens
                loss_local, grad_norm, lr = run.forward_backward()
                flight = run.launch(loss_local, grad_norm, save=run.wants_save(state.step + 1),
                                    stop=stop is not None and stop.is_set(),
                                    measure_update=_logs(cfg, state.step + 1, shape.total_steps))
                current = _Launched(state.step + 1, flight, lr, begun, tokens)
            if launched is not None:
                acting = time.thread_time()
                try:
                    _finish(run, launched, out, stop_at)
                except _Rollback:
                    if current is not None:
                        run.drop_update()    # computed on the state the rollback replaced
                    launched, out.last_read = None, None
                    continue
                except BaseException:
                    if current is not None:
                        run.drop_update()
                    raise
                finally:
                    # Not the step's own work (rank 0 alone writes the metrics; a save blocks).
                    run.local_timer.exclude(time.thread_time() - acting)
            launched = current
            if current is not None:
                run.apply_update(current.flight,
                                 run.guard.skip_limits() if run.guard else None)
                state.step += 1
                state.tokens_seen += current.tokens
                run.cadence.after(state.step)
        if run.ckpt is not None and run.ckpt.last_save_step < state.step:
            run.save(wait=True)  # the final (or cut-short) state is always committed
        if run.memory is not None and state.step >= shape.total_steps:
            run.memory.clear()  # a finished run has nothing to restart: free the memory
        out.last_eval = run.evaluate() or out.last_eval
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - out.started
    tps_avg = (state.tokens_seen - out.tokens_at_start) / max(elapsed, 1e-9)
    last_ckpt = run.ckpt.last_commit.step if run.ckpt and run.ckpt.last_commit else None
    return RunSummary(steps=state.step, tokens=state.tokens_seen,
                      final_train_loss=out.losses[-1] if out.losses else float("nan"),
                      eval=out.last_eval, tokens_per_second=tps_avg,
                      mfu=tps_avg / env.world_size * shape.flops_per_token / run.peak_flops,
                      elapsed_s=elapsed, resumed_from=run.resumed_from,
                      last_checkpoint=last_ckpt, losses=out.losses)


@dataclass
class _Progress:
    """What the loop carries from step to step for its summary and its step timing."""

    losses: list[float]
    last_eval: EvalResult | None
    started: float
    tokens_at_start: int
    bar: object = None
    last_read: float | None = None   # when the previous step's numbers were read
    aside_s: float = 0.0             # time since then spent on saves, snapshots and evals


def _finish(run: Run, done: _Launched, out: _Progress, stop_at: int) -> None:
    """Read a launched step's numbers and act on them: metrics, the guard's verdicts (its skip
    was already decided on the device, by the same rule), then abort, rollback (`_Rollback`),
    stop, save, snapshot, progress report and eval, all for step `done.step`, which the model
    and optimizer state are at (the next step is launched, not applied)."""
    cfg, env, shape, state, metrics = run.cfg, run.env, run.shape, run.state, run.metrics
    agreed = run.numbers(done.flight)
    # A step's time runs from the previous step's read to its own (each waits for the device
    # to finish a step: in steady state the device's step time), less what the loop spent on
    # saves, snapshots and evals between them. The first after a start or a rollback runs from
    # the queueing of its forward, so it also holds the next step's queueing (on CPU, its
    # compute): understated, never inflated.
    read_at = time.perf_counter()
    step_s = read_at - (out.last_read if out.last_read is not None else done.begun) - out.aside_s
    out.last_read, out.aside_s = read_at, 0.0
    loss_mean, grad_norm = agreed.loss, agreed.grad_norm
    if run.stragglers is not None:
        run.judge_stragglers(done.step, agreed.local_seconds)
    # The guard sees only all-reduced numbers, so every rank reaches the same verdicts; its
    # skip verdict is the rule the device applied with the same limits (guard.skips).
    pre = run.guard.check_update(done.step, loss_mean, grad_norm) if run.guard else None
    applied = pre is None or pre.ok
    post = run.guard.observe(done.step, loss_mean, grad_norm, applied) if run.guard else None
    tps = done.tokens / step_s
    out.losses.append(loss_mean)
    last_commit = run.ckpt.last_commit if run.ckpt is not None else None
    # The step's one record: every sink below reads it, none computes its own numbers.
    m = StepMetrics(
        step=done.step, tokens_total=state.tokens_seen, world_size=env.world_size,
        train_loss=loss_mean, grad_norm=grad_norm, learning_rate=done.lr, applied=applied,
        update_norm=agreed.update_norm if applied else 0.0, tokens_per_second=tps,
        # Per device: every rank's device does the work, data-parallel or not.
        mfu=tps / env.world_size * shape.flops_per_token / run.peak_flops,
        step_seconds=step_s, lr_scale=run.lr_scale.at(done.step - 1),
        checkpoint_age_seconds=(time.time() - last_commit.time
                                if last_commit is not None else None))
    metrics.log_step(m)
    for verdict in (pre, post):
        if verdict is not None and not verdict.ok:
            run.record(verdict)
    if post is not None and post.kind == "abort":
        raise GuardAbort(post.reason)
    if post is not None and post.kind == "rollback":
        restore.rollback(run, post)
        run.save_asked = NOT_ASKED   # a save asked for a step now undone is not made
        raise _Rollback()
    if agreed.stop:
        raise Terminated(f"SIGTERM: stopped after step {state.step}, finishing the "
                         "checkpoint in flight")
    aside = time.perf_counter()
    if agreed.save:
        run.save()
    if run.memory is not None and state.step % cfg.checkpoint.in_memory_every_steps == 0:
        run.snapshot()
    out.aside_s += time.perf_counter() - aside
    if run.lease is not None:
        run.lease.update(step=m.step, tokens=m.tokens_total, loss=m.train_loss,
                         world_size=m.world_size)
    if out.bar is not None:
        out.bar.update(1)
        out.bar.set_postfix(loss=f"{m.train_loss:.3f}", tok_s=f"{m.tokens_per_second / 1e3:.1f}k")
    elif _logs(cfg, state.step, shape.total_steps):
        run.log(_format_line(m, shape.total_steps))
    if cfg.training.eval_every and state.step % cfg.training.eval_every == 0 \
            and state.step < stop_at:
        aside = time.perf_counter()
        out.last_eval = run.evaluate()
        out.aside_s += time.perf_counter() - aside
