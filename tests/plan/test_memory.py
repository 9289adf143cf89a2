"""Memory per GPU against the ZeRO and Korthikanti papers.

- Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054) Fig. 1: Ψ = 7.5B, N_d = 64, K = 12 gives
  120 GB (baseline), 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p) per device.
- Korthikanti et al. 2022 (arXiv 2205.05198) Table 2 / §4: per-layer activation bytes
  sbh(34 + 5as/h) and its TP/SP/recompute variants; for GPT-3 175B (a = 96, s = 2048, h = 12288)
  5as/h = 80, so dropping it (selective recomputation) saves 80/114 ≈ 70%.
"""

import pytest

from crucible.api import arch
from crucible.trainer.plan import memory as mem


@pytest.mark.parametrize("stage, gigabytes", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure1_example(stage, gigabytes):
    states = mem.model_states(7.5e9, stage, dp=64)
    assert states.total_bytes / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_zero_per_term_split():
    s = mem.model_states(1e9, 2, dp=4)
    assert (s.params_bytes, s.grads_bytes, s.optimizer_bytes) == (2e9, 0.5e9, 3e9)


S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B, micro-batch 1 (Korthikanti Table 3 row "175B")
SBH = S * B * H


def test_gpt3_attention_term_is_80():
    assert 5 * A * S / H == 80


@pytest.mark.parametrize("kwargs, per_sbh", [
    ({}, 34 + 80),                                                   # no parallelism
    ({"tp": 8, "sequence_parallel": False}, 10 + 24 / 8 + 80 / 8),  # tensor parallel
    ({"tp": 8}, 34 / 8 + 80 / 8),                                    # TP + sequence parallel
    ({"tp": 8, "recompute": "selective"}, 34 / 8),                   # + selective recompute
    ({"recompute": "full", "sequence_parallel": False}, 2),         # full recompute: input only
    ({"tp": 8, "recompute": "full"}, 2 / 8),
])
def test_korthikanti_table2_on_gpt3(kwargs, per_sbh):
    got = mem.layer_activation_bytes(S, B, H, A, **kwargs)
    assert got == pytest.approx(SBH * per_sbh)


def test_selective_recompute_saves_70_percent_on_gpt3():
    none = mem.layer_activation_bytes(S, B, H, A)
    selective = mem.layer_activation_bytes(S, B, H, A, recompute="selective")
    assert 1 - selective / none == pytest.approx(0.70, abs=0.005)


def test_generalised_mlp_width_keeps_34_at_4h_and_grows_with_width():
    four_h = mem.layer_activation_bytes(S, B, H, A, ffn=4 * H, recompute="selective")
    assert four_h == pytest.approx(SBH * 34)
    wider = mem.layer_activation_bytes(S, B, H, A, ffn=8 * H, recompute="selective")
    assert wider == pytest.approx(SBH * (34 + 16))


def test_estimate_adds_states_activations_logits():
    cfg = arch.preset("gpt2-124m")
    est = mem.estimate(cfg, micro_batch=8, capacity_bytes=80e9, stage=3, dp=8)
    layers = cfg.layers * mem.block_activation_bytes(cfg, 1024, 8, flash_attention=False)
    assert est.activations_bytes == pytest.approx(layers + mem.head_activation_bytes(cfg, 1024, 8))
    # Crucible's GPT-2 block against Megatron's (Korthikanti's Table 2): no dropout masks, but
    # RoPE's rotated copies; within a few percent.
    assert layers == pytest.approx(cfg.layers * mem.layer_activation_bytes(1024, 8, 768, 12),
                                   rel=0.05)
    assert est.logits_bytes == 4 * 1024 * 8 * cfg.vocab_size
    assert est.states.total_bytes == pytest.approx(16 * arch.param_count(cfg) / 8)
    assert est.fits


@pytest.mark.parametrize("call", [
    lambda: mem.model_states(1e9, 4, 8),
    lambda: mem.model_states(-1, 0, 8),
    lambda: mem.layer_activation_bytes(0, 1, 1, 1),
    lambda: mem.layer_activation_bytes(1, 1, 8, 1, recompute="some"),
])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()


def test_flash_attention_stores_what_selective_recompute_stores():
    # FlashAttention (Dao et al. 2022 §3.1) keeps no s×s scores for backward: the 5as/h term
    # goes; and it writes its output (b, s, heads, head_dim) in memory, so no transposed copy of
    # it is made for the output projection, as the unfused kernels' output needs (h a token).
    cfg = arch.preset("1.3b")
    flash = mem.estimate(cfg, micro_batch=4, capacity_bytes=80e9, stage=3, dp=8,
                         flash_attention=True)
    selective = mem.estimate(cfg, micro_batch=4, capacity_bytes=80e9, stage=3, dp=8,
                             recompute="selective")
    plain = mem.estimate(cfg, micro_batch=4, capacity_bytes=80e9, stage=3, dp=8)
    assert flash.activations_bytes < selective.activations_bytes < plain.activations_bytes
    copies = cfg.layers * cfg.seq_len * 4 * cfg.dim * 2   # layers x tokens x h x 2 bytes
    assert selective.activations_bytes - flash.activations_bytes == pytest.approx(copies)


def test_fsdp_holds_its_gathered_root_and_blocks_and_last_micro_batch_whole_gradients():
    cfg = arch.preset("llama-8b")
    block = arch.block_params(cfg)
    root = arch.param_count(cfg) - cfg.layers * block   # embeddings, final norm, output layer
    fsdp = mem.estimate(cfg, micro_batch=1, capacity_bytes=141e9, stage=3, dp=8,
                        recompute="full")
    # The root gathered in bf16 with its fp32 gradient whole (~6.3 GB at 8B), two blocks
    # gathered, on top of the 16 B/param shards.
    assert fsdp.working_bytes == pytest.approx(2 * (root + 2 * block) + 4 * root)
    assert 6e9 < 6 * root < 6.5e9
    # Eagerly the loss's two fp32 gradients beside the kept log-softmax: 8 bytes a logit more.
    assert fsdp.loss_transient_bytes == pytest.approx(8 * cfg.seq_len * cfg.vocab_size)
    assert fsdp.total_bytes == pytest.approx(fsdp.states.total_bytes + fsdp.activations_bytes
                                             + fsdp.logits_bytes + fsdp.loss_transient_bytes
                                             + fsdp.working_bytes)
    zero2 = mem.estimate(cfg, micro_batch=1, capacity_bytes=141e9, stage=2, dp=8,
                         recompute="full")
    assert zero2.working_bytes == 0   # unsharded parameters are already counted as states
    last = mem.estimate(cfg, micro_batch=1, capacity_bytes=141e9, stage=3, dp=8,
                        recompute="full", accumulate_unsharded=True)
    assert last.accumulated_grad_bytes == pytest.approx(4 * arch.param_count(cfg))  # ~32 GB
    assert last.total_bytes == pytest.approx(fsdp.total_bytes + 4 * arch.param_count(cfg))
