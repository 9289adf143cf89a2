"""Throughput and MFU of the real training step: `crucible train` under torchrun, as a job runs.

Each model trains for `--warmup + --steps` steps through the same code path a PretrainJob runs
(the loader on real token shards, FSDP2, bf16, the stability guard, the straggler timer,
metrics), and the figures are read from the run's own metrics.jsonl: the median over the steps
after the warm-up (compilation, allocator growth) of tokens/s, and MFU two ways: the trainer's
own (against the device's datasheet bf16 peak, trainer/hardware.py) and against the bf16 matmul
peak measured here (8192^3 GEMMs), the honest ceiling for this particular board. FLOPs per token
are `arch.flops_per_token` (PaLM's 6N + 12·L·d·T, as torchtitan counts them).

  python bench/gpu_mfu.py [--models gpt2-124m llama-1b] [--nproc 1|N|all] [--micro-batch B]
                          [--seq-len T] [--steps 30] [--warmup 10] [--compile auto|on|off]
                          [--quick] [--json OUT] [--keep DIR]
  python bench/gpu_mfu.py --cpu      # the same on gloo with llama-tiny, to check the script

Each model's micro-batch, unless --micro-batch is given, is the largest power of two up to 64
that the planner's memory estimate (trainer/plan/memory.py: FSDP over the GPUs used, no
activation checkpointing, fused attention, bf16) fits in the device's memory: llama-1b at
micro-batch 8 x 8,192 tokens would need ~170 GB by that count, more than an H200 holds. The
JSON is rewritten after each model, so a run cut short keeps what it measured. --quick measures
10 steps after a 5-step warm-up (a few minutes for both default models on one GPU).

The data are BPE shards of Python's own documentation (bench/gpu_check.py prepares them); a
model whose vocabulary is larger than the tokenizer's still computes its full softmax, so the
step costs what it costs on real data. Without CUDA (and without --cpu) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_check import prepare_data  # noqa: E402 - the same shards the GPU check trains on


def measured_bf16_peak(torch, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    peak = 2 * n**3 * iters / (time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return peak


def fitting_micro_batch(cfg, gpus: int, capacity_bytes: float, largest: int = 64) -> int:
    """The largest power-of-two micro-batch up to `largest` whose step fits by the planner's
    count (FSDP over `gpus`, no recompute, fused attention, bf16, compiled blocks and loss as a
    CUDA run compiles them); 1 if none does (the run then shows the out-of-memory itself)."""
    from crucible.trainer.plan import memory as mem

    best, b = 1, 1
    while b <= largest:
        if mem.estimate(cfg, micro_batch=b, capacity_bytes=capacity_bytes, stage=3, dp=gpus,
                        flash_attention=True, compiled=True).fits:
            best = b
        b *= 2
    return best


def job(root: Path, data: dict, model: str, seq: int, micro_batch: int, a: argparse.Namespace,
        nproc: int) -> Path:
    batch = micro_batch * seq * nproc
    training = {"tokens": (a.warmup + a.steps) * batch, "globalBatchTokens": batch,
                "microBatch": micro_batch, "warmupSteps": 5, "lr": 3e-4,
                "precision": "fp32" if a.cpu else "bf16", "evalTokens": seq * micro_batch}
    if a.compile != "auto":
        training["compile"] = a.compile == "on"
    cfg = {"name": f"mfu-{model}", "outputDir": str(root / model),
           "model": {"preset": model, "seqLen": seq},
           "data": data, "training": training, "metrics": {"port": 0}}
    path = root / f"{model}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_model(root: Path, data: dict, model: str, a: argparse.Namespace, nproc: int,
              env: dict, capacity_bytes: float | None) -> dict:
    """Train `model` and summarise its post-warm-up steps from its metrics.jsonl."""
    from crucible.api import arch

    cfg = arch.preset(model, **({"seq_len": a.seq_len} if a.seq_len else {}))
    micro_batch = a.micro_batch or (fitting_micro_batch(cfg, nproc, capacity_bytes)
                                    if capacity_bytes else 2)
    config = job(root, data, model, cfg.seq_len, micro_batch, a, nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "crucible.trainer", "train", "--config",
           str(config)]
    log = root / f"{model}.log"
    with open(log, "w") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{model}: training failed (exit {code}); see {log}")
    records = [json.loads(line) for line in (root / model / "metrics.jsonl").read_text()
               .splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "train" and r["step"] > a.warmup]
    if not steps:
        raise SystemExit(f"{model}: no steps after the warm-up in {root / model}")
    return {"model": model, "params": arch.param_count(cfg), "gpus": nproc,
            "seq_len": cfg.seq_len, "micro_batch": micro_batch,
            "micro_batch_from": "--micro-batch" if a.micro_batch else (
                "the planner's memory estimate" if capacity_bytes else "default"),
            "tokens_per_step": micro_batch * cfg.seq_len * nproc,
            "flops_per_token": arch.flops_per_token(cfg),
            "step_s": statistics.median(r["step_seconds"] for r in steps),
            "tokens_per_s": statistics.median(r["tokens_per_second"] for r in steps),
            "mfu_trainer": statistics.median(r["mfu"] for r in steps), "steps": len(steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+")
    p.add_argument("--nproc", default="1", help="processes (GPUs): a number or `all`")
    p.add_argument("--micro-batch", type=int, help="per GPU (default: the largest the "
                   "planner fits in the device's memory, up to 64; 2 with --cpu)")
    p.add_argument("--seq-len", type=int, help="override the presets' context length")
    p.add_argument("--steps", type=int, default=30, help="steps measured after the warm-up")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="training.compile (auto: the job's default)")
    p.add_argument("--quick", action="store_true", help="10 steps after a 5-step warm-up")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU with llama-tiny (a check "
                   "of the script, not a measurement)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", help="work in this folder and keep it")
    a = p.parse_args()
    if a.quick:
        a.steps, a.warmup = 10, 5
    import torch

    if not a.cpu and not torch.cuda.is_available():
        print("bench/gpu_mfu.py: no CUDA GPU on this machine; nothing measured (run it where "
              "`torch.cuda.is_available()` is true, e.g. one H200; `--cpu` checks the script)")
        return 0
    models = a.models or (["llama-tiny"] if a.cpu else ["gpt2-124m", "llama-1b"])
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if a.cpu:
        from crucible.trainer.metrics import measure_matmul_peak_flops

        nproc, env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"] = 1, "", "1"
        peak, peak_name = measure_matmul_peak_flops(torch.device("cpu")), "fp32 matmul"
        device, capacity = "cpu (gloo)", None
    else:
        nproc = torch.cuda.device_count() if a.nproc == "all" else int(a.nproc)
        peak, peak_name = measured_bf16_peak(torch), "bf16 matmul"
        device = f"{torch.cuda.get_device_name(0)} x{nproc}"
        capacity = float(torch.cuda.get_device_properties(0).total_memory)
    root = Path(a.keep or tempfile.mkdtemp(prefix="crucible-mfu-"))
    root.mkdir(parents=True, exist_ok=True)
    data = prepare_data(root)
    print(f"{device}: measured {peak_name} peak {peak / 1e12:.3g} TFLOP/s per device")
    print(f"{'model':<12}{'params':>9}{'seq':>6}{'micro':>6}{'tok/step':>10}{'step ms':>9}"
          f"{'tok/s':>12}{'MFU(measured peak)':>20}{'MFU(trainer)':>14}")
    results = []
    for model in models:
        r = run_model(root, data, model, a, nproc, env, capacity)
        r["mfu_measured_peak"] = r["tokens_per_s"] / nproc * r["flops_per_token"] / peak
        results.append(r)
        print(f"{model:<12}{r['params'] / 1e6:>8.0f}M{r['seq_len']:>6}{r['micro_batch']:>6}"
              f"{r['tokens_per_step']:>10}{1e3 * r['step_s']:>9.1f}{r['tokens_per_s']:>12,.0f}"
              f"{100 * r['mfu_measured_peak']:>19.1f}%{100 * r['mfu_trainer']:>13.1f}%",
              flush=True)
        if a.json:   # after every model: a run cut short keeps what it measured
            Path(a.json).write_text(json.dumps({"device": device, "peak_flops": peak,
                                                "peak": peak_name, "results": results},
                                               indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
