"""The trainer's state paths with the model on a device that is not the host's (the foreign
device of tests/support/foreign_device.py, a stand-in for a GPU): run as its own process by
test_foreign_device.py, one JSON line of results per path on stdout.

    python -m tests.trainer.foreign_probe <work folder> <validation shards>

Each path runs even when an earlier one failed; a failure is reported with its exception, never
raised, so the test can say which paths broke and how.
"""

from __future__ import annotations

import json
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api

from tests.support.foreign_device import FOREIGN, ForeignTensor, foreign_device, on_host


def _tiny_model():
    from crucible.api import arch
    from crucible.trainer.model import GPT

    torch.manual_seed(0)
    cfg = arch.PRESETS["tiny"]
    model = GPT(cfg)
    model.init_weights()
    return model, cfg


def _train_step(model, optimizer, cfg, seed: int, before_update=None) -> None:
    from crucible.trainer import optim

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2, 32), generator=gen).to(FOREIGN)
    model(tokens[0], tokens[1]).backward()
    optim.clip_grad_norm(model, 1.0)
    if before_update is not None:
        before_update()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rounding_steps(device: torch.device, dev):
    """Two steps of `tiny` with bf16 parameters and stochastic rounding on `device`, on the same
    made-up gradients wherever it runs (a backward on the device takes another attention kernel
    than on the host, and one ulp apart a rounding may go the other way); returns (model,
    optimizer) and the syncs each update (with its update norm) recorded."""
    from crucible.api.spec import TrainingSpec
    from crucible.trainer import optim
    from crucible.trainer.stochastic_rounding import store_params_in_bf16

    model, _ = _tiny_model()
    store_params_in_bf16(model).to(device)
    optimizer = optim.build_optimizer(
        model, TrainingSpec(tokens=1e6, optimizer={"bf16StochasticRounding": True}))
    syncs = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device, torch.bfloat16)
        mark = dev.mark()
        optim.next_update_sq(optimizer)
        optimizer.step()
        syncs.append([f"{s.kind} {s.op}" for s in dev.since(mark)])
        optimizer.zero_grad(set_to_none=True)
    return (model, optimizer), syncs


