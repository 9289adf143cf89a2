"""GPU throughput and MFU of Crucible's model + FSDP2 on one GPU (bf16), against a measured peak.

For each model (default: gpt2-124m and 1.3b) it builds the model exactly as training does
(meta device -> fully_shard -> materialise, bf16 parameters, fp32 reductions, optional per-block
torch.compile), runs forward+backward+AdamW on random tokens, and reports tokens/s and MFU
two ways: against the datasheet bf16 peak (trainer/hardware.py) and against the bf16 matmul
peak measured here (8192^3 GEMMs), which is the honest ceiling for this particular board.

  python bench/gpu_mfu.py [--models gpt2-124m 1.3b] [--steps 20] [--micro-batch 16] [--compile]

Without a CUDA GPU it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


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
    return 2 * n**3 * iters / (time.perf_counter() - start)


def bench_model(torch, name: str, a, env, mesh) -> dict:
    from crucible.api import arch
    from crucible.api.spec import TrainingSpec
    from crucible.trainer import optim, parallel

    cfg = arch.preset(name)
    model = parallel.build_sharded_model(cfg, env, mesh, precision="bf16", seed=0,
                                         activation_checkpointing=a.activation_checkpointing,
                                         compile_blocks=a.compile)
    opt = optim.build_optimizer(model, TrainingSpec(tokens=1))
    B, T = a.micro_batch, cfg.seq_len
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), device="cuda")
    times = []
    for step in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        optim.clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    step_s = times[len(times) // 2]
    tps = B * T / step_s
    flops = arch.flops_per_token(cfg)
    result = {"model": name, "params_M": arch.param_count(cfg) / 1e6, "tokens_per_step": B * T,
              "step_ms": 1e3 * step_s, "tokens_per_s": tps, "achieved_tflops": tps * flops / 1e12,
              "max_mem_GiB": torch.cuda.max_memory_allocated() / 2**30}
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2-124m", "1.3b"])
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--activation-checkpointing", action="store_true")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_mfu.py: no CUDA GPU on this machine; nothing measured (run it where "
              "`torch.cuda.is_available()` is true, e.g. one H200)")
        return 0
    from crucible.trainer import hardware, parallel

    env = parallel.init_distributed()
    mesh = parallel.build_mesh(env)
    device_name = torch.cuda.get_device_name()
    acc = hardware.from_device_name(device_name)
    peak_measured = measured_bf16_peak(torch)
    print(f"{device_name}: measured bf16 matmul peak {peak_measured / 1e12:.0f} TFLOP/s"
          + (f", datasheet {acc.peak_bf16_flops / 1e12:.0f} TFLOP/s" if acc else ""))
    print(f"{'model':<11}{'params':>9}{'tok/step':>10}{'step ms':>9}{'tok/s':>11}{'TFLOP/s':>9}"
          f"{'MFU(meas)':>11}{'MFU(sheet)':>11}{'mem GiB':>9}")
    for name in a.models:
        r = bench_model(torch, name, a, env, mesh)
        mfu_meas = r["achieved_tflops"] * 1e12 / peak_measured
        mfu_sheet = r["achieved_tflops"] * 1e12 / acc.peak_bf16_flops if acc else float("nan")
        print(f"{name:<11}{r['params_M']:>8.0f}M{r['tokens_per_step']:>10}{r['step_ms']:>9.1f}"
              f"{r['tokens_per_s']:>11,.0f}{r['achieved_tflops']:>9.1f}{100 * mfu_meas:>10.1f}%"
              f"{100 * mfu_sheet:>10.1f}%{r['max_mem_GiB']:>9.1f}")
    parallel.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
