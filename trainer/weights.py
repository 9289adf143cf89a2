"""A committed checkpoint's model weights, read outside training (`crucible eval`, `export`).

Builds the job's model exactly as training does (meta device, sharded, materialised: so a reader
runs under torchrun on any world size) and loads only the model's part of a commit
(`app.model.*`) through the `Checkpointer`, verified like a resume (manifest, checksums,
signature). The optimizer's state is never read: DCP loads only the keys asked for, and each rank
fetches and verifies only the files that hold them (checkpoint_fetch.py). A reader never claims
the checkpoint URI, so it runs beside the training job. Must not: decide what the reader does
with the weights.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)

from crucible.trainer import parallel
from crucible.trainer.checkpoint import Checkpointer, job_hashes
from crucible.trainer.model import GPT


class NoCommit(LookupError):
    """No committed checkpoint is there to read; the message says what was looked for."""


class ModelWeights:
    """Only the model's part of the checkpoint (a `Stateful` under the AppState's `model` key)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])


def load_committed(cfg, env: parallel.DistEnv, *, step: int | None = None,
                   exact: bool = False) -> tuple[GPT, dict]:
    """The job's model (sharded over the process group) holding the newest commit under
    `checkpoint.uri` at or below `step` (exactly `step` if `exact`), and that commit's manifest.
    Raises NoCommit when there is none; CheckpointError when it cannot be used."""
    uri = cfg.checkpoint.uri
    model_hash, config_hash = job_hashes(cfg)
    ckpt = Checkpointer(cfg.checkpoint, job=cfg.name, rank=env.rank, world_size=env.world_size,
                        local_rank=env.local_rank, model_hash=model_hash, config_hash=config_hash,
                        read_only=True)
    if exact and step is not None:
        found = ckpt.newest_committed(step)  # the listing only: no bytes read yet
        if found != step:
            raise NoCommit(f"step {step} is not a committed checkpoint under {uri}"
                           + (f" (the newest before it is step {found})" if found else ""))
    model = parallel.build_sharded_model(cfg.model.to_arch(), env, parallel.build_mesh(env),
                                         precision=cfg.training.precision, seed=cfg.training.seed)
    manifest = ckpt.load(ModelWeights(model), max_step=step)
    if manifest is None:
        raise NoCommit(f"no committed checkpoint under {uri}"
                       + (f" at or below step {step}" if step is not None else ""))
    if exact and step is not None and manifest["step"] != step:
        raise NoCommit(f"step {step} under {uri} cannot be loaded (the log says why)")
    return model, manifest


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state as plain CPU tensors on rank 0 (one gather per tensor; the other
    ranks get an empty dict, so no host holds the model twice over)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
