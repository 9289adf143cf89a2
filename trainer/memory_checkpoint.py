"""In-memory checkpoints replicated to a peer node: a restart restores in seconds, without S3.

Gemini (Wang et al., SOSP'23) restores from copies of the training state held in the host
memory of peer machines instead of remote storage; DLRover's flash checkpoints and GKE's
multi-tier checkpoints do the same. Here, every `checkpoint.inMemoryEverySteps` steps:

1. each rank copies its own shard of the state (model, optimizer, loop state: what DCP saves) to
   host memory: the only part training waits for;
2. a background thread writes it as `step_<N>/rank_<r>.pt` into a folder on a memory filesystem
   that outlives the training process (`CRUCIBLE_MEMORY_DIR`, default `/dev/shm/crucible`; in a
   pod, an emptyDir of medium Memory), and sends a copy to its ring peer, the same local rank on
   the next node, which writes it beside its own. A checksum marker is written after each file,
   so a torn write is never read.

On a restart every rank reports what its node's folder holds; `plan_restore` (pure) picks the
newest step of which every shard survived somewhere (same world size, same model) and says
which shards travel from which rank; a rank whose shard is in its own folder reads it there
("memory"), one on a replaced node receives it from a rank that holds it ("peer"). If any shard
of every step is gone (a node and its peer lost together), or a rank fails to load, every rank
learns it and the caller restores from S3 instead. The tier needs the same world size and the
same device mesh (a rank's shard under FSDP over 4 ranks is not its shard under HSDP's 2 x 2),
so an elastic restart at another size, or with another sharding, reads S3 (DCP reshards; this
tier does not).

Trust: the folder is the pod's own memory and the copies come from the job's own ranks; files are
still loaded with `weights_only=True` (tensors, plain values and DTensor placements only).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from crucible.trainer.checkpoint import CheckpointError, everyone_ok

log = logging.getLogger(__name__)

MEMORY_DIR_ENV = "CRUCIBLE_MEMORY_DIR"
DEFAULT_MEMORY_DIR = "/dev/shm/crucible"


# --- pure: where copies go and what a restore reads ----------------------------------------------
def ring_peer(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank that keeps a copy of `rank`'s shard: the same local rank on the next node, so a
    node lost takes no shard's both copies (unless its next node goes too). None on one node."""
    if world_size <= local_world_size:
        return None
    return (rank + local_world_size) % world_size


@dataclass(frozen=True)
class Held:
    """A shard a node's folder holds, as a rank reports it."""

    step: int
    shard: int        # the rank the shard belongs to
    world_size: int
    model_hash: str
    xxh3: str
    notes: str = "{}"  # JSON the snapshot was given (the same for every shard of a step)
    mesh_shape: tuple[int, ...] = ()  # the device mesh it was taken on; () = 1-D over the world


@dataclass(frozen=True)
class RestorePlan:
    step: int
    transfers: tuple[tuple[int, int], ...]   # (from rank, to rank) of the to-rank's own shard
    digests: tuple[str, ...]                 # each shard's checksum, by rank
    notes: str = "{}"

    @property
    def source(self) -> str:
        return "peer" if self.transfers else "memory"


def plan_restore(holdings: list[list[Held]], world_size: int, model_hash: str,
                 max_step: int | None = None, min_step: int = 0,
                 mesh_shape: tuple[int, ...] = ()) -> RestorePlan | None:
    """The newest step at or below `max_step` (and at or above `min_step`) whose every shard is
    held by some rank's node, for this world size, device mesh and model; None if there is none.
    A mesh of () means 1-D over the world (what snapshots written before meshes were recorded
    were taken on). Each rank
    reads its own shard from its own folder when it is there; otherwise the lowest rank holding it
    sends it. `holdings[r]` is what rank r's node folder holds."""
    by_step: dict[int, dict[int, dict[str, list[int]]]] = {}
    mesh = mesh_shape or (world_size,)
    for rank, held in enumerate(holdings):
        for h in held:
            if (h.world_size != world_size or (h.mesh_shape or (h.world_size,)) != mesh
                    or h.model_hash != model_hash or not 0 <= h.shard < world_size):
                continue
            by_step.setdefault(h.step, {}).setdefault(h.shard, {}).setdefault(h.xxh3, []).append(rank)
    for step in sorted(by_step, reverse=True):
        if step < min_step or (max_step is not None and step > max_step):
            continue
        shards = by_step[step]
        if len(shards) < world_size or any(len(copies) != 1 for copies in shards.values()):
            continue  # a shard missing, or two copies that disagree: not this step
        transfers, digests = [], []
        notes = next(h.notes for held in holdings for h in held if h.step == step)
        for shard in range(world_size):
            (digest, ranks), = shards[shard].items()
            digests.append(digest)
            if shard not in ranks:
                transfers.append((min(ranks), shard))
        return RestorePlan(step, tuple(transfers), tuple(digests), notes)
    return None


