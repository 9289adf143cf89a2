"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021, §2.2): the
layers split into consecutive stages, one per rank of the mesh's `pp` dimension, fed the step's
micro-batches by torch's schedule (`torch.distributed.pipelining`), as torchtitan does
(`distributed/pipeline_parallel.py`).

Each stage is the model itself with the other stages' parts left out: its own blocks keep their
places and names (`h.<i>`), the first stage alone has the embeddings and the last alone the final
norm and head. Parameter names are the whole model's, so a checkpoint is one layout for every
pipeline degree (DCP writes each stage's keys; a load reads the keys a stage has).

The step's micro-batches are the accumulation's (`RunShape.accum_steps`): the schedule takes
them as one batch and splits it, and scales the gradients by their count, so the update is the
mean over the step's tokens as without a pipeline. The loss is known on the last stage only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from crucible.trainer.model import GPT


SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}


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


def keep_stage(model: GPT, stage: int, stages: int) -> GPT:
    """Leave out, in place, what `stage` does not hold: the other stages' blocks, the embeddings
    unless it is the first, the final norm and head unless it is the last."""
    owned = stage_blocks(len(model.h), stages, stage)
    for i in range(len(model.h)):
        if i not in owned:
            model.h[i] = OtherStagesBlock()
    if stage > 0:
        model.wte = None
        if model.cfg.position == "learned":
            model.wpe = None
    if stage < stages - 1:
        model.ln_f = None
        model.lm_head = None
    return model


def holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


class Pipeline:
    """This rank's stage and the schedule that runs it; `mesh` is the job's device mesh (its
    `pp` dimension is the pipeline)."""

    def __init__(self, model: GPT, mesh: DeviceMesh, device: torch.device, schedule: str,
                 activation_dtype: torch.dtype):
        pp = mesh["pp"]
        self.stage_index, self.stages = pp.get_local_rank(), pp.size()
        self.group = pp.get_group()
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.stages - 1
        self.model, self.device, self.activation_dtype = model, device, activation_dtype
        self.stage = PipelineStage(model, self.stage_index, self.stages, device, group=self.group)
        self.schedule_name = schedule
        # One schedule per micro-batch count: a batch ramp changes the count as the run goes.
        self.schedules: dict[int, object] = {}

    def schedule(self, micro_batches: int):
        """The schedule for a step of `micro_batches` micro-batches (made once per count);
        PipelineError when they cannot give every stage one."""
        if micro_batches < self.stages:
            raise PipelineError(
                f"a step of {micro_batches} micro-batch(es) per data-parallel rank cannot fill "
                f"{self.stages} pipeline stages: raise training.globalBatchTokens (or "
                "batchRamp.startTokens), or lower training.microBatch, so that each step has at "
                "least one micro-batch per stage")
        if micro_batches not in self.schedules:
            self.schedules[micro_batches] = SCHEDULES[self.schedule_name](
                self.stage, micro_batches, loss_fn=self.model.loss_fn, scale_grads=True)
        return self.schedules[micro_batches]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   micro_batches: int) -> torch.Tensor:
        """Forward and backward of the step's `micro_batches` micro-batches, stacked (B·m, T);
        this rank's share of the pipeline's mean loss, a 0-dim tensor on the device: the mean
        times the stages on the last stage, zero elsewhere, so that a mean over every rank is
        the loss."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        # return_outputs=False: the loss comes back through `losses`; returning outputs would
        # keep every micro-batch's logits on the last stage until the next step begins (the
        # stage's `output_chunks`, cleared only then), m·b·s·V values through the update.
        self.schedule(micro_batches).step(*args, target=targets if self.is_last else None,
                                          losses=losses, return_outputs=False)
        if not self.is_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).mean() * self.stages

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of one batch, forward only (held-out eval), in `train_step`'s share.
        Activations go stage to stage by point-to-point send and receive, their shape first:
        under tensor parallelism a stage's output is this rank's slice of the sequence."""
        if self.is_first:
            x = inputs
        else:
            shape = torch.empty(3, dtype=torch.int64, device=self.device)
            dist.recv(shape, group=self.group, group_src=self.stage_index - 1)
            x = torch.empty(shape.tolist(), dtype=self.activation_dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.stage_index - 1)
        out = self.model(x, targets if self.is_last else None)
        if not self.is_last:
            out = out.to(self.activation_dtype).contiguous()
            dist.send(torch.tensor(out.shape, dtype=torch.int64, device=self.device),
                      group=self.group, group_dst=self.stage_index + 1)
            dist.send(out, group=self.group, group_dst=self.stage_index + 1)
            return torch.zeros((), device=self.device)
        return out.detach() * self.stages