def _values(model) -> dict[str, torch.Tensor]:
    return {name: on_host(p).detach().clone() for name, p in model.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _placement(model, optimizer) -> list[str]:
    """What is not where an accelerator run keeps it: every parameter, gradient-free, and every
    optimizer state tensor (fused AdamW keeps its step counts on the device too)."""
    wrong = [f"param {n}: {p.device}" for n, p in model.named_parameters()
             if not isinstance(p, ForeignTensor)]
    for p, state in optimizer.state.items():
        wrong += [f"optimizer {k}: {v.device}" for k, v in state.items()
                  if isinstance(v, torch.Tensor) and not isinstance(v, ForeignTensor)]
    return wrong


def _app(model, optimizer, train_state):
    from crucible.trainer.checkpoint import AppState

    return AppState(model, optimizer, {"train": train_state})


def _result(name: str, fn) -> dict:
    try:
        return {"path": name, "ok": True, **fn()}
    except (Exception, torch.distributed.checkpoint.api.CheckpointException) as err:  # noqa: BLE001
        # Reported to the test, which says what broke (DCP's exception is a BaseException).
        return {"path": name, "ok": False, "error": f"{type(err).__name__}: {err}",
                "where": traceback.format_exc(limit=-3)}


def write_rank_results(work: Path, prefix: str, results: list[dict]) -> None:
    """A torchrun probe's end: every rank writes its results to `<prefix>.<rank>.json` under
    `work`, once all have finished, and leaves the process group."""
    dist.barrier()
    (work / f"{prefix}.{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(work: Path, val: Path) -> None:
    from crucible.api.spec import CheckpointSpec
    from crucible.trainer import optim
    from crucible.trainer.checkpoint import Checkpointer
    from crucible.trainer.data import ShardSet
    from crucible.trainer.evaluate import evaluate
    from crucible.trainer.restore import TrainState
    from crucible.trainer.memory_checkpoint import MemoryTier
    from crucible.trainer.weights import full_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    results = []
    with foreign_device() as dev:
        model, cfg = _tiny_model()
        cpu_model = None
        model.to(FOREIGN)
        from crucible.api.spec import TrainingSpec

        optimizer = optim.build_optimizer(model, TrainingSpec(tokens=1e6))
        train_state = TrainState()
        app = _app(model, optimizer, train_state)

        def step():
            # The update norm (logging steps) and the step itself: on the device, no host read.
            syncs = []

            def update_norm():
                mark = dev.mark()
                optim.next_update_sq(optimizer)
                syncs.extend(f"{s.kind} {s.op}" for s in dev.since(mark))

            _train_step(model, optimizer, cfg, seed=1)
            _train_step(model, optimizer, cfg, seed=5, before_update=update_norm)
            train_state.step = 1
            return {"placement": _placement(model, optimizer), "update_norm_syncs": syncs,
                    "fused": bool(optimizer.defaults.get("fused"))}

        results.append(_result("step", step))

        def memory():
            tier = MemoryTier(job="probe", rank=0, world_size=1, local_world_size=1,
                              model_hash="m", root=str(work / "shm"))
            tier.snapshot(app, 1)
            tier.wait()
            saved, rng = _values(model), torch.get_rng_state()
            _train_step(model, optimizer, cfg, seed=2)
            torch.rand(1)
            train_state.step = 2
            report = tier.restore(app, None, FOREIGN)
            return {"restored": report.step if report else None,
                    "values": _same(saved, _values(model)),
                    "rng": torch.equal(rng, torch.get_rng_state()),
                    "placement": _placement(model, optimizer), "train_step": train_state.step}

        results.append(_result("memory", memory))

        def storage():
            ckpt = Checkpointer(CheckpointSpec(uri=str(work / "ckpt"), keep=3,
                                               **{"async": False}),
                                job="probe", rank=0, world_size=1, local_rank=0,
                                model_hash="m", config_hash="c")
            train_state.step = 3
            ckpt.save(app, 3, 3, wait=True)
            at_3, rng = _values(model), torch.get_rng_state()
            _train_step(model, optimizer, cfg, seed=3)
            train_state.step = 4
            ckpt.save(app, 4, 4, wait=True)
            at_4 = _values(model)
            _train_step(model, optimizer, cfg, seed=4)
            torch.rand(1)
            latest = ckpt.load(app)
            latest_ok = _same(at_4, _values(model))
            # A guard rollback: the commit before the spike.
            older = ckpt.load(app, max_step=3)
            return {"latest": latest["step"] if latest else None, "latest_values": latest_ok,
                    "rollback": older["step"] if older else None,
                    "rollback_values": _same(at_3, _values(model)),
                    "rng": torch.equal(rng, torch.get_rng_state()),
                    "placement": _placement(model, optimizer), "train_step": train_state.step}

        results.append(_result("storage", storage))

        def evaluation():
            nonlocal cpu_model
            shards = ShardSet(str(val))
            on_device = evaluate(model, shards, seq_len=64, micro_batch=2, tokens=512, rank=0,
                                 world_size=1, device=FOREIGN)
            cpu_model, _ = _tiny_model()
            cpu_model.load_state_dict({k: on_host(v) for k, v in model.state_dict().items()})
            on_cpu = evaluate(cpu_model, shards, seq_len=64, micro_batch=2, tokens=512, rank=0,
                              world_size=1, device=torch.device("cpu"))
            return {"loss": on_device.loss, "cpu_loss": on_cpu.loss,
                    "tokens": on_device.tokens}

        results.append(_result("eval", evaluation))

        def export():
            state = full_state(model)
            return {"off_host": sorted(k for k, v in state.items()
                                       if not isinstance(v, torch.Tensor)
                                       or isinstance(v, ForeignTensor)
                                       or v.device.type != "cpu"),
                    "values": _same({k: on_host(v) for k, v in state.items()
                                     if k in dict(model.named_parameters())},
                                    _values(model)),
                    "tensors": len(state)}

        results.append(_result("export", export))

        def rounding():
            # bf16 parameters under the stochastic-rounding AdamW: its generators are the
            # device's (the stand-in refuses a host one for a device draw, as CUDA does), its
            # state stays there through a state_dict round trip, its step and the update norm
            # read nothing back, and it rounds as the same run on the host does.
            on_device, syncs = _rounding_steps(FOREIGN, dev)
            on_cpu, _ = _rounding_steps(torch.device("cpu"), dev)
            model, optimizer = on_device
            optimizer.load_state_dict(optimizer.state_dict())
            return {"placement": _placement(model, optimizer), "syncs": syncs,
                    "same_as_host": _same(_values(model), _values(on_cpu[0])),
                    "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                    "moments": sorted({str(v.dtype) for state in optimizer.state.values()
                                       for k, v in state.items() if k != "step"})}

        results.append(_result("rounding", rounding))
    dist.destroy_process_group()
    for result in results:
        print(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
