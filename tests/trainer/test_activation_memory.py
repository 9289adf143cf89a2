"""The planner's activation memory against what autograd really keeps, for every preset's block.

The CPU stand-in for `torch.cuda.max_memory_allocated`: every tensor autograd saves for backward
during one forward pass of the real module (a saved-tensors hook, each storage counted once,
parameters and buffers left out), on CPU in fp32 where SDPA runs its fused (flash) kernel as it
does on a GPU. Each preset's own block shape (width, heads, key/value heads, MLP) with one layer,
a short sequence and a small vocabulary: the count is per block and per token, so the layer
count, the sequence length and the vocabulary only multiply it (the logits term is in the sum).
The module is allocated uninitialised: which tensors are kept does not depend on their values.

The held-out eval keeps nothing for backward; its peak is what is alive at once. On CPU that is
read from the allocator's own allocation and free events (the profiler's memory events, in
order), the stand-in for `torch.cuda.max_memory_allocated` during the forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from crucible.api import arch
from crucible.trainer.model import GPT, cross_entropy_loss
from crucible.trainer.parallel import compile_model
from crucible.trainer.plan import memory as mem
from tests.support.measure import saved_for_backward

SEQ, BATCH, VOCAB = 48, 2, 512


def saved_for_backward_bytes(cfg: arch.GPTConfig, dtype: torch.dtype = torch.float32,
                             compiled: bool = False) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.to(dtype)   # bf16: as FSDP's mixed precision computes, on parameters cast to bf16
    if compiled:
        compile_model(model)   # what training.compile does (trainer/parallel.py)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    if compiled:
        model(idx, idx).backward()   # compiles; counted on the next pass
    with saved_for_backward(model) as kept:
        model(idx, idx)
    return sum(kept.values())


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_estimate_is_within_10_percent_of_what_autograd_saves(name):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                       precision=mem.PRECISIONS["fp32"], flash_attention=True)
    measured = saved_for_backward_bytes(cfg)
    # The acceptance bar is 10%; the count is exact to a few hundredths of a percent here.
    assert est.activations_bytes + est.logits_bytes == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-150m"])
def test_qk_norm_keeps_attention_without_a_transposed_output_copy(name):
    # The norms join q and k again in the (b, s, heads, head_dim) layout: attention's output
    # follows q's layout, so the output projection takes it without a copy, as without QK-norm.
    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB,
                              qk_norm=True)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                       precision=mem.PRECISIONS["fp32"], flash_attention=True)
    assert est.activations_bytes + est.logits_bytes == pytest.approx(
        saved_for_backward_bytes(cfg), rel=0.01)


# One preset per block family (LayerNorm + GELU; RMSNorm + SwiGLU + GQA), with two layers: the
# final norm runs eagerly (only blocks and loss are compiled), and one layer would let it weigh
# more than it does in a real model.
COMPILED = ["gpt2-124m", "llama-150m"]


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_estimate_is_within_15_percent_of_what_inductor_saves(name):
    """Inductor on CPU: its partitioner decides what to keep, as it does on a GPU. bf16, as
    training computes; the final norm's eager bf16 intermediates on CPU (RMSNorm's fp32 upcast
    copies, composed ops here) are the remaining error."""
    cfg = dataclasses.replace(arch.PRESETS[name], layers=2, seq_len=SEQ, vocab_size=VOCAB)
    est = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                       precision=mem.PRECISIONS["bf16"], flash_attention=True, compiled=True)
    compiled = saved_for_backward_bytes(cfg, torch.bfloat16, compiled=True)
    assert est.activations_bytes + est.logits_bytes == pytest.approx(compiled, rel=0.15)
    eager = mem.estimate(cfg, micro_batch=BATCH, capacity_bytes=1e12, stage=3, dp=1,
                         precision=mem.PRECISIONS["bf16"], flash_attention=True)
    if cfg.mlp == "swiglu":   # what compiling saves is counted, not assumed
        assert est.activations_bytes < eager.activations_bytes
    assert est.logits_bytes < eager.logits_bytes   # the compiled loss keeps bf16 logits


def allocator_peak(run) -> int:
    """Bytes alive at once beyond what existed before, while `run()` runs, from the
    allocator's allocation and free events in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    assert events, "the profiler recorded no allocations"
    alive = peak = 0
    for _, change in events:
        alive += change
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize("compiled", [False, True])
def test_the_loss_at_its_fullest_is_what_it_keeps_and_its_transient(compiled):
    """The loss's forward and backward on bf16 logits, alone: its peak beyond the logits is
    what `logits_bytes` keeps (eager: the fp32 log-softmax; compiled: the logits themselves,
    already there) and `loss_transient_bytes`."""
    rows, vocab = 96, 8192
    logits = torch.randn(1, rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (1, rows))
    loss = torch.compile(cross_entropy_loss) if compiled else cross_entropy_loss

    def step():
        loss(logits, targets).backward()
        logits.grad = None

    step()   # compiles, and warms the allocator
    kept = 0 if compiled else mem.logits_bytes(rows, 1, vocab)
    est = kept + mem.loss_transient_bytes(rows, 1, vocab, compiled=compiled)
    assert est == pytest.approx(allocator_peak(step), rel=0.15)


