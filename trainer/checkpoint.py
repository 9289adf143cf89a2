"""Sharded checkpoints (DCP) on local disk or S3, committed by a manifest written last.

Layout under `checkpoint.uri` (docs/checkpoints.md, "Layout and the commit protocol"):
  step_<N>/__<rank>_0.distcp   rank's DTensor shards        (torch.distributed.checkpoint)
  step_<N>/__<rank>_1.distcp   rank's share of the replicated values (optimizer steps, RNG,
                               loop state; kilobytes), when it has one: checkpoint_fetch.py
  step_<N>/.metadata           DCP's global index           (written by rank 0)
  step_<N>/rank_<r>.json       rank r's files, sizes and xxh3-128 checksums, after its upload
  step_<N>/manifest.json       step, tokens, global batch, world size, every file with size and checksum, the
                               model/config hashes: written by rank 0 once every rank's marker is
                               there. No manifest (or a checksum mismatch) = no checkpoint.
                               With CRUCIBLE_CHECKPOINT_SIGNING_KEY set, also an HMAC-SHA256
                               `signature` over all that (docs/checkpoints.md, "Signed manifests").
  step_<N>/quarantine.json     a commit that could not be loaded, and why: no longer a commit.
  incarnation.json             the token of the start that owns the URI: only it commits or prunes.

Saving follows torchtitan's `CheckpointManager`: `dcp.async_save` on a dedicated gloo group, so
the training loop blocks only while the state is staged (copied), then the write, the upload
(S3: staged in a node-local folder, uploaded with retries and backoff) and the commit happen on
a background thread. At most one save is in flight: a save due while the previous one is still
uploading on some rank is skipped, on every rank alike, and the next is due one interval later
(a store that hangs must not stop training); the last save of a run waits for it. Every
rank learns whether every part made it from one all-reduce on the checkpoint group, so a save
that fails on any rank is abandoned everywhere at once, without a manifest; training goes on and
the next save tries again.

Loading takes the newest committed step (or the newest at or below a bound, for rollbacks),
checks the manifest (`manifest_problem`: fields, step, file names that are shard names and
nothing else), and then each rank fetches (S3: into a folder of its own) and verifies only
`.metadata` and the files its own part of the load reads (checkpoint_fetch.py: worked out from
DCP's load plan, so about 1/world_size of the commit). When anything is wrong on any rank, every
rank learns it, and what, and the commit is quarantined and the previous one tried, loudly. DCP
reshards on load, so a run restarted by torchrun on a different world size resumes from the same
checkpoint (each rank's file set follows its new slice).

What a commit is (manifest, checksums, signatures) is checkpoint_manifest.py; the commits under
the URI as rank 0 reads and tends them (ownership, listing, quarantine, retention) are
checkpoint_store.py. This module is the collective part: saving and loading across the ranks.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from crucible.api.progress import CommitRef
from crucible.api.spec import CheckpointSpec
from crucible.trainer import storage
from crucible.trainer.checkpoint_fetch import (METADATA, SafeReader, SplitWriter, UnsafeCheckpoint,
                                               files_needed, load_planner, local_load_plan,
                                               read_metadata)
from crucible.trainer.checkpoint_manifest import (FORMAT_VERSION, MANIFEST, SIGNING_KEY_ENV,
                                                  describe_problems, file_digest, key_id, sign,
                                                  signature_problem, signing_key_from_env,
                                                  step_name, verify)
from crucible.trainer.checkpoint_store import CommitStore

log = logging.getLogger(__name__)
T = TypeVar("T")

class CheckpointError(RuntimeError):
    """Checkpoint storage cannot be used, or a checkpoint cannot be loaded into this model."""


class StoreUnavailable(CheckpointError):
    """The store did not answer through the retries (`storage.unavailable`): nothing is wrong
    with the job or its checkpoints, and a restart once the store is back gets on with it."""


class InjectedFailure(RuntimeError):
    """Raised by a `fail@<rank>` failpoint."""


def failpoint(name: str, rank: int | None = None) -> None:
    """Chaos-testing hook: CRUCIBLE_FAILPOINT="before_upload:3,before_manifest:30" makes the
    checkpoint thread pause there for that many seconds, so a test can kill a process or stop
    the S3 server at a known point of a save; "upload:fail@1" makes rank 1 fail there, with an
    error no retry fixes. Unset in production; costs one dict lookup."""
    spec = os.environ.get("CRUCIBLE_FAILPOINT")
    if not spec:
        return
    for item in spec.split(","):
        point, _, arg = item.partition(":")
        if point.strip() != name:
            continue
        if arg.startswith("fail@"):
            if rank is not None and int(arg.removeprefix("fail@")) == rank:
                raise InjectedFailure(f"failpoint {name}: injected failure on rank {rank}")
        else:
            log.warning("failpoint %s: pausing %ss", name, arg)
            time.sleep(float(arg or 0))


def should_save(step: int, *, last_save_step: int, seconds_since_save: float,
                every_steps: int, every_minutes: float) -> bool:
    if step <= last_save_step:
        return False
    # On multiples of every_steps (so keepEvery multiples line up with real saves).
    if every_steps and step // every_steps > last_save_step // every_steps:
        return True
    return bool(every_minutes) and seconds_since_save >= every_minutes * 60


def stable_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def job_hashes(cfg) -> tuple[str, str]:
    """(model hash, config hash) of a TrainJobConfig: a checkpoint loads only into the same
    architecture; other training settings may differ (a warning says so)."""
    settings = cfg.model_dump(mode="json", include={"model", "data", "training"})
    fingerprint = cfg.model.to_arch().fingerprint()
    if cfg.training.optimizer.bf16_stochastic_rounding:
        # bf16 parameters and a rounding counter in the optimizer's groups: a checkpoint of
        # either kind cannot be loaded as the other (DCP misses the counter one way, and widens
        # the weights silently the other), so the storage is part of what must match.
        fingerprint = {**fingerprint, "parameter_storage": "bf16-stochastic-rounding"}
    return stable_hash(fingerprint), stable_hash(settings)


# How long rank 0 may retry a read every other rank waits for in a broadcast on the default
# group (init_distributed's 600 s timeout): the deadline plus one more metadata call (~80 s with
# storage.METADATA_CONFIG) ends inside it.
RANK0_DEADLINE_S = 420.0
# How long a rank may retry its downloads before the all-reduce on the checkpoint group (gloo,
# torch's default 30 min): the deadline plus one more transfer call (botocore's 60 s connect
# and read timeouts, 6 attempts: ~13 min) ends inside it.
DOWNLOAD_DEADLINE_S = 900.0


def with_retries(action: Callable[[], T], what: str, attempts: int = 6, base_delay_s: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep,
                 retry_if: Callable[[BaseException], bool] = lambda err: True,
                 deadline_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> T:
    """Run `action` and return its result, retrying with exponential backoff (1, 2, 4, ... s)
    the errors `retry_if` accepts; re-raise the last error (or the first one it refuses). No
    attempt starts `deadline_s` or more after the first began: ranks wait for this one in a
    collective whose timeout must not run out first."""
    start = clock()
    for attempt in range(attempts):
        try:
            return action()
        except Exception as err:  # noqa: BLE001 - storage errors come in many classes; re-raised
            delay = base_delay_s * 2**attempt
            late = deadline_s is not None and clock() - start + delay >= deadline_s
            if attempt == attempts - 1 or not retry_if(err) or late:
                raise
            log.warning("%s failed (%s); retry %d/%d in %.0fs", what, type(err).__name__,
                        attempt + 1, attempts - 1, delay)
            sleep(delay)


def everyone_ok(ok: bool, group) -> bool:
    """True when every rank says ok. On a gloo group of the caller's own: a CPU tensor on the
    default group would fail under NCCL, which takes CUDA tensors only."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


