"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et
al. 2021, §2.2): the layers split into consecutive stages, `virtual` of them on each rank of the
mesh's `pp` dimension (rank r holds stages r, r + pp, ...), fed the step's micro-batches by
torch's schedule (`torch.distributed.pipelining`), as torchtitan does
(`distributed/pipeline_parallel.py`).

A rank's model is the model itself with the other ranks' parts left out: its own blocks keep
their places and names (`h.<i>`), the first rank alone has the embeddings and the last alone the
final norm and head. Parameter names are the whole model's, so a checkpoint is one layout for
every pipeline degree (DCP writes each rank's keys; a load reads the keys a rank has), and the
optimizer, the gradient norm and the checkpoint see one model however many stages it runs.

Each of the rank's stages runs as a `StageChunk`: a module over the blocks of that stage (the
same module objects the model holds), the one FSDP root of its share of the parameters, as
torch's schedules expect of a stage (they unshard, reshard and reduce each stage's gradients
themselves).

The step's micro-batches are the accumulation's (`RunShape.accum_steps`): the schedule takes
them as one batch and splits it, and scales the gradients by their count, so the update is the
mean over the step's tokens as without a pipeline. The loss is known on the last stage only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

from crucible.api.layout import schedule_problem
from crucible.trainer.model import GPT


SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe,
             "interleaved1F1B": ScheduleInterleaved1F1B}


class PipelineError(ValueError):
    """A step's micro-batches cannot fill the pipeline."""


class OtherStagesBlock(nn.Module):
    """The place of a block another stage holds: no parameters, its input passes through."""

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        return x


def stage_blocks(layers: int, stages: int, stage: int) -> range:
    """The blocks of `stage` (0-based) of `stages`: an equal, consecutive share of the layers
    (the spec requires `stages` to divide them)."""
    per = layers // stages
    return range(stage * per, (stage + 1) * per)


def rank_stages(rank: int, ranks: int, virtual: int = 1) -> list[int]:
    """The stages pipeline rank `rank` of `ranks` holds, `virtual` of them: r, r + ranks, ...
    (the looped placement of interleaved 1F1B; one stage without interleaving)."""
    return [rank + v * ranks for v in range(virtual)]


def keep_stage(model: GPT, rank: int, ranks: int, virtual: int = 1) -> GPT:
    """Leave out, in place, what pipeline rank `rank` does not hold: the other ranks' blocks,
    the embeddings unless it holds the first stage (rank 0), the final norm and head unless it
    holds the last (the last rank)."""
    stages = ranks * virtual
    owned = {i for stage in rank_stages(rank, ranks, virtual)
             for i in stage_blocks(len(model.h), stages, stage)}
    for i in range(len(model.h)):
        if i not in owned:
            model.h[i] = OtherStagesBlock()
    if rank > 0:
        model.wte = None
        if model.cfg.position == "learned":
            model.wpe = None
    if rank < ranks - 1:
        model.ln_f = None
        model.lm_head = None
    return model


class StageChunk(nn.Module):
    """One stage of a rank's model: its blocks, and the embeddings or the head when it is the
    first or the last stage of all, registered here (the model's own module objects) so that
    FSDP can make this module their root; it runs them through the model's
    `forward_through`."""

    def __init__(self, model: GPT, stage: int, stages: int):
        super().__init__()
        self.stage, self.first, self.last = stage, stage == 0, stage == stages - 1
        self.blocks = nn.ModuleList(model.h[i] for i in stage_blocks(len(model.h), stages, stage))
        ends = []
        if self.first:
            ends += [model.wte] + ([model.wpe] if model.cfg.position == "learned" else [])
        if self.last:
            ends += [model.ln_f, model.lm_head]
        self.ends = nn.ModuleList(ends)
        # Not a child: the model is the parent of these modules, and the checkpoint's view.
        self.__dict__["model"] = model

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.forward_through(x, targets, self.blocks, embed=self.first,
                                          head=self.last)


def stage_chunks(model: GPT, rank: int, ranks: int, virtual: int = 1) -> list[StageChunk]:
    """The stages rank `rank` runs, in order, over `model` as `keep_stage` left it."""
    return [StageChunk(model, stage, ranks * virtual)
            for stage in rank_stages(rank, ranks, virtual)]


def holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