# --- state <-> bytes ------------------------------------------------------------------------------
@dataclass
class LocalShard:
    """A DTensor's local part with what rebuilds it on the same mesh."""

    tensor: torch.Tensor
    placements: tuple
    shape: tuple
    stride: tuple


@dataclass
class HostTensor:
    """A tensor that was on the host when snapshotted (the RNG state; AdamW's step counts on the
    CPU): a restore leaves it there instead of moving it to the compute device."""

    tensor: torch.Tensor


torch.serialization.add_safe_globals([LocalShard, HostTensor, Shard, Replicate, Partial])


def to_host(state):
    """A copy of `state` on the host: DTensors as their local shards, tensors cloned (those on
    the host already marked so), the rest deep-copied, so training can go on changing the
    originals."""
    if isinstance(state, DTensor):
        return LocalShard(state.to_local().detach().to("cpu", copy=True), tuple(state.placements),
                          tuple(state.shape), tuple(state.stride()))
    if isinstance(state, torch.Tensor):
        copied = state.detach().to("cpu", copy=True)
        return HostTensor(copied) if state.device.type == "cpu" else copied
    if isinstance(state, dict):
        return {k: to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_host(v) for v in state)
    return copy.deepcopy(state)


def from_host(state, mesh, device: torch.device):
    """Inverse of `to_host` on this rank: local shards become DTensors on `mesh` again, each
    tensor goes back to where it was taken from (`device`, or the host)."""
    if isinstance(state, LocalShard):
        return DTensor.from_local(state.tensor.to(device), mesh, state.placements, run_check=False,
                                  shape=torch.Size(state.shape), stride=state.stride)
    if isinstance(state, HostTensor):
        return state.tensor
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: from_host(v, mesh, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(from_host(v, mesh, device) for v in state)
    return state


def _digest(data: bytes | memoryview) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class RestoreReport:
    step: int
    source: str           # "memory" (every rank's own folder) or "peer" (some shards sent)
    seconds: float
    local_bytes: int      # summed over ranks
    peer_bytes: int
    notes: dict


# --- the tier ---------------------------------------------------------------------------------------
class MemoryTier:
    """One rank's part: snapshots into its node's memory folder, copies to its ring peer, and
    restores from what survived."""

    def __init__(self, *, job: str, rank: int, world_size: int, local_world_size: int,
                 model_hash: str, mesh_shape: tuple[int, ...] = (), keep: int = 2,
                 root: str | None = None, timeout_s: float = 300.0):
        self.rank, self.world_size = rank, world_size
        self.mesh_shape = tuple(mesh_shape) or (world_size,)
        self.model_hash, self.keep = model_hash, max(1, keep)
        self.peer = ring_peer(rank, world_size, local_world_size)
        self.source_rank = (None if self.peer is None
                            else (rank - local_world_size) % world_size)  # whose copy I keep
        self.folder = Path(root or os.environ.get(MEMORY_DIR_ENV) or DEFAULT_MEMORY_DIR) / job
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(
                f"checkpoint.inMemoryEverySteps needs a writable folder in memory, and "
                f"{self.folder} is not ({err.strerror}): set {MEMORY_DIR_ENV} to one (a tmpfs "
                "such as /dev/shm), or set checkpoint.inMemoryEverySteps to 0") from None
        # Its own gloo group: the copies travel from a background thread, beside the training
        # group's collectives and DCP's (a CPU group also under NCCL: the copies are host bytes).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._inflight: threading.Thread | None = None
        self._notes = "{}"
        self.last_snapshot_step = 0
        self.last_blocking_s = 0.0

    # -- snapshot ------------------------------------------------------------------------------
    def snapshot(self, app, step: int, notes: dict | None = None) -> float:
        """Copy this rank's state to host memory (blocking), then write and replicate it in the
        background; `notes` (JSON values) come back with a restore. Returns the seconds training
        waited."""
        started = time.perf_counter()
        self.wait()
        host = to_host(app.state_dict())
        self.last_blocking_s = time.perf_counter() - started
        self.last_snapshot_step = step
        self._notes = json.dumps(notes or {}, sort_keys=True)
        self._inflight = threading.Thread(target=self._write_and_copy, args=(host, step),
                                          name=f"memory-snapshot-{step}", daemon=True)
        self._inflight.start()
        return self.last_blocking_s

    def wait(self) -> None:
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None

    def _write_and_copy(self, host: dict, step: int) -> None:
        payload: memoryview | bytes = b""
        try:
            buffer = io.BytesIO()
            torch.save(host, buffer)
            payload = buffer.getbuffer()
            self._write(step, self.rank, payload)
        except Exception as err:  # noqa: BLE001 - a lost snapshot must not stop training
            log.error("in-memory snapshot of step %d failed on rank %d: %s", step, self.rank, err)
        if self.peer is None:
            return
        try:
            # Exchanged even when this rank's write failed (an empty copy says so), so a peer
            # never waits for a copy that will not come.
            received = self._exchange(payload)
            if len(received):
                self._write(step, self.source_rank, received)
            self._prune()
        except Exception as err:  # noqa: BLE001 - a lost copy must not stop training
            log.error("in-memory copy of step %d failed on rank %d: %s", step, self.rank, err)

    def _exchange(self, payload) -> memoryview:
        """Send my shard to my ring peer and receive the shard I keep, sizes first."""
        out_size, in_size = torch.tensor([len(payload)]), torch.zeros(1, dtype=torch.int64)
        for req in (dist.isend(out_size, self.peer, group=self.group),
                    dist.irecv(in_size, self.source_rank, group=self.group)):
            req.wait()
        outgoing = (torch.frombuffer(payload, dtype=torch.uint8) if len(payload)
                    else torch.empty(0, dtype=torch.uint8))
        incoming = torch.empty(int(in_size.item()), dtype=torch.uint8)
        reqs = []
        if len(payload):
            reqs.append(dist.isend(outgoing, self.peer, group=self.group))
        if incoming.numel():
            reqs.append(dist.irecv(incoming, self.source_rank, group=self.group))
        for req in reqs:
            req.wait()
        return memoryview(incoming.numpy()).cast("B")

    def _write(self, step: int, shard: int, payload) -> None:
        """The file, then its marker (both by rename): a marker always describes a whole file."""
        folder = self.folder / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / f"rank_{shard}.pt"
        with open(f"{data}.tmp", "wb") as f:
            f.write(payload)
        os.replace(f"{data}.tmp", data)
        marker = {"step": step, "shard": shard, "world_size": self.world_size,
                  "mesh_shape": list(self.mesh_shape), "model_hash": self.model_hash,
                  "xxh3": _digest(payload), "size": len(payload), "notes": self._notes}
        (folder / f"rank_{shard}.json.tmp").write_text(json.dumps(marker))
        os.replace(folder / f"rank_{shard}.json.tmp", folder / f"rank_{shard}.json")

    def _prune(self) -> None:
        """Keep the newest `keep` steps (two nodes' ranks may write one folder: only whole steps
        older than every rank's newest are removed, and removing is idempotent)."""
        steps = sorted(self._steps(), reverse=True)
        for step in steps[self.keep:]:
            shutil.rmtree(self.folder / f"step_{step}", ignore_errors=True)

    def _steps(self) -> list[int]:
        found = []
        for entry in self.folder.glob("step_*"):
            suffix = entry.name.removeprefix("step_")
            if suffix.isdigit():
                found.append(int(suffix))
        return found

    def discard_after(self, step: int) -> None:
        """Forget snapshots newer than `step` (a rollback abandoned them)."""
        self.wait()
        for s in self._steps():
            if s > step:
                shutil.rmtree(self.folder / f"step_{s}", ignore_errors=True)
        dist.barrier(group=self.group)

    def clear(self) -> None:
        """Free the memory when the run is over (a finished job has nothing to restart)."""
        self.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- restore -------------------------------------------------------------------------------
    def holdings(self) -> list[Held]:
        held = []
        for step in self._steps():
            for marker in (self.folder / f"step_{step}").glob("rank_*.json"):
                try:
                    m = json.loads(marker.read_text())
                    held.append(Held(int(m["step"]), int(m["shard"]), int(m["world_size"]),
                                     str(m["model_hash"]), str(m["xxh3"]),
                                     str(m.get("notes", "{}")),
                                     tuple(int(n) for n in m.get("mesh_shape", ()))))
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # unreadable: as if absent
        return held

    def restore(self, app, mesh, device: torch.device, max_step: int | None = None,
                min_step: int = 0) -> RestoreReport | None:
        """Load the newest step every shard of which survived (see `plan_restore`) into `app`;
        None, on every rank, when there is none or any rank could not load its shard."""
        started = time.perf_counter()
        self.wait()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, self.holdings(), group=self.group)
        plan = plan_restore(gathered, self.world_size, self.model_hash, max_step, min_step,
                            self.mesh_shape)
        if plan is None:
            return None
        problem, payload, size, received = None, None, 0, 0
        own = self.folder / f"step_{plan.step}" / f"rank_{self.rank}.pt"
        try:
            for src, dst in plan.transfers:   # the same order on every rank: no deadlock
                if self.rank == src:
                    self._send_shard(plan.step, dst)
                elif self.rank == dst:
                    payload = self._receive_shard(src)
                    size = received = len(payload)
            if payload is None:
                # Checked through a read-only map of the file, which the load below maps again:
                # the shard is read once, never copied into a bytes object.
                with open(own, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    digest, size = _digest(m), len(m)
            else:
                digest = _digest(payload)
            if digest != plan.digests[self.rank]:
                raise ValueError("checksum mismatch")
        except Exception as err:  # noqa: BLE001 - every rank learns it below
            problem = f"rank {self.rank}: {type(err).__name__}: {err}"
        state = None
        if problem is None:
            try:
                # A local shard is mapped copy-on-write (tmpfs pages shared until written).
                state = (torch.load(own, mmap=True, weights_only=True) if payload is None
                         else torch.load(io.BytesIO(payload), weights_only=True))
            except Exception as err:  # noqa: BLE001 - every rank learns it below
                problem = f"rank {self.rank}: cannot unpickle its shard: {err}"
        if not everyone_ok(problem is None, self.group):
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=self.group)
            log.warning("in-memory restore of step %d abandoned (%s): restoring from storage",
                        plan.step, "; ".join(p for p in problems if p))
            return None
        app.load_state_dict(from_host(state, mesh, device))
        sizes = torch.tensor([size - received, received])
        dist.all_reduce(sizes, group=self.group)
        self.last_snapshot_step = plan.step
        return RestoreReport(plan.step, plan.source, time.perf_counter() - started,
                             int(sizes[0]), int(sizes[1]), json.loads(plan.notes))

    def _send_shard(self, step: int, dst: int) -> None:
        """Send `dst`'s shard; a shard this rank cannot read is sent as size -1, so `dst` fails
        at once instead of waiting for the group's timeout."""
        try:
            data = (self.folder / f"step_{step}" / f"rank_{dst}.pt").read_bytes()
        except OSError:
            dist.send(torch.tensor([-1]), dst, group=self.group)
            raise
        dist.send(torch.tensor([len(data)]), dst, group=self.group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=self.group)

    def _receive_shard(self, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        if size.item() < 0:
            raise OSError(f"rank {src} could not read the shard it holds")
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.group)
        return data.numpy().tobytes()