def eval_forward_peak_bytes(cfg: arch.GPTConfig, dtype: torch.dtype, compiled: bool) -> int:
    """Bytes alive at once beyond the weights during one eval forward (as `evaluate` runs it:
    no autograd, the model's own loss), from the allocator's events in time order."""
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.init_weights()   # the loss's values do not change its memory; NaNs would be noise
    model.to(dtype)
    model.eval()
    if compiled:
        compile_model(model)
    idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1))
    # One thread: the CPU peak grows with the thread count (+22% and +24% at two threads on
    # these shapes, the same model and inputs: the kernels' own per-thread working buffers, not
    # tensors the forward keeps), which a GPU's kernels do not take from this allocator.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            model(idx[:, :-1], idx[:, 1:])   # compiles, and warms the allocator
            return allocator_peak(lambda: model(idx[:, :-1], idx[:, 1:]))
    finally:
        torch.set_num_threads(threads)


# Small vocabularies leave a block's MLP or attention as the fullest point; large ones the
# logits with the loss's fp32 copies (eager) or without them (compiled).
EVAL_CASES = [("gpt2-124m", 512, torch.bfloat16, False), ("llama-150m", 512, torch.bfloat16, False),
              ("gpt2-124m", 16384, torch.bfloat16, False), ("llama-150m", 16384, torch.float32, False),
              ("gpt2-124m", 512, torch.bfloat16, True), ("llama-150m", 16384, torch.bfloat16, True)]


@pytest.mark.parametrize("name,vocab,dtype,compiled", EVAL_CASES)
def test_eval_peak_is_within_15_percent_of_what_the_forward_holds_at_once(name, vocab, dtype,
                                                                         compiled):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=2, seq_len=SEQ, vocab_size=vocab)
    value = torch.tensor([], dtype=dtype).element_size()
    est = mem.eval_forward_bytes(cfg, SEQ, BATCH, compiled=compiled, bytes_per_value=value)
    assert est == pytest.approx(eval_forward_peak_bytes(cfg, dtype, compiled), rel=0.15)


def test_the_eval_peak_counts_weights_and_optimizer_but_no_gradients():
    cfg = arch.preset("llama-1b", seq_len=8192)
    est = mem.estimate(cfg, micro_batch=8, capacity_bytes=141e9, stage=3, dp=8,
                       flash_attention=True, compiled=False)
    forward = mem.eval_forward_bytes(cfg, 8192, 8)
    # The eval runs with the next step's gradients made (before its update): every state.
    assert est.eval_bytes == pytest.approx(
        est.states.total_bytes + forward + mem.fsdp_gathered_bytes(cfg, mem.PRECISIONS["bf16"]))
    # Eagerly the loss's fp32 copies of 128K-wide logits are most of it: ~80 GB of 141.
    assert 75e9 < forward < 85e9
    compiled = mem.estimate(cfg, micro_batch=8, capacity_bytes=141e9, stage=3, dp=8,
                            flash_attention=True, compiled=True)
    assert compiled.eval_bytes < est.eval_bytes / 4


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_the_eval_never_needs_more_than_the_training_step(name):
    # Same micro-batch, nothing kept across blocks, and the eager loss's fp32 copies are fewer
    # than its backward's: a plan that fits its step fits its evals, pipelined or not.
    for compiled in (False, True):
        for recompute in ("none", "full"):
            for pp in (1, 2):
                est = mem.estimate(arch.PRESETS[name], micro_batch=4, capacity_bytes=1e12,
                                   stage=3, dp=8, pp=pp, recompute=recompute,
                                   flash_attention=True, compiled=compiled)
                assert est.eval_bytes < est.total_bytes, (compiled, recompute, pp)


def test_a_pipelines_last_stage_counts_when_the_output_layer_makes_it_the_fullest():
    # llama-8b, full recomputation, 2 stages: the first holds 2 micro-batches of 16 blocks'
    # inputs, the last 16 blocks' for one micro-batch plus a 128K-wide loss: the last is fuller.
    # Its eager loss keeps the fp32 log-softmax, and the schedule the bf16 logits it computed
    # them from (the stage's output).
    cfg = arch.preset("llama-8b")
    two = mem.estimate(cfg, micro_batch=1, capacity_bytes=1e12, stage=3, dp=8, pp=2,
                       recompute="full", flash_attention=True)
    assert two.logits_bytes == mem.logits_bytes(cfg.seq_len, 1, cfg.vocab_size) \
        + 2 * cfg.seq_len * cfg.vocab_size
    assert two.loss_transient_bytes == mem.loss_transient_bytes(cfg.seq_len, 1, cfg.vocab_size)
    block = mem.block_activation_bytes(cfg, cfg.seq_len, 1, recompute="full")
    assert two.activations_bytes == pytest.approx(
        cfg.layers / 2 * block + mem.head_activation_bytes(cfg, cfg.seq_len, 1))


