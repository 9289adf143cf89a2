"""The allocator's fullest point in one whole training step, per layout, on two gloo ranks: run
under torchrun by test_step_memory.py; each rank writes one JSON object per case.

    torchrun --nproc-per-node=2 -m tests.trainer.step_memory_probe <work folder>

A case is the trainer's own model, sharding and optimizer (`parallel.build_sharded_model`,
`optim.build_optimizer`, `pipeline.Pipeline`) in bf16 mixed precision, and a step as the loop
takes it: the micro-batches' forwards and backwards (the pipeline's schedule under pipeline
parallelism), the clipped gradient norm, the fused AdamW step, the gradients freed. After two
warm-up steps (the optimizer's states exist), the next five are measured: the bytes that
existed before them (parameters, buffers, optimizer states) and the allocator's peak beyond
them during each (`allocator_peak`, its allocation and free events in time order).

The same step's peak differs from one step to the next under FSDP: gloo runs the collectives
on a thread of its own, and how many blocks' gathered parameters are alive at once depends on
when it finishes them (measured: 105 to 133 MB for the "fsdp" case, in steps of one block's
3.1 MB, where the least recurs in most steps). On a GPU the streams' events order the same
frees. The test takes the least of the five, the step's own need.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer.test_activation_memory import allocator_peak

SEQ, BATCH = 256, 2
MEASURED_STEPS = 5
# name: (parallelism, activation checkpointing, model, micro-batches a step)
CASES = {
    "fsdp": ({}, "none", "blocks", 2),
    "tensor": ({"tensor": 2}, "none", "blocks", 2),
    "pipeline": ({"pipeline": 2}, "none", "blocks", 2),
    "interleaved": ({"pipeline": 2, "schedule": "interleaved1F1B", "virtual_stages": 2},
                    "none", "blocks", 4),
    "pipeline-full-ac-loss": ({"pipeline": 2}, "full", "logits", 2),
}


def config(kind: str):
    """A Llama-style model of four blocks whose blocks ("blocks": a 512-token vocabulary) or
    whose loss ("logits": 8192) weigh most."""
    from crucible.api import arch

    base = dataclasses.replace(arch.PRESETS["llama-tiny"], layers=4, seq_len=SEQ,
                               tied_embeddings=False, kv_heads=2)
    if kind == "blocks":
        return dataclasses.replace(base, dim=384, heads=6, d_ff=1024, vocab_size=512)
    return dataclasses.replace(base, dim=256, heads=4, d_ff=768, vocab_size=8192)


def _bytes_held(tensors) -> int:
    storages = {}
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def measure(name: str) -> dict:
    from crucible.api.layout import layout
    from crucible.api.spec import ParallelismSpec, TrainingSpec
    from crucible.trainer import optim, parallel, pipeline, tensor_parallel

    spec, recompute, kind, micro_batches = CASES[name]
    par = ParallelismSpec(**spec)
    env = parallel.DistEnv(dist.get_rank(), dist.get_world_size(),
                           int(os.environ["LOCAL_RANK"]), torch.device("cpu"), "gloo",
                           int(os.environ["LOCAL_WORLD_SIZE"]))
    mesh = parallel.build_mesh(env, layout("fsdp", None, world_size=env.world_size,
                                           local_world_size=env.local_world_size,
                                           tensor=par.tensor, pipeline=par.pipeline))
    cfg = config(kind)
    model = parallel.build_sharded_model(cfg, env, mesh, precision="bf16", seed=7,
                                         activation_checkpointing=recompute,
                                         virtual_stages=par.virtual_stages)
    optimizer = optim.build_optimizer(model, TrainingSpec(tokens=1e6))
    pipe = (pipeline.Pipeline(model, model.pipeline_chunks, mesh, env.device, par.schedule,
                              torch.bfloat16) if par.pipeline > 1 else None)
    tokens = torch.randint(0, cfg.vocab_size, (2, micro_batches * BATCH, SEQ),
                           generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with tensor_parallel.loss_context(par.tensor > 1):
            if pipe is not None:
                pipe.train_step(tokens[0], tokens[1], micro_batches)
            else:
                for inputs, targets in zip(tokens[0].chunk(micro_batches),
                                           tokens[1].chunk(micro_batches)):
                    (model(inputs, targets) / micro_batches).backward()
        optim.clip_grad_norm(model, 1.0, pipeline_group=pipe and pipe.group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    gc.collect()
    states = [value for state in optimizer.state.values() for value in state.values()
              if torch.is_tensor(value)]
    before = _bytes_held([*model.parameters(), *model.buffers(), *states])
    return {"before": before, "peaks": [allocator_peak(step) for _ in range(MEASURED_STEPS)]}


def main(work: Path) -> None:
    dist.init_process_group("gloo")
    # One thread: the CPU's kernels take per-thread working buffers from the same allocator,
    # which a GPU's do not (test_activation_memory.py).
    torch.set_num_threads(1)
    results = {name: measure(name) for name in CASES}
    (work / f"step_memory.{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