# --- what is saved ------------------------------------------------------------------------------
# The optimizer's state and its param groups keyed by parameter name, each entry its own DCP key
# (torchtitan's choice). Nested, the param groups are one list under one key: a pipeline stage's
# list names only its own parameters, DCP keeps one rank's list for that key, and the other
# stages' lr, betas and weight decay were lost on load.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)

class AppState(Stateful):
    """Everything a restart needs, by name: model and optimizer (sharded, via DCP's state_dict
    API), and the loop's own `Stateful` parts (train state, sampler, LR scale, guard, ...)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 parts: dict[str, Stateful]):
        self.model, self.optimizer, self.parts = model, optimizer, parts

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=FLAT_OPTIMIZER)
        return {"model": model_sd, "optimizer": optim_sd, "rng": torch.get_rng_state(),
                **{name: part.state_dict() for name, part in self.parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=FLAT_OPTIMIZER)
        # The generator lives on the host and takes a host tensor only, whatever device the
        # rest of the state was restored to (on a GPU a restore that moved it there crashed).
        torch.set_rng_state(state["rng"].to("cpu"))
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


@dataclass(frozen=True)
class Commit:
    step: int
    tokens: int
    uri: str
    time: float
    bytes: int

    def for_lease(self) -> CommitRef:
        """What the progress report says of this commit."""
        return CommitRef(self.step, self.uri,
                         dt.datetime.fromtimestamp(self.time, dt.timezone.utc))


# --- the checkpointer ---------------------------------------------------------------------------
class Checkpointer:
    def __init__(self, spec: CheckpointSpec, *, job: str, rank: int, world_size: int,
                 local_rank: int, model_hash: str, config_hash: str,
                 on_commit: Callable[[Commit, float], None] | None = None,
                 marker_timeout_s: float = 600.0, upload_attempts: int = 6,
                 batch_tokens: int | None = None, batch_notes: dict | None = None,
                 read_only: bool = False):
        assert spec.uri, "Checkpointer needs checkpoint.uri"
        # A reader beside the run (`crucible eval`, `export`): a commit it cannot load is skipped,
        # never quarantined. What failed may be the reader's own (its node, disk or network), and
        # a marker would take the commit from the training run, whose retention then deletes it.
        self.read_only = read_only
        # Manifests are signed and a load demands a valid signature when a key is set; private:
        # no message, marker or manifest ever holds it, only its key id.
        key = signing_key_from_env()
        if spec.signing_key_secret and key is None:
            # The operator maps the Secret's key onto the variable: an empty one is a Secret
            # without that key, and running unsigned would be the opposite of what was asked.
            raise CheckpointError(
                f"checkpoint.signingKeySecret is {spec.signing_key_secret!r} but {SIGNING_KEY_ENV} "
                f"is empty: put the key under {SIGNING_KEY_ENV} in that Secret (e.g. kubectl "
                f"create secret generic {spec.signing_key_secret} "
                f"--from-literal={SIGNING_KEY_ENV}=$(openssl rand -hex 32))")
        # Recorded in each manifest: the batch the steps so far were taken with, which a resume
        # compares against its own (a state's tokens/step is an average once it has changed),
        # and `batch_notes`: JSON fields on how the steps were cut (the batch ramp, what the
        # sampler's offset counts from) that a resume checks too.
        self.batch_tokens, self.batch_notes = batch_tokens, batch_notes or {}
        self.spec, self.uri = spec, spec.uri.rstrip("/")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.model_hash, self.config_hash = model_hash, config_hash
        self.on_commit = on_commit
        self.marker_timeout_s, self.upload_attempts = marker_timeout_s, upload_attempts
        self.remote = storage.is_s3(self.uri)
        self.scratch = Path(tempfile.gettempdir()) / "crucible" / job / f"uri-{stable_hash(self.uri)}"
        # Checkpoint collectives run on their own gloo group, from DCP's background thread,
        # so they never interleave with the training group's collectives.
        self.group = dist.new_group(backend="gloo")
        # Whether the previous save is done is asked on a group of its own: that save's thread
        # may be in a collective on `self.group` at that very moment.
        self._busy_group = dist.new_group(backend="gloo")
        self._inflight: threading.Thread | None = None
        self._fetch_outage = False
        self._inflight_step = 0
        self.store = CommitStore(self.uri, key)
        self.last_commit: Commit | None = None
        self.last_save_step = 0
        self.last_save_time = time.monotonic()
        # A save skipped while the previous one was still uploading: the cadence counts from it
        # (the next try is one interval later, not at every step), but it saved nothing.
        self.last_skip_step, self.last_skip_time = 0, float("-inf")
        self.last_blocking_s = 0.0
        # Bytes of the last loaded commit each rank fetched (S3) or verified in place (local),
        # by rank; the commit's total is last_commit.bytes.
        self.last_load_bytes: list[int] = []
        self._key = key
        if self._key is not None and self.rank == 0:
            log.info("checkpoint manifests are signed and verified with key id %s (%s)",
                     key_id(self._key), SIGNING_KEY_ENV)
            if len(self._key) < 16:
                log.warning("%s is only %d bytes: a short key can be guessed from a signed "
                            "manifest; use 32 random bytes (openssl rand -hex 32)",
                            SIGNING_KEY_ENV, len(self._key))

    # -- start-up checks ----------------------------------------------------------------------
    def probe(self) -> None:
        """Prove the storage is writable before any step is spent (rank 0 tries, all learn). A
        store that does not answer is retried and then stops every rank with StoreUnavailable
        (a restart during an outage must not read as the job's own failure); credentials or a
        missing bucket fail at once (CheckpointError)."""
        def write_and_read_back() -> str | None:
            key = storage.join(self.uri, f".probe-{os.uname().nodename}-{os.getpid()}")
            storage.write_bytes(key, b"crucible", metadata=True)
            back = storage.read_bytes(key, metadata=True)
            storage.delete_file(key, metadata=True)
            return None if back == b"crucible" else f"{key} did not read back what was written"
        outcome = self._rank0_outcome(write_and_read_back, "the storage probe",
                                      retry_if=storage.unavailable)
        if outcome[0] == "failed" or outcome[1] is not None:
            away = outcome[0] == "failed" and outcome[2]
            raise (StoreUnavailable if away else CheckpointError)(
                f"checkpoint storage is not usable: {outcome[1]}")

    # -- fencing and listing --------------------------------------------------------------------
    def claim(self) -> None:
        """Make this start the owner of the checkpoints under the URI (CommitStore.claim): rank
        0 draws a fresh token and records it, every rank learns it."""
        box = [os.urandom(8).hex() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.store.claim(box[0], write=False)
        # Rank 0's write is retried, and a store that stays away stops every rank (none waits
        # in a later collective for a rank 0 that died here).
        self._on_rank0(lambda: self.store.claim(box[0], write=True), "claim the checkpoints")

    def newest_committed(self, max_step: int | None = None) -> int:
        """The newest committed step (at or below `max_step`), 0 if none: rank 0 lists, every
        rank learns it. Reads no checkpoint bytes."""
        return max(self._listed(self.store.committed_steps, max_step), default=0)

    def _quarantine(self, step: int, problem: str) -> None:
        """Every rank logs it; rank 0 marks the commit (CommitStore.quarantine), unless this
        Checkpointer only reads."""
        if self.read_only:
            log.error("checkpoint %s/%s cannot be loaded: %s; skipped (a read-only load marks "
                      "nothing), falling back to the previous commit", self.uri, step_name(step),
                      problem)
            return
        log.error("checkpoint %s/%s is corrupt: %s; quarantined, falling back to the previous "
                  "commit", self.uri, step_name(step), problem)
        if self.rank == 0:
            self.store.quarantine(step, problem)

    def _everyone_ok(self, ok: bool) -> bool:
        return everyone_ok(ok, self.group)

    # -- load -----------------------------------------------------------------------------------
    def load(self, app: AppState, max_step: int | None = None) -> dict | None:
        """Load the newest loadable commit (at or below `max_step`); None if there is none. A
        commit that cannot be loaded on some rank (unreadable or malformed manifest, a missing,
        short or altered file that rank needs) is quarantined by all and the previous one tried.

        Each rank fetches and verifies only the files it reads (`_fetch`). A damaged file that no
        rank of this world size reads goes unnoticed: it cannot affect this load, and a later
        load that does read it (another world size) finds it and falls back then."""
        self.wait()  # a save in flight uses the checkpoint group too, and may yet commit
        steps = self._listed(self.store.manifest_steps, max_step)
        other_key = []   # (step, why): commits this run's key cannot vouch for, left as they are
        for step in reversed(steps):
            manifest, problem, key_in_question = self._on_rank0(
                lambda s=step: self.store.read_commit(s), f"read {step_name(step)}'s manifest")
            if key_in_question:
                # Unsigned, or signed with another key: perhaps planted, perhaps genuine and this
                # job holds the wrong key (or turned signing on over older commits). Skipped, not
                # quarantined: once the key is right it is a commit again.
                if self.rank == 0:
                    log.warning("%s/%s skipped: %s", self.uri, step_name(step), problem)
                other_key.append((step, problem))
                continue
            if manifest is not None and manifest["model_hash"] != self.model_hash:
                raise CheckpointError(
                    f"{self.uri}/{step_name(step)} was written for a different model architecture "
                    f"or parameter storage (hash {manifest['model_hash']} != {self.model_hash}); "
                    "use a new checkpoint.uri for a new model, or restore the model fields and "
                    "training.optimizer.bf16StochasticRounding as they were")
            folder, needed = None, []
            self._fetch_outage = False   # set by _get when the store, not the commit, failed
            if problem is None:
                folder, needed, problem = self._fetch(step, manifest, app)
            # One all-reduce decides for every rank at once: a rank must never quarantine a
            # commit that another rank loads. Only then are the reasons gathered, for the log.
            if not self._everyone_ok(problem is None):
                reports = self._gather((problem, self._fetch_outage))
                outages = [why for why, away in reports if away]
                if outages:
                    # A download the store failed (through the retries) says nothing about the
                    # commit: stop, quarantine nothing, as a listing the store fails does.
                    self._clear_restore()
                    raise StoreUnavailable(
                        f"cannot fetch {step_name(step)}: {outages[0]}; the model is unchanged, "
                        "and a restart loads the newest commit once the storage answers")
                self._quarantine(step, describe_problems([why for why, _ in reports]))
                continue
            dcp.load({"app": app}, storage_reader=SafeReader(str(folder)),
                     planner=load_planner())
            self._clear_restore()  # in memory now: the node-local copy is no longer needed
            total = sum(f["size"] for f in manifest["files"].values())
            self._report_fetch(step, sum(manifest["files"][n]["size"] for n in needed), total,
                               needed)
            self.restart_cadence(step)
            self.last_commit = Commit(step, manifest["tokens"], f"{self.uri}/{step_name(step)}",
                                      manifest["time"], total)
            if manifest["config_hash"] != self.config_hash and self.rank == 0:
                log.warning("resuming from step %d of a run with different training settings", step)
            return manifest
        self._clear_restore()
        if other_key:
            # Starting over here would let the next saves prune those commits: a wrong key
            # would cost the run. Stop and say what to do instead.
            step, why = other_key[0]
            raise CheckpointError(
                f"no commit under {self.uri} can be verified with this run's signing key (key id "
                f"{key_id(self._key)}): {len(other_key)} skipped, the newest {step_name(step)}: "
                f"{why}. Fix checkpoint.signingKeySecret, or move them out of checkpoint.uri to "
                "start over")
        return None

    def _gather(self, value) -> list:
        """`value` from every rank, by rank (on the checkpoint group, as every collective here)."""
        values = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(values, value, group=self.group)
        return values

    def _report_fetch(self, step: int, fetched: int, total: int, needed: list[str]) -> None:
        """Record how many of the commit's bytes each rank fetched, and log it on rank 0 (the
        only rank that logs at INFO) with the files, one line per rank."""
        reports = self._gather((fetched, needed))
        self.last_load_bytes = [count for count, _ in reports]
        if self.rank == 0:
            verb = "fetched" if self.remote else "verified"
            for rank, (count, names) in enumerate(reports):
                log.info("restore of %s/%s: rank %d %s %d of %d bytes (%.0f%%): %s", self.uri,
                         step_name(step), rank, verb, count, total, 100 * count / max(total, 1),
                         ", ".join(names))

    def discard_after(self, step: int) -> None:
        """Delete every checkpoint newer than `step` (rank 0): after a rollback they belong to an
        abandoned timeline, and a later resume must not pick them up."""
        self.wait()
        if self.rank == 0:
            self.store.discard_after(step)
        dist.barrier()

    def _restore_folder(self) -> Path:
        """This rank's own download folder: ranks fetch different files, and two agents on one
        host (tests, or a pod replaced in place) must not clear each other's."""
        return self.scratch / "restore" / f"rank{self.rank}"

    def _clear_restore(self) -> None:
        if self.remote:
            shutil.rmtree(self._restore_folder(), ignore_errors=True)

    def _listed(self, listing: Callable[[], list[int]], max_step: int | None) -> list[int]:
        """Commit steps from `listing` (a CommitStore method, oldest first) at or below
        `max_step`, on every rank (`_on_rank0`)."""
        return self._on_rank0(lambda: [s for s in listing() if max_step is None or s <= max_step],
                              "list the checkpoints")

    def _on_rank0(self, read: Callable[[], T], what: str) -> T:
        """`read` done by rank 0 and its result broadcast to every rank. A store that is
        restarting answers errors for a while (SeaweedFS, restarted under load on kind: 404 on
        ListObjectsV2 for minutes), so it is retried with backoff; if it still fails every rank
        stops with rank 0's reason (CheckpointError), none is left waiting for a broadcast that
        never comes, and nothing is quarantined for the store's fault."""
        outcome = self._rank0_outcome(read, what)
        if outcome[0] == "failed":
            _, reason, away = outcome
            error = StoreUnavailable if away else CheckpointError
            raise error(f"cannot {what}: {reason}; the model is unchanged, and a restart loads "
                        "the newest commit once the storage answers")
        return outcome[1]

    def _rank0_outcome(self, action: Callable[[], T], what: str,
                       retry_if: Callable[[BaseException], bool] = lambda err: True) -> tuple:
        """`action` run by rank 0 with retries, told to every rank: ("ok", its result), or
        ("failed", the reason in one line, whether it was the store's absence)."""
        box: list = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", with_retries(action, what, self.upload_attempts,
                                             retry_if=retry_if, deadline_s=RANK0_DEADLINE_S))
            except Exception as err:  # noqa: BLE001 - told to every rank as one line below
                try:
                    box[0] = ("failed", storage.explain(err, self.uri), storage.unavailable(err))
                except Exception:  # noqa: BLE001 - the reason must reach the other ranks
                    box[0] = ("failed", f"{self.uri}: {type(err).__name__}: {err}", False)
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _fetch(self, step: int, manifest: dict,
               app: AppState) -> tuple[Path, list[str], str | None]:
        """The folder holding what this rank reads of the step (S3: downloaded into this rank's
        own folder), those files, and what went wrong (None: nothing). `.metadata` comes first
        and is verified before it is unpickled; DCP's load plan for `app` on it then names the
        rest. A planning error is left to `dcp.load` to report, as before: everything is fetched."""
        self._clear_restore()
        folder = (self._restore_folder() / step_name(step) if self.remote
                  else Path(self.uri) / step_name(step))
        problem = self._get(step, folder, manifest["files"], [METADATA])
        if problem is not None:
            return folder, [METADATA], problem
        try:
            metadata = read_metadata(folder)
            needed = files_needed(metadata, local_load_plan({"app": app}, metadata))
        except UnsafeCheckpoint as err:   # tampered: never loaded, the commit falls back
            return folder, [METADATA], str(err)
        except Exception as err:  # noqa: BLE001 - dcp.load raises it again, with its context
            log.warning("cannot work out which files of %s rank %d reads (%s: %s): fetching all",
                        step_name(step), self.rank, type(err).__name__, err)
            needed = set(manifest["files"])
        unlisted = sorted(needed - manifest["files"].keys())
        if unlisted:
            return folder, [METADATA], (f"DCP's {METADATA} names {unlisted[0]}, which the "
                                        "manifest does not list")
        rest = sorted(needed - {METADATA})
        return folder, [METADATA, *rest], self._get(step, folder, manifest["files"], rest)

    def _get(self, step: int, folder: Path, files: dict[str, dict],
             names: list[str]) -> str | None:
        """Download (S3) `names` into `folder` and verify their sizes and checksums against the
        manifest's `files`; what is wrong, or None. A file that is not there is not retried: no
        wait makes it appear. Names are manifest names, checked by manifest_problem: no paths."""
        for name in names if self.remote else ():
            try:
                with_retries(lambda n=name: storage.download_file(
                    storage.join(self.uri, step_name(step), n), folder / n),
                    f"download of {name}", self.upload_attempts,
                    retry_if=lambda err: not storage.not_found(err), deadline_s=DOWNLOAD_DEADLINE_S)
            except Exception as err:  # noqa: BLE001 - becomes the commit's problem
                uri = storage.join(self.uri, step_name(step), name)
                self._fetch_outage = storage.unavailable(err)
                return f"{name} cannot be downloaded ({storage.explain(err, uri)})"
        return verify(folder, {name: files[name] for name in names})

    # -- save -----------------------------------------------------------------------------------
    def save(self, app: AppState, step: int, tokens: int, *, wait: bool = False) -> float | None:
        """Start saving `step`; returns the seconds training was blocked (waiting + staging), or
        None when the save was skipped: the previous one is still uploading on some rank (the
        store is slow or down), and waiting for it would stop training for as long as the store
        is away. The next save is due one interval later; `wait` (the last save) always saves."""
        started = time.perf_counter()
        if not wait and not self._previous_save_done():
            if self.rank == 0:
                log.warning("checkpoint of step %d skipped: the save of step %d is still in "
                            "flight (storage slow or unreachable); training goes on", step,
                            self._inflight_step)
            self.last_skip_step, self.last_skip_time = step, time.monotonic()
            return None
        self.wait()
        if self.remote:
            # One staging folder per rank: each rank uploads and then deletes only its own files.
            folder = self.scratch / "staging" / f"rank{self.rank}" / step_name(step)
            shutil.rmtree(folder, ignore_errors=True)
        else:
            folder = Path(self.uri) / step_name(step)
            if self.rank == 0:
                # A save of this step that died earlier may have left shards and rank markers:
                # they must not be mixed into this attempt's manifest. (In S3 the save's thread
                # deletes them: a call to a store that hangs must not stop training.)
                storage.delete_tree(storage.join(self.uri, step_name(step)))
            dist.barrier(group=self.group)
        writer = SplitWriter(str(folder), sync_files=not self.remote)
        if self.spec.async_:
            future = dcp.async_save({"app": app}, storage_writer=writer, process_group=self.group)
        else:
            dcp.save({"app": app}, storage_writer=writer, process_group=self.group)
            future = None
        blocking_s = time.perf_counter() - started
        self.last_save_step, self.last_save_time = step, time.monotonic()
        self._inflight_step = step
        self._inflight = threading.Thread(target=self._finish, name=f"checkpoint-{step}",
                                          args=(step, tokens, folder, future, time.perf_counter()),
                                          daemon=True)
        self._inflight.start()
        if wait or not self.spec.async_:
            self.wait()
            blocking_s = time.perf_counter() - started
        self.last_blocking_s = blocking_s
        return blocking_s

    def restart_cadence(self, step: int) -> None:
        """The state is now `step`'s (a load, a rollback, a snapshot from memory): that counts as
        saved, and skips from before it no longer push the next save back."""
        self.last_save_step = step
        self.last_skip_step, self.last_skip_time = 0, float("-inf")

    @property
    def last_attempt(self) -> tuple[int, float]:
        """(step, monotonic time) of the newest save started, loaded or skipped: when the next
        save is due counts from it."""
        return (max(self.last_save_step, self.last_skip_step),
                max(self.last_save_time, self.last_skip_time))

    def _previous_save_done(self) -> bool:
        """Whether every rank's previous save has finished: each rank knows only its own, and
        all must agree, since a save is collective."""
        mine = self._inflight is None or not self._inflight.is_alive()
        return everyone_ok(mine, self._busy_group)

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def _finish(self, step: int, tokens: int, folder: Path, future, started: float) -> None:
        """Write, upload and mark this rank's part; then every rank learns at once whether every
        part made it (one all-reduce on the checkpoint group), and rank 0 commits only if so. A
        rank whose part failed is never waited for: the save is abandoned everywhere."""
        step_uri = storage.join(self.uri, step_name(step))
        try:
            problem = self._write_part(step, folder, future, step_uri)
            if problem is not None:
                log.error("checkpoint of step %d: rank %d's part failed: %s", step, self.rank,
                          problem)
            if not self._everyone_ok(problem is None):
                log.error("checkpoint of step %d abandoned, not committed: a rank's part failed",
                          step)
            elif self.rank == 0:
                self._commit(step, tokens, step_uri, started)
        except Exception as err:  # noqa: BLE001 - a failed save must not kill training
            log.error("checkpoint of step %d abandoned, not committed: %s", step,
                      storage.explain(err, step_uri))
        finally:
            if self.remote:
                shutil.rmtree(folder, ignore_errors=True)

    def _write_part(self, step: int, folder: Path, future, step_uri: str) -> str | None:
        """This rank's files of `step` written (and in S3 uploaded) and its marker put beside
        them; what went wrong, or None. Every rank passes the same collectives whatever fails."""
        problem = None
        try:
            if future is not None:
                future.result()
            if self.remote and self.rank == 0:
                # What a save of this step that died earlier left (shards, rank markers) must
                # not be mixed into this attempt's manifest.
                storage.delete_tree(step_uri)
        except Exception as err:  # noqa: BLE001 - a failed save must not kill training
            problem = storage.explain(err, step_uri)
        if self.remote:
            try:
                dist.barrier(group=self.group)   # no rank uploads before that deletion is done
            except Exception as err:  # noqa: BLE001 - the all-reduce after it says the rest
                problem = problem or f"the ranks did not meet before the upload ({err})"
        if problem is not None:
            return problem
        try:
            mine = sorted(folder.glob(f"__{self.rank}_*.distcp"))
            if self.rank == 0:
                mine.append(folder / ".metadata")
            files = {p.name: file_digest(p) for p in mine}
            failpoint("before_upload")
            failpoint("upload", self.rank)
            if self.remote:
                for path in mine:
                    with_retries(lambda p=path: storage.upload_file(p, storage.join(step_uri, p.name)),
                                 f"upload of {path.name}", self.upload_attempts)
            marker = {"rank": self.rank, "step": step, "incarnation": self.store.incarnation,
                      "files": files}
            if self._key is not None:  # rank 0 signs only checksums their own ranks vouched for
                marker = sign(marker, self._key, "marker")
            marker = json.dumps(marker).encode()
            with_retries(lambda: storage.write_bytes(storage.join(step_uri, f"rank_{self.rank}.json"),
                                                     marker), "rank marker", self.upload_attempts)
        except Exception as err:  # noqa: BLE001 - a failed save must not kill training
            return storage.explain(err, step_uri)
        return None

    def _commit(self, step: int, tokens: int, step_uri: str, started: float) -> None:
        deadline = time.monotonic() + self.marker_timeout_s
        markers: dict[int, dict] = {}
        while len(markers) < self.world_size:
            for r in range(self.world_size):
                key = storage.join(step_uri, f"rank_{r}.json")
                if r not in markers and storage.exists(key):
                    markers[r] = json.loads(storage.read_bytes(key))
                    # With a key, a marker is signed by the rank that wrote it: someone who can
                    # write the bucket cannot swap a shard and its marker's checksum between the
                    # upload and this commit and have rank 0 sign the swap.
                    problem = (signature_problem(markers[r], self._key, "marker")
                               if self._key is not None else None)
                    if problem is None and self._key is not None and (
                            markers[r].get("rank"), markers[r].get("step"),
                            markers[r].get("incarnation")) != (r, step, self.store.incarnation):
                        problem = "the marker was written for another rank, step or start"
                    if problem is not None:
                        raise CheckpointError(f"rank_{r}.json: {problem}")
            if len(markers) < self.world_size:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(self.world_size)) - set(markers))} "
                                       "never finished their part")
                time.sleep(0.2)
        files = {name: entry for m in markers.values() for name, entry in m["files"].items()}
        failpoint("before_manifest")
        self.store.check_owner(f"commit step {step}")
        manifest = {"format": FORMAT_VERSION, "step": step, "tokens": tokens,
                    "world_size": self.world_size, "time": time.time(), "files": files,
                    "model_hash": self.model_hash, "config_hash": self.config_hash,
                    "incarnation": self.store.incarnation,
                    "global_batch_tokens": self.batch_tokens, **self.batch_notes}
        if self._key is not None:
            manifest = sign(manifest, self._key)
        storage.write_bytes(storage.join(step_uri, MANIFEST), json.dumps(manifest, indent=1).encode())
        commit = Commit(step, tokens, step_uri, manifest["time"], sum(f["size"] for f in files.values()))
        self.last_commit = commit
        log.info("checkpoint step %d committed: %s (%.1f MB)", step, step_uri, commit.bytes / 1e6)
        if self.on_commit is not None:
            self.on_commit(commit, time.perf_counter() - started)
        self.store.prune(step, self.spec.keep, self.spec.keep_every)