def kept_by_checkpointed_block(cfg: arch.GPTConfig) -> int:
    """Bytes one block keeps from its forward to its backward under the trainer's own per-op
    policy (trainer/parallel.py): what its forward allocated and left alive (the policy's
    cache of kept outputs and whatever autograd saves), less its output, plus its input, which
    the checkpoint keeps and which was allocated before (as a whole model's previous block
    allocates it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from crucible.trainer.parallel import _op_sac_context

    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    block = checkpoint_wrapper(model.h[0], preserve_rng_state=False, context_fn=_op_sac_context)
    x = torch.randn(BATCH, SEQ, cfg.dim, requires_grad=True)
    rope = (None if cfg.position == "learned"
            else (model.rope_cos[:SEQ].clone(), model.rope_sin[:SEQ].clone()))
    return _kept_by(block, x, rope)


def _kept_by(block, x: torch.Tensor, *args) -> int:
    import gc

    gc.collect()   # nothing an earlier test left is freed inside the measurement
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = block(x, *args)
    alive = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]")
    kept = alive - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    out.sum().backward()   # the policy's recompute runs and matches what it kept
    assert x.grad is not None
    return kept


def in_a_fresh_process(call: str) -> int:
    """`call` (an expression over this module, `m`) evaluated in a new interpreter: the
    allocator's events must show this block's forward and nothing that global state other
    tests in the session left behind (threads, caches, garbage) does meanwhile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = ("import dataclasses, torch; torch.set_num_threads(1); "
            "import tests.trainer.test_activation_memory as m; "
            f"from crucible.api import arch; print({call})")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "TORCH"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
def test_selective_op_estimate_is_what_the_per_op_policy_keeps(name):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB)
    kept = in_a_fresh_process("m.kept_by_checkpointed_block(dataclasses.replace("
                              f"arch.PRESETS[{name!r}], layers=1, seq_len=m.SEQ, "
                              "vocab_size=m.VOCAB))")
    est = mem.block_activation_bytes(cfg, SEQ, BATCH, recompute="selective-op",
                                     bytes_per_value=4)
    assert abs(est - kept) / kept < 0.05, (est, kept)
    # Well under what the block keeps without it: the norms, RoPE, the activation function
    # and half the matmul outputs are recomputed.
    assert est < 0.55 * mem.block_activation_bytes(cfg, SEQ, BATCH, recompute="none",
                                                   bytes_per_value=4)


class TorchtitanBlock(torch.nn.Module):
    """torchtitan's Llama 3 block as far as what it keeps goes: q, k, v, the projection, gate,
    up and down as seven separate matmuls, RMSNorm, grouped-query attention."""

    def __init__(self, cfg: arch.GPTConfig):
        super().__init__()
        h, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn_dim
        self.heads, self.head_dim = cfg.heads, h // cfg.heads
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.wq, self.wk, self.wv, self.wo = linear(h, h), linear(h, kv), linear(h, kv), linear(h, h)
        self.w1, self.w3, self.w2 = linear(h, f), linear(h, f), linear(f, h)
        self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)

    def forward(self, x):
        B, T, C = x.shape
        y = self.n1(x)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2)
                   for t in (self.wq(y), self.wk(y), self.wv(y)))
        o = torch.nn.functional.scaled_dot_product_attention(q * 1.01, k * 1.01, v,
                                                             is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, C))
        z = self.n2(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(z)) * self.w3(z))


def kept_by_torchtitan_block(name: str) -> int:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from crucible.trainer.parallel import _op_sac_context

    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB)
    block = checkpoint_wrapper(TorchtitanBlock(cfg), preserve_rng_state=False,
                               context_fn=_op_sac_context)
    return _kept_by(block, torch.randn(BATCH, SEQ, cfg.dim, requires_grad=True))


@pytest.mark.parametrize("name", ["llama-tiny", "llama-400m"])
def test_selective_op_estimate_for_torchtitans_block(name):
    cfg = dataclasses.replace(arch.PRESETS[name], layers=1, seq_len=SEQ, vocab_size=VOCAB)
    kept = in_a_fresh_process(f"m.kept_by_torchtitan_block({name!r})")
    est = mem.block_activation_bytes(cfg, SEQ, BATCH, recompute="selective-op",
                                     bytes_per_value=4, unfused_linears=True)
    assert abs(est - kept) / kept < 0.05, (est, kept)
    # Less than Crucible's fused block keeps: it keeps q alone, not q|k|v, and gate alone.
    assert est < mem.block_activation_bytes(cfg, SEQ, BATCH, recompute="selective-op",
                                            bytes_per_value=4)
