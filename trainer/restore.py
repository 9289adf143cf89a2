"""Where a run continues from: its counters, the resume plan, and the paths that restore state.

`TrainState` is the loop's own counters (torchtitan's `train_state`); `plan_resume` (pure)
says how a run continues from a loaded checkpoint when the batch, the batch ramp or the shard
set changed; `batch_notes` is what each checkpoint records for it beside the step and tokens.
The restore paths, each a function of the `Run` it restores into:
  * `resume`: at a start, the in-memory tier first (the node's own memory or a peer's copy,
    memory_checkpoint.py), unless storage holds a newer commit, then storage (checkpoint.py);
  * `rollback`: the stability guard's verdict, an in-memory snapshot or a commit from before
    the spike, the data since skipped and the LR lowered for a while.
Each reports where it restored from and how long it took (metrics, JSONL, progress Lease).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from crucible.api.batch_ramp import BatchRamp, BatchSchedule
from crucible.api.progress import RestoreRef
from crucible.trainer import parallel
from crucible.trainer.data import DataError
from crucible.trainer.guard import Verdict
from crucible.trainer.optim import LRClock

if TYPE_CHECKING:
    from crucible.trainer.loop import Run


class GuardAbort(RuntimeError):
    """The stability guard gave up: rolling back did not get the run past a spike."""


@dataclass
class TrainState:
    """The loop's own counters (torchtitan's `train_state`)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass(frozen=True)
class Resume:
    """How a run continues from a loaded checkpoint: a refusal (`problem`), or the sampler offset,
    total step count and LR schedule length to continue with, and what changed (`notes`, for
    the log)."""

    problem: str | None = None
    sample_offset: int = 0
    total_steps: int = 0
    notes: tuple[str, ...] = ()
    lr_clock: LRClock | None = None


# What a sampler's offset counts from, recorded in every checkpoint: "tokens" (the samples
# trained on, tokens seen / seqLen). A checkpoint without it counted from step x global batch.
OFFSET_FROM_TOKENS = "tokens"


def batch_notes(training, lr_clock: LRClock) -> dict:
    """What a checkpoint records about how its steps were cut, beside its global batch: the
    batch ramp (as the spec spells it), what the sampler's offset counts from, and the LR
    schedule's clock with the tokens it was counted for."""
    return {"batch_ramp": ramp_note(training), "sample_offset_from": OFFSET_FROM_TOKENS,
            "lr_schedule": {**lr_clock.note(), "tokens": training.tokens}}


def ramp_note(training) -> dict | None:
    """The batch ramp as a checkpoint records it (as the spec spells it), or None."""
    ramp = training.batch_ramp
    return ramp.model_dump(by_alias=True, mode="json") if ramp else None


