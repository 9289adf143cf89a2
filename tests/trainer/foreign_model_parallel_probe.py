"""Tensor and pipeline parallelism over the foreign device (tests/support/foreign_device.py, a
stand-in for a GPU): the trainer's model-parallel step on two ranks, each layout also run on
the host (a CPU mesh of the same process group) to compare against. Run under torchrun by
test_foreign_device.py; each rank writes one JSON list of results per path.

    torchrun --nproc-per-node=2 -m tests.trainer.foreign_model_parallel_probe <work folder>

Layouts, two ranks each (one data-parallel rank): tensor 2 (`llama-tiny`: the
vocabulary-parallel loss, sequence-parallel norms, the row-wise embedding); pipeline 2 under
1F1B; pipeline 2 x 2 stages a rank under interleaved 1F1B (`llama-tiny` with 4 layers). A step is
the loop's: two micro-batches, the global gradient norm over the stages, the packed all-reduce,
fused AdamW.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.support.foreign_device import FOREIGN, foreign_device
from tests.trainer.foreign_fsdp_probe import _env, _gap, _placement, _shards
from tests.trainer.foreign_probe import _result, write_rank_results

LAYOUTS = {"tp": {"tensor": 2}, "pp": {"pipeline": 2},
           "interleaved": {"pipeline": 2, "schedule": "interleaved1F1B", "virtual_stages": 2}}
MICRO_BATCHES, SEQ = 2, 32


def _build(device: torch.device, name: str):
    """The layout's model, optimizer and (under a pipeline) `Pipeline` on `device`."""
    from crucible.api import arch
    from crucible.api.layout import layout
    from crucible.api.spec import ParallelismSpec, TrainingSpec
    from crucible.trainer import optim, parallel, pipeline

    par = ParallelismSpec(**LAYOUTS[name])
    env = _env(device)
    mesh = parallel.build_mesh(env, layout("fsdp", None, world_size=env.world_size,
                                           local_world_size=env.local_world_size,
                                           tensor=par.tensor, pipeline=par.pipeline))
    cfg = arch.PRESETS["llama-tiny"]
    if par.virtual_stages > 1:
        cfg = dataclasses.replace(cfg, layers=4)
    model = parallel.build_sharded_model(cfg, env, mesh, precision="bf16", seed=7,
                                         virtual_stages=par.virtual_stages)
    optimizer = optim.build_optimizer(model, TrainingSpec(tokens=1e6))
    pipe = (pipeline.Pipeline(model, model.pipeline_chunks, mesh, device, par.schedule,
                              torch.bfloat16) if par.pipeline > 1 else None)
    return env, cfg, model, optimizer, pipe, par


def _batch(cfg, device: torch.device, seed: int) -> torch.Tensor:
    """The step's micro-batches, stacked (2, m·2, T): the same on both ranks (they are one
    data-parallel rank), made before the step's syncs are counted."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (2, MICRO_BATCHES * 2, SEQ), generator=gen).to(device)


def _step(built, tokens: torch.Tensor) -> float:
    """One step as the loop takes it; the loss read back from the packed all-reduce."""
    from crucible.trainer import optim, parallel, tensor_parallel

    env, _, model, optimizer, pipe, par = built
    with tensor_parallel.loss_context(par.tensor > 1):
        if pipe is not None:
            loss = pipe.train_step(tokens[0], tokens[1], MICRO_BATCHES)
        else:
            loss = sum(model(i, t) for i, t in zip(tokens[0].chunk(MICRO_BATCHES),
                                                    tokens[1].chunk(MICRO_BATCHES)))
            loss.backward()
            loss = loss.detach() / MICRO_BATCHES
    norm = optim.clip_grad_norm(model, 1.0, pipeline_group=pipe and pipe.group)
    pending = parallel.launch_sums([loss.detach(), norm, 0.0, 0.0], env.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sums, _ = pending.read()
    return sums[0] / env.world_size


def _eval_loss(built, tokens: torch.Tensor) -> float:
    from crucible.trainer import tensor_parallel

    env, _, model, _, pipe, par = built
    with tensor_parallel.loss_context(par.tensor > 1):
        loss = (pipe.forward_loss(tokens[0], tokens[1]) if pipe is not None
                else model(tokens[0], tokens[1]).detach())
    dist.all_reduce(loss)
    return float(loss) / env.world_size


def main(work: Path) -> None:
    dist.init_process_group("cpu:gloo,foreign:gloo")
    results = []
    with foreign_device() as dev:
        for name in LAYOUTS:
            def run(name=name):
                device, host = _build(FOREIGN, name), _build(torch.device("cpu"), name)
                losses, host_losses, syncs = [], [], []
                for seed in (1, 2):
                    tokens = _batch(device[1], FOREIGN, seed)
                    mark = dev.mark()
                    losses.append(_step(device, tokens))
                    syncs.append([f"{s.kind} {s.op}" for s in dev.since(mark)])
                    host_losses.append(_step(host, _batch(host[1], torch.device("cpu"), seed)))
                # Before the eval: its forward leaves the FSDP roots' parameters gathered
                # (they are not resharded after forward) until the next step or save.
                placement = _placement(device[2], device[3])
                tokens = _batch(device[1], FOREIGN, 3)
                mark = dev.mark()
                evaluated = _eval_loss(device, tokens)
                eval_syncs = [f"{s.kind} {s.op}" for s in dev.since(mark)]
                return {"placement": placement, "losses": losses,
                        "host_losses": host_losses, "syncs": syncs,
                        "eval": evaluated,
                        "host_eval": _eval_loss(host, _batch(host[1], torch.device("cpu"), 3)),
                        "eval_syncs": eval_syncs,
                        "max_update_gap": _gap(_shards(device[2]), _shards(host[2]))}

            results.append(_result(name, run))
    write_rank_results(work, "model_parallel", results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