class Pipeline:
    """This rank's stages and the schedule that runs them; `mesh` is the job's device mesh (its
    `pp` dimension is the pipeline), `chunks` the rank's stages in order (`stage_chunks`)."""

    def __init__(self, model: GPT, chunks: list[StageChunk], mesh: DeviceMesh,
                 device: torch.device, schedule: str, activation_dtype: torch.dtype):
        pp = mesh["pp"]
        self.rank, self.ranks = pp.get_local_rank(), pp.size()
        self.group = pp.get_group()
        self.model, self.chunks = model, chunks
        self.device, self.activation_dtype = device, activation_dtype
        self.stages = [PipelineStage(chunk, chunk.stage, self.ranks * len(chunks), device,
                                     group=self.group) for chunk in chunks]
        self.is_last = chunks[-1].last
        self.schedule_name = schedule
        # One schedule per micro-batch count: a batch ramp changes the count as the run goes.
        self.schedules: dict[int, object] = {}

    def describe(self) -> str:
        layers = [i for chunk in self.chunks for i in stage_blocks(
            len(self.model.h), self.ranks * len(self.chunks), chunk.stage)]
        return (f"pipeline: {self.schedule_name}, {self.ranks * len(self.chunks)} stages on "
                f"{self.ranks} ranks; this rank holds stage(s) "
                f"{', '.join(str(c.stage) for c in self.chunks)}, layers "
                f"{', '.join(map(str, layers))}")

    def check(self, micro_batches: int) -> None:
        """PipelineError when the schedule cannot run a step of `micro_batches` micro-batches
        (`schedule_problem`)."""
        problem = schedule_problem(self.schedule_name, self.ranks, micro_batches)
        if problem:
            raise PipelineError(
                f"{problem}: change training.globalBatchTokens (or batchRamp.startTokens) or "
                "training.microBatch so that every step has at least one micro-batch per "
                "pipeline rank" + (", in rounds that divide them" if self.schedule_name ==
                                   "interleaved1F1B" else ""))

    def schedule(self, micro_batches: int):
        """The schedule for a step of `micro_batches` micro-batches (made once per count)."""
        self.check(micro_batches)
        if micro_batches not in self.schedules:
            stages = self.stages if len(self.stages) > 1 or self.schedule_name == \
                "interleaved1F1B" else self.stages[0]
            self.schedules[micro_batches] = SCHEDULES[self.schedule_name](
                stages, micro_batches, loss_fn=self.model.loss_fn, scale_grads=True)
        return self.schedules[micro_batches]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   micro_batches: int) -> torch.Tensor:
        """Forward and backward of the step's `micro_batches` micro-batches, stacked (B·m, T);
        this rank's share of the pipeline's mean loss, a 0-dim tensor on the device: the mean
        times the pipeline ranks on the last rank, zero elsewhere, so that a mean over every
        rank is the loss."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.rank == 0 else ()
        # return_outputs=False: the loss comes back through `losses`; returning outputs would
        # keep every micro-batch's logits on the last stage until the next step begins (the
        # stage's `output_chunks`, cleared only then), m·b·s·V values through the update.
        self.schedule(micro_batches).step(*args, target=targets if self.is_last else None,
                                          losses=losses, return_outputs=False)
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean() * self.ranks

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only (held-out eval), in `train_step`'s share.
        Activations go stage to stage, rank to rank (from the last rank back to the first
        between an interleaved pipeline's rounds), by point-to-point send and receive, their
        shape first: under tensor parallelism a stage's output is this rank's slice of the
        sequence."""
        out = torch.zeros((), device=self.device)
        for chunk in self.chunks:
            if chunk.first:
                x = inputs
            else:
                source = (self.rank - 1) % self.ranks
                shape = torch.empty(3, dtype=torch.int64, device=self.device)
                dist.recv(shape, group=self.group, group_src=source)
                x = torch.empty(shape.tolist(), dtype=self.activation_dtype, device=self.device)
                dist.recv(x, group=self.group, group_src=source)
            out = chunk(x, targets if chunk.last else None)
            if not chunk.last:
                out = out.to(self.activation_dtype).contiguous()
                dest = (self.rank + 1) % self.ranks
                dist.send(torch.tensor(out.shape, dtype=torch.int64, device=self.device),
                          group=self.group, group_dst=dest)
                dist.send(out, group=self.group, group_dst=dest)
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return out.detach() * self.ranks
