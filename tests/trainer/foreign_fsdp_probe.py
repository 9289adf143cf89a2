"""FSDP2 over the foreign device (tests/support/foreign_device.py, a stand-in for a GPU): the
sharded paths of the trainer on two ranks, each also run on the host (a CPU mesh of the same
process group) to compare against. Run under torchrun by test_foreign_device.py; each rank
writes one JSON list of results per path.

    torchrun --nproc-per-node=2 -m tests.trainer.foreign_fsdp_probe <work folder>

The process group has gloo for both devices ("cpu:gloo,foreign:gloo"); the stand-in runs a
foreign tensor's collective on its host copy, so the sharded step really communicates.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.support.foreign_device import FOREIGN, ForeignTensor, foreign_device, on_host
from tests.trainer.foreign_probe import _result, write_rank_results


def _env(device: torch.device):
    from crucible.trainer.parallel import DistEnv

    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]), device,
                   "gloo", int(os.environ["LOCAL_WORLD_SIZE"]))


def _build(device: torch.device, rounding: bool = False):
    """The sharded `tiny` and its optimizer on `device`; `rounding`: bf16 parameters under
    `training.optimizer.bf16StochasticRounding`, as the loop builds them."""
    from crucible.api import arch
    from crucible.api.spec import TrainingSpec
    from crucible.trainer import optim, parallel
    from crucible.trainer.stochastic_rounding import store_params_in_bf16

    env = _env(device)
    mesh = parallel.build_mesh(env)
    cfg = arch.PRESETS["tiny"]
    model = parallel.build_sharded_model(cfg, env, mesh, precision="bf16", seed=7)
    if rounding:
        store_params_in_bf16(model)
    spec = TrainingSpec(tokens=1e6, optimizer={"bf16StochasticRounding": rounding})
    return env, mesh, cfg, model, optim.build_optimizer(model, spec)


def _local(t: torch.Tensor) -> torch.Tensor:
    return on_host(t.to_local() if isinstance(t, DTensor) else t)


def _shards(model) -> dict[str, torch.Tensor]:
    return {name: _local(p).detach().clone() for name, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _gap(a: dict, b: dict) -> float:
    """The largest difference between two models' shards (attention takes its math kernel on
    the foreign device and its fused CPU kernel on the host: the same numbers, rounded apart)."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _placement(model, optimizer) -> list[str]:
    """What is not on the device: every parameter's local shard and every optimizer state."""
    wrong = [f"param {n}: {type(p).__name__} of {type(_maybe_local(p)).__name__}"
             for n, p in model.named_parameters()
             if not isinstance(p, DTensor) or not isinstance(p.to_local(), ForeignTensor)]
    for state in optimizer.state.values():
        wrong += [f"optimizer {k}" for k, v in state.items() if isinstance(v, torch.Tensor)
                  and not isinstance(_maybe_local(v), ForeignTensor)]
    return wrong