def plan_resume(state: TrainState, *, saved_batch_tokens: int | None, batch_tokens: int,
                seq_len: int, saved_data_tokens: int | None, data_tokens: int,
                sample_offset: int, total_tokens: float, accept_batch: bool,
                accept_data: bool, saved_ramp: dict | None = None, ramp_spec: dict | None = None,
                ramp: BatchRamp | None = None, saved_offset_from: str | None = None,
                saved_lr_schedule: dict | None = None) -> Resume:
    """Continue from `state` (just loaded) with this run's batch, batch ramp and shards. Pure.

    A step reads samples from `tokens seen / seq_len + offset` on (data.Sampler), so the data
    order does not depend on how the tokens so far were cut into steps: with another global
    batch or batch ramp, accepted, the next step reads the first sample not yet trained on, and
    the steps left are those of the new schedule (`ramp`: the full batch alone when None) from
    the tokens seen on. A checkpoint from before that rule (no `saved_offset_from`) counted
    its offset from step x its batch: it is moved onto tokens seen. Another shard set,
    accepted, is a new data order: it starts from its beginning (the samples read so far were
    indices into another permutation). Unaccepted, any of them is refused, naming both values:
    it would skip, repeat or reshuffle samples, or change the batch schedule mid-run.

    The LR schedule keeps its clock (`saved_lr_schedule`, `optim.LRClock`) while the batch, the
    ramp and training.tokens are the checkpoint's: a ramp's steps are whole micro-batches per
    data-parallel rank, so a restart on another number of ranks mid-ramp can cut the rest of
    the ramp into other steps (hundreds more or fewer on a long ramp that starts below one
    micro-batch a rank), and recounting the schedule would move every later step's LR. The
    clock instead spreads the steps left over what is left of the schedule."""
    step, tokens = state.step, state.tokens_seen
    saved = saved_batch_tokens or (tokens // step if step else None)
    offset, notes = sample_offset, []
    if step and saved_offset_from != OFFSET_FROM_TOKENS and saved:
        # The old offset counted from step x batch; the same sample from tokens seen.
        offset += step * (saved // seq_len) - tokens // seq_len
    if step and saved != batch_tokens:
        if not accept_batch:
            return Resume(problem=(
                f"training.globalBatchTokens is {batch_tokens} but the checkpoint was trained "
                f"with {saved} ({tokens} tokens in {step} steps): resuming would skip "
                "or repeat samples; restore globalBatchTokens, set checkpoint.acceptChangedBatch "
                "to continue at the next unseen sample, or start a new checkpoint.uri"))
        notes.append(f"global batch {saved} -> {batch_tokens} tokens (accepted): continuing at "
                     f"sample {tokens // seq_len + offset}")
    if step and saved_ramp != ramp_spec:
        if not accept_batch:
            return Resume(problem=(
                f"training.batchRamp is {_ramp_text(ramp_spec)} but the checkpoint was trained "
                f"with {_ramp_text(saved_ramp)} ({tokens} tokens in {step} steps): resuming "
                "would change the batch schedule mid-run; restore batchRamp, set "
                "checkpoint.acceptChangedBatch to continue with the new ramp from the tokens "
                "trained on, or start a new checkpoint.uri"))
        notes.append(f"batch ramp {_ramp_text(saved_ramp)} -> {_ramp_text(ramp_spec)} "
                     f"(accepted): continuing from {tokens} tokens")
    ramp = ramp or BatchRamp(batch_tokens, 1)
    total = BatchSchedule(ramp, total_tokens, step=step, tokens=tokens).total_steps
    clock = LRClock(total)
    saved_clock = (LRClock.from_note(saved_lr_schedule)
                   if isinstance(saved_lr_schedule, dict)
                   and saved_lr_schedule.get("tokens") == total_tokens else None)
    if step and saved == batch_tokens and saved_ramp == ramp_spec and saved_clock:
        clock = saved_clock.resumed(step, total)
        if clock.run_steps and clock != saved_clock:
            notes.append(f"the batch ramp's steps at this size end at step {total}, not "
                         f"{saved_clock.run_steps or saved_clock.total_steps}: the rest of the "
                         f"LR schedule (from {clock.anchor_position:.2f} of its "
                         f"{clock.total_steps} steps) is spread over them")
    if saved_data_tokens is not None and saved_data_tokens != data_tokens:
        if not accept_data:
            return Resume(problem=(
                f"the training shards hold {data_tokens:,} tokens but the checkpoint was trained "
                f"on a shard set of {saved_data_tokens:,}: resuming would reshuffle the data "
                "order; point data.train at the same shards, set checkpoint.acceptChangedData to "
                "start the new shards' order from its beginning, or start a new checkpoint.uri"))
        offset = -(tokens // seq_len)
        notes.append(f"training shards of {saved_data_tokens:,} -> {data_tokens:,} tokens "
                     "(accepted): their order starts from its beginning")
    return Resume(sample_offset=offset, total_steps=total, notes=tuple(notes), lr_clock=clock)


def _ramp_text(ramp: dict | None) -> str:
    if not ramp:
        return "unset"
    return f"{ramp['startTokens']} tokens over {ramp['rampTokens']:g}"


def resume(run: Run) -> int | None:
    """At a start: restore the newest state there is (memory, else storage) into `run`; the
    step restored, or None for a fresh start."""
    restored = from_memory(run) if run.memory is not None else None
    if restored is None and run.ckpt is not None:
        started = time.perf_counter()
        restored = run.ckpt.load(run.app)  # a commit manifest (not a `Commit`), or None
        if restored is not None:
            continue_from(run, restored, run.ckpt.last_commit.uri)
            run.log(f"resumed from {run.ckpt.last_commit.uri} (step {restored['step']}, saved "
                    f"by {restored['world_size']} ranks, now {run.env.world_size})")
            run.on_commit(run.ckpt.last_commit, None)
            report_restore(run, storage_source(run), restored["step"],
                           time.perf_counter() - started)
    return restored["step"] if restored is not None else None


def continue_from(run: Run, restored: dict, where: str) -> None:
    """Check (and, where the job accepts a change, adjust) the state just loaded."""
    spec, p = run.cfg.checkpoint, run.shape
    plan = plan_resume(run.state, saved_batch_tokens=restored.get("global_batch_tokens"),
                       batch_tokens=p.tokens_per_step, seq_len=p.seq_len,
                       saved_data_tokens=run.sampler.restored_num_tokens,
                       data_tokens=run.train_shards.num_tokens,
                       sample_offset=run.sampler.sample_offset,
                       total_tokens=run.cfg.training.tokens,
                       accept_batch=spec.accept_changed_batch,
                       accept_data=spec.accept_changed_data,
                       saved_ramp=restored.get("batch_ramp"),
                       ramp_spec=ramp_note(run.cfg.training), ramp=p.ramp,
                       saved_offset_from=restored.get("sample_offset_from"),
                       saved_lr_schedule=restored.get("lr_schedule"))
    if plan.problem:
        raise DataError(f"cannot resume from {where}: {plan.problem}")
    for note in plan.notes:
        run.log(f"resume: {note}")
    run.sampler.sample_offset = plan.sample_offset
    run.shape = replace(p, total_steps=plan.total_steps, lr_clock=plan.lr_clock)
    if run.ckpt is not None:   # the commits from here on record the schedule's length
        run.ckpt.batch_notes = run.batch_notes()


def from_memory(run: Run, max_step: int | None = None) -> dict | None:
    """Restore the newest in-memory snapshot (at or below `max_step`) unless storage holds a
    newer commit; what was restored (step and the snapshot's notes), or None."""
    # Only a listing: no checkpoint bytes are read from storage on this path.
    floor = run.ckpt.newest_committed(max_step) if run.ckpt is not None else 0
    # The parameters' mesh: without a pipeline's dimension, which none of them is placed on.
    report = run.memory.restore(run.app, parallel.param_mesh(run.mesh), run.env.device,
                                max_step=max_step, min_step=floor)
    if report is None:
        return None
    restored = {"step": report.step, **report.notes}
    if max_step is None:  # a start: check the batch and data as any resume does
        continue_from(run, restored, f"the in-memory snapshot of step {report.step}")
    if run.ckpt is not None:
        run.ckpt.restart_cadence(report.step)  # the next save keeps its schedule
    run.log(f"restored step {report.step} from {report.source} in {report.seconds:.2f}s: "
            f"{report.local_bytes} bytes from the nodes' own memory, {report.peer_bytes} "
            f"from peers, 0 from storage")
    report_restore(run, report.source, report.step, report.seconds)
    return restored


def storage_source(run: Run) -> str:
    """Where a restore from the checkpointer came from, as status and the JSONL name it."""
    return "s3" if run.ckpt.remote else "disk"


def report_restore(run: Run, source: str, step: int, seconds: float) -> None:
    run.metrics.set(restore_seconds=seconds)
    run.metrics.write({"kind": "restore", "source": source, "step": step, "seconds": seconds})
    if run.lease is not None:
        run.lease.update(step=step, tokens=run.state.tokens_seen,
                         restore=RestoreRef(source, step, seconds,
                                            dt.datetime.now(dt.timezone.utc)))


def rollback(run: Run, verdict: Verdict) -> None:
    """Reload a commit from before the spike, skip the data since, lower the LR for a while."""
    spec = run.cfg.fault_tolerance.spike_guard
    if run.ckpt is None:
        raise GuardAbort(f"{verdict.reason}; a rollback needs checkpoint.uri")
    run.ckpt.wait()
    guard_state = run.guard.state_dict()  # the guard remembers across the rollback
    target = verdict.onset - spec.rollback_margin_steps
    # An in-memory snapshot if one is old enough and no commit is newer, else a commit
    # manifest (a dict, not a `Commit`), or None when no commit is old enough.
    commit = from_memory(run, max_step=target) if run.memory is not None else None
    if commit is None:
        started = time.perf_counter()
        commit = run.ckpt.load(run.app, max_step=target)
        if commit is None:
            commit = run.ckpt.load(run.app, max_step=verdict.onset - 1)
            if commit is not None:
                run.log(f"no commit {spec.rollback_margin_steps} steps before the spike at "
                        f"step {verdict.onset}; rolling back to step {commit['step']} (keep "
                        "more: checkpoint.keepEvery)")
        if commit is None:
            raise GuardAbort(f"{verdict.reason}; no committed checkpoint before step "
                             f"{verdict.onset} to roll back to")
        report_restore(run, storage_source(run), commit["step"],
                       time.perf_counter() - started)
    run.guard.load_state_dict(guard_state)
    run.guard.rolled_back(verdict)
    restored = commit["step"]
    run.ckpt.discard_after(restored)
    if run.memory is not None:
        run.memory.discard_after(restored)
    skip_steps = (spec.data_skip_steps if spec.data_skip_steps is not None
                  else verdict.onset - restored)
    # The data of `skip_steps` steps from the restored state on, as the batch ramp cuts them.
    tokens = run.state.tokens_seen
    skipped = BatchSchedule(run.shape.ramp, tokens, step=restored,
                            tokens=tokens).at(restored + skip_steps).tokens_before - tokens
    run.sampler.skip(skipped // run.shape.seq_len)
    run.lr_scale.lower(spec.lr_factor, until_step=restored + spec.cooldown_steps)
    run.metrics.count("rollbacks")
    run.metrics.set(lr_scale=spec.lr_factor)
    run.metrics.write({"kind": "rollback", "step": verdict.step, "to_step": restored,
                       "skipped_batches": skip_steps, "sample_offset": run.sampler.sample_offset,
                       "lr_scale": spec.lr_factor})
    run.log(f"rolled back to step {restored}, skipping {skip_steps} batches of data, LR x"
            f"{spec.lr_factor:g} until step {restored + spec.cooldown_steps}")
