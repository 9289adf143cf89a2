"""At most one host sync per optimizer step outside logging steps, by CUDA's count.

On a GPU every read of a device tensor (`.item()`, `.tolist()`, `float(t)`, `bool(t)`, ...)
waits for all queued kernels, and so do a tensor made from Python data onto the device (a copy
from pageable host memory) and an op whose output size depends on the values (`nonzero`, a
boolean mask): a few per step serialise the host with the device. The probe counts all of them
on every rank of a real two-process run (gloo here, where they cost nothing, but the same calls
are what would stall CUDA): reads and constructions from Python, data-dependent ops with a
dispatch mode, which also counts the aten ops each step dispatches; all attributed to steps by
the loop's one `log_step` call per step. The CPU's foreach AdamW reads its step counts and makes
its own, CPU tensors there: those are left out, as on CUDA the trainer's fused AdamW keeps them
on the device. A `.to(device)` of a host tensor cannot be seen on a CPU run (it is a no-op
there); tests/trainer/test_foreign_device.py covers placements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from crucible.api.launch import TORCHRUN_ENV
from tests.support.repo import REPO
from tests.support.training import job_config, write_config

PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from crucible.api.spec import load_train_config
    from crucible.trainer import loop, metrics

    reads, ops = [], [0]
    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        def counting(self, *args, _real=real, _name=name, **kwargs):
            caller = sys._getframe(1).f_code
            # The foreach AdamW used on the CPU reads each step count, a CPU tensor there;
            # on CUDA the trainer's AdamW is fused and keeps them on the device.
            if not (caller.co_name == "_get_value"
                    and caller.co_filename.endswith("torch/optim/optimizer.py")):
                reads.append(_name)
            return _real(self, *args, **kwargs)
        setattr(torch.Tensor, name, counting)

    aten = torch.ops.aten
    DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default,
                      aten.unique_consecutive.default, aten._unique2.default}

    class Dispatched(TorchDispatchMode):
        # Every aten op the step dispatches (kernel launches, on a GPU), and the ops whose
        # output size depends on the values (the host waits for them on CUDA).
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += 1
            if func in DATA_DEPENDENT or (func is aten.index.Tensor and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 else ()) if i is not None)):
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    for name in ("tensor", "as_tensor", "asarray"):
        real = getattr(torch, name)
        def made(data, *args, _real=real, _name=name, **kwargs):
            # A tensor made from Python data straight onto the compute device: on CUDA a copy
            # from pageable host memory, which waits for the device. (CPU AdamW's own step
            # count tensors are left out, as its reads are.)
            caller = sys._getframe(1).f_code
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor) \\
                    and "torch/optim/" not in caller.co_filename:
                reads.append(f"torch.{_name}(device=...)")
            return _real(data, *args, **kwargs)
        setattr(torch, name, made)

    per_step, mark = [], [0, 0]
    real_log_step = metrics.Metrics.log_step
    def log_step(self, step):
        per_step.append((step.step, reads[mark[0]:], ops[0] - mark[1]))
        mark[0], mark[1] = len(reads), ops[0]
        real_log_step(self, step)
    metrics.Metrics.log_step = log_step

    with Dispatched():
        loop.train(load_train_config(sys.argv[1]), log=lambda *_: None)
    with open(f"{sys.argv[2]}.{os.environ['RANK']}", "w") as out:
        json.dump(per_step, out)
""")



def _probe_run(corpus, tmp_path, gradient_sync: str, log_every: int) -> list[float]:
    """Train 12 steps on 2 ranks under the probe; check each rank's reads; return the losses."""
    out = tmp_path / gradient_sync
    out.mkdir()
    cfg = job_config(corpus, out, steps=12, logEvery=log_every, gradientSync=gradient_sync)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(probe), str(write_config(cfg, out / "job.yaml")), str(out / "reads")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **TORCHRUN_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        per_step = json.loads((out / f"reads.{rank}").read_text())
        assert [step for step, _, _ in per_step] == list(range(1, 13))
        # Step 1 includes start-up (resume checks, the first log line); logging steps may read.
        quiet = {step: calls for step, calls, _ in per_step if step > 1 and step % log_every}
        # The update norm (a pass over the optimizer state) is measured on logging steps only
        # (every 5th, and the last, 12). The loop is pipelined one step deep: step k is
        # recorded after step k+1's forward, backward and all-reduce were queued, so record k
        # holds step k+1's update norm when k+1 logs (records 4, 9, 11); the others dispatch
        # the same ops, fewer.
        ops = {step: n for step, _, n in per_step}
        measuring = (4, 9, 11)
        assert len({ops[k] for k in range(2, 11) if k not in measuring}) == 1, ops
        assert all(ops[k] > ops[2] for k in measuring), ops
        assert len(quiet) == 9
        assert all(len(calls) <= 1 for calls in quiet.values()), (gradient_sync, rank, quiet)
        # The one read is the packed all-reduce's `tolist`: the loop still agrees every step.
        assert all(calls == ["tolist"] for calls in quiet.values()), (gradient_sync, rank, quiet)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def test_non_logging_steps_read_the_device_at_most_once(corpus, tmp_path):
    every = _probe_run(corpus, tmp_path, "everyMicroBatch", log_every=5)
    last = _probe_run(corpus, tmp_path, "lastMicroBatch", log_every=5)
    # Both ways of syncing gradients during accumulation train the same model (the sums differ
    # only in order): a mode that dropped or doubled a micro-batch's gradients would diverge.
    assert len(every) == len(last) == 12
    assert every == pytest.approx(last, rel=1e-4)
    assert every[-1] < every[0] - 0.5