def _leaves(tree, prefix: str = ""):
    """(path, leaf, the record type holding it) of a nested state: dicts, lists, and the
    in-memory tier's records (LocalShard, HostTensor) by their tensor."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}/{i}")
    elif hasattr(tree, "tensor") and isinstance(tree.tensor, torch.Tensor):
        yield prefix, tree.tensor, type(tree).__name__
    else:
        yield prefix, tree, type(tree).__name__


def _is_device(t) -> bool:
    return isinstance(t, torch.Tensor) and isinstance(_maybe_local(t), ForeignTensor)


def _maybe_local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _bf16_step(t: torch.Tensor) -> torch.Tensor:
    """The distance from each bf16 value to its neighbour away from zero, in fp32."""
    away = torch.where(t >= 0, float("inf"), float("-inf")).to(t.dtype)
    return (torch.nextafter(t, away) - t).float().abs()


def _batch(env, cfg, seed: int) -> torch.Tensor:
    """This rank's batch on the device (the loop's loader copies from pinned memory; that
    copy is not the step's, so it is made before the step's syncs are counted)."""
    gen = torch.Generator().manual_seed(seed * 10 + env.rank)
    return torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=gen).to(env.device)


def _step(env, cfg, model, optimizer, seed: int, tokens: torch.Tensor | None = None) -> float:
    """One training step as the loop takes it: forward and backward, clipping, the packed
    all-reduce of the step's numbers, fused AdamW; returns the summed loss read back."""
    from crucible.trainer import optim, parallel

    tokens = _batch(env, cfg, seed) if tokens is None else tokens
    loss = model(tokens[0], tokens[1])
    loss.backward()
    norm = optim.clip_grad_norm(model, 1.0)
    pending = parallel.launch_sums([loss.detach(), norm, 0.0, 0.0], env.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sums, _ = pending.read()
    return sums[0]


def main(work: Path) -> None:
    from crucible.api.spec import CheckpointSpec
    from crucible.trainer.checkpoint import AppState, Checkpointer
    from crucible.trainer.memory_checkpoint import from_host, to_host
    from crucible.trainer.restore import TrainState

    dist.init_process_group("cpu:gloo,foreign:gloo")
    results = []
    with foreign_device() as dev:
        host = _build(torch.device("cpu"))
        device = None

        def build():
            nonlocal device
            device = _build(FOREIGN)
            _, _, _, model, optimizer = device
            return {"placement": _placement(model, optimizer),
                    "same_init": _same(_shards(model), _shards(host[3]))}

        results.append(_result("build", build))

        def step():
            env, _, cfg, model, optimizer = device
            losses, syncs = [], []
            for seed in (1, 2):
                tokens = _batch(env, cfg, seed)
                mark = dev.mark()
                losses.append(_step(env, cfg, model, optimizer, seed, tokens))
                syncs.append([f"{s.kind} {s.op}" for s in dev.since(mark)])
            host_losses = [_step(host[0], host[2], host[3], host[4], seed) for seed in (1, 2)]
            return {"placement": _placement(model, optimizer), "losses": losses,
                    "host_losses": host_losses, "syncs": syncs,
                    "max_update_gap": _gap(_shards(model), _shards(host[3]))}

        results.append(_result("step", step))

        def memory():
            # The in-memory tier's snapshot and its peer restore's DTensor path: local shards
            # to the host, back to DTensors on the mesh, loaded into the sharded model.
            env, mesh, cfg, model, optimizer = device
            app = AppState(model, optimizer, {"train": TrainState(step=2)})
            snapshot = to_host(app.state_dict())
            saved = _shards(model)
            _step(env, cfg, model, optimizer, seed=3)
            back = from_host(snapshot, mesh, FOREIGN)
            # The snapshot is host memory (a device copy would double the state on the GPU and
            # be serialised from the device by the writer thread); what comes back is on the
            # device before torch's loading could move anything.
            host = [name for name, t, _ in _leaves(snapshot) if _is_device(t)]
            # Tensors taken from the host (the RNG state) are marked so and go back there.
            marked = {name for name, _, kind in _leaves(snapshot) if kind == "HostTensor"}
            device_side = [name for name, t, _ in _leaves(back) if isinstance(t, torch.Tensor)
                           and not _is_device(t) and name not in marked]
            app.load_state_dict(back)
            return {"values": _same(saved, _shards(model)),
                    "placement": _placement(model, optimizer),
                    "snapshot_on_device": host, "restored_on_host": device_side}

        results.append(_result("memory", memory))

        def storage():
            # A sharded save through DCP and its load, each rank its own shards.
            env, mesh, cfg, model, optimizer = device
            ckpt = Checkpointer(CheckpointSpec(uri=str(work / "ckpt"), keep=3,
                                               **{"async": False}),
                                job="probe", rank=env.rank, world_size=env.world_size,
                                local_rank=env.local_rank, model_hash="m", config_hash="c")
            app = AppState(model, optimizer, {"train": TrainState(step=3)})
            ckpt.save(app, 3, 3, wait=True)
            saved = _shards(model)
            _step(env, cfg, model, optimizer, seed=4)
            changed = not _same(saved, _shards(model))
            loaded = ckpt.load(app)
            return {"loaded": loaded["step"] if loaded else None, "changed": changed,
                    "values": _same(saved, _shards(model)),
                    "placement": _placement(model, optimizer)}

        results.append(_result("storage", storage))

        def rounding():
            # bf16 shards under the stochastic-rounding AdamW: each rank draws its shard's bits
            # on the device, reads nothing back in the step, and lands where the host does:
            # attention's kernels differ between the two, so each element is within the step
            # path's gap (two AdamW steps at the default peak LR) and a bf16 step either way
            # (a value near a rounding threshold may go the other way), not equal.
            env, _, cfg, model, optimizer = _build(FOREIGN, rounding=True)
            host_env, _, _, host_model, host_optimizer = _build(torch.device("cpu"),
                                                                rounding=True)
            start, syncs = _shards(model), []
            for seed in (1, 2):
                tokens = _batch(env, cfg, seed)
                mark = dev.mark()
                _step(env, cfg, model, optimizer, seed, tokens)
                syncs.append([f"{s.kind} {s.op}" for s in dev.since(mark)])
                _step(host_env, cfg, host_model, host_optimizer, seed)
            mine, host_shards = _shards(model), _shards(host_model)
            apart = [name for name, host_shard in host_shards.items()
                     if not torch.all((mine[name] - host_shard).float().abs()
                                      <= 4 * 6e-4 + 2 * _bf16_step(host_shard))]
            return {"placement": _placement(model, optimizer), "syncs": syncs, "apart": apart,
                    "changed": not _same(start, mine),
                    "dtypes": sorted({str(t.dtype) for t in mine.values()})}

        results.append(_result("rounding", rounding))
    write_rank_results(work, "fsdp", results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
