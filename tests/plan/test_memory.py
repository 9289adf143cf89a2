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


def test_full_recomputation_peaks_at_the_larger_of_the_loss_and_one_recomputed_block():
    """Chen et al. 2016 §3: the kept inputs plus the segment being recomputed, one block; the
    loss's fullest point comes before any block's backward, so the two never add up."""
    cfg = arch.preset("llama-8b")
    est = mem.estimate(cfg, micro_batch=1, capacity_bytes=1e12, stage=3, dp=8, recompute="full",
                       flash_attention=True)
    block = mem.block_activation_bytes(cfg, cfg.seq_len, 1, recompute="none")
    assert est.recompute_bytes == pytest.approx(block)
    # A 128K vocabulary: the loss is the fuller of the two, and the total is as before.
    assert est.logits_bytes + est.loss_transient_bytes > block
    assert est.total_bytes == pytest.approx(est.states.total_bytes + est.activations_bytes
                                            + est.working_bytes + est.logits_bytes
                                            + est.loss_transient_bytes)
    # A small vocabulary: the recomputed block is.
    small = mem.estimate(arch.preset("llama-8b", vocab_size=512), micro_batch=1,
                         capacity_bytes=1e12, stage=3, dp=8, recompute="full", flash_attention=True)
    assert small.total_bytes == pytest.approx(small.states.total_bytes + small.activations_bytes
                                              + small.working_bytes + small.recompute_bytes)


def test_sequence_parallelism_keeps_the_gathered_norm_outputs_whole():
    cfg = arch.preset("llama-8b")
    tokens = cfg.seq_len
    one = mem.block_activation_bytes(cfg, cfg.seq_len, 1, tp=1)
    eight = mem.block_activation_bytes(cfg, cfg.seq_len, 1, tp=8)
    # Everything splits eight ways but the two norm outputs the projections gather: 2h a token
    # kept whole instead of an eighth.
    assert eight == pytest.approx(one / 8 + 2 * 2 * tokens * cfg.dim * (1 - 1 / 8))
    # Megatron-LM's way (Korthikanti's Table 2) is unchanged: layer_activation_bytes.
    assert mem.layer_activation_bytes(S, B, H, A, tp=8) == pytest.approx(SBH * (34 / 8 + 80 / 8))


def test_the_vocabulary_parallel_loss_holds_16_bytes_a_logit_eagerly():
    rows, vocab = 8192, 128256
    plain = mem.loss_transient_bytes(rows, 1, vocab, tp=8)
    parallel = mem.loss_transient_bytes(rows, 1, vocab, tp=8, loss_parallel=True)
    kept = mem.logits_bytes(rows, 1, vocab, tp=8)
    assert (kept + plain) / (rows * vocab / 8) == 12
    assert (kept + parallel) / (rows * vocab / 8) == 16
    # Compiled, the loss keeps what it keeps either way.
    assert mem.loss_transient_bytes(rows, 1, vocab, tp=8, compiled=True, loss_parallel=True) \
        == mem.loss_transient_bytes(rows, 1, vocab, tp=8, compiled=True)


def _torchs_order(pp: int, m: int, rank: int, v: int, schedule: str) -> list[tuple[str, int]]:
    """The forwards and full backwards torch's own schedule lists for `rank`, with the local
    stage each runs: its `_get_pipeline_order` (GPipe, 1F1B) or its per-rank operations
    (interleaved 1F1B), from a schedule object given only the counts they read."""
    from torch.distributed.pipelining import schedules as sch

    cls = {"GPipe": sch.ScheduleGPipe, "1F1B": sch.Schedule1F1B,
           "interleaved1F1B": sch.ScheduleInterleaved1F1B}[schedule]
    made = object.__new__(cls)
    made._n_microbatches, made._num_stages = m, pp
    made.n_local_stages, made.pp_group_size = v, pp
    made.microbatches_per_round = m // max(1, m // pp)
    actions = (made._calculate_single_rank_operations(rank) if v > 1
               else made._get_pipeline_order()[rank])
    kinds = {sch._ComputationType.FORWARD: "F", sch._ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index // pp) for a in actions
            if a is not None and a.computation_type in kinds]


@pytest.mark.parametrize("v, schedule", [(1, "1F1B"), (1, "GPipe"), (2, "interleaved1F1B"),
                                         (3, "interleaved1F1B"), (4, "interleaved1F1B")])
def test_each_pipeline_rank_runs_the_order_torchs_schedule_lists(v, schedule):
    """Every rank of 2 to 8, 1 to 24 micro-batches: all that torch runs (1F1B refuses fewer
    micro-batches than ranks; interleaved, rounds that do not divide them)."""
    checked = 0
    for pp in range(2, 9):
        for m in range(1, 25):
            if (schedule == "1F1B" and m < pp) or (v > 1 and m % max(1, m // pp)):
                continue
            for rank in range(pp):
                assert mem.pipeline_rank_ops(pp, m, rank, v, schedule) == \
                    _torchs_order(pp, m, rank, v, schedule), (pp, m, rank)
                checked += 1
    assert checked > 500


def test_a_rank_is_fullest_when_its_activations_and_gradients_are():
    """1F1B, m = p = 2, first rank: F F B B. Before any backward it holds two micro-batches;
    after the first it holds one and the stage's whole gradients. With m > p a forward follows
    the first backward: p micro-batches beside the gradients."""
    two = mem.pipeline_rank_ops(2, 2, 0)
    assert two == [("F", 0), ("F", 0), ("B", 0), ("B", 0)]
    small_grads = mem.pipeline_rank_fullest(two, [10.0], [3.0], [(0.0, 0.0)])
    assert (small_grads.activations, small_grads.gradients) == (20.0, 0.0)
    big_grads = mem.pipeline_rank_fullest(two, [10.0], [30.0], [(0.0, 0.0)])
    assert (big_grads.activations, big_grads.gradients, big_grads.in_flight) == (10.0, 30.0, (1,))
    steady = mem.pipeline_rank_fullest(mem.pipeline_rank_ops(2, 4, 0), [10.0], [30.0],
                                       [(0.0, 0.0)])
    assert (steady.activations, steady.gradients) == (20.0, 30.0)
    # A backward's transient at its start, before it frees anything, or at its end, beside the
    # gradients it made.
    start = mem.pipeline_rank_fullest(two, [10.0], [3.0], [(5.0, 0.0)])
    assert (start.activations, start.gradients, start.transient) == (20.0, 0.0, 5.0)
    end = mem.pipeline_rank_fullest(two, [10.0], [30.0], [(0.0, 5.0)])
    assert (end.activations, end.gradients, end.transient, end.in_flight) == (10.0, 30.0, 5.0, (1,))


@pytest.mark.parametrize("pp, m, v", [(4, 7, 2), (4, 16, 2), (8, 16, 2), (2, 2, 2)])
def test_interleaved_ranks_hold_their_warm_up_and_one_more_forward(pp, m, v):
    """Before the first backward the first rank has run torch's warm-up (`_get_warmup_ops`)
    and one more forward, of one stage each (1/v of the rank's layers)."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    per_round = m // max(1, m // pp)
    ops = mem.pipeline_rank_ops(pp, m, 0, v, "interleaved1F1B")
    before_backward = ops.index(("B", v - 1))
    assert before_backward == min(_get_warmup_ops(0, v, per_round, pp, m) + 1, m * v)
    no_grads = mem.pipeline_rank_fullest(ops, [1.0] * v, [0.0] * v, [(0.0, 0.0)] * v)
    assert no_grads.activations == before_backward


def test_a_pipelined_fsdp_stage_keeps_its_parameters_gathered_and_gradients_whole():
    """torch.distributed.pipelining turns gradient sync and resharding off for all but the
    last micro-batch's backward: a rank holds its stage's bf16 parameters and fp32 gradients."""
    cfg = arch.preset("llama-8b")
    n = arch.param_count(cfg)
    est = mem.estimate(cfg, micro_batch=1, capacity_bytes=1e12, stage=3, dp=4, pp=2,
                       recompute="full", flash_attention=True)
    assert est.working_bytes == pytest.approx((2 + 4) * n / 2)
    fp32_reduce = mem.PRECISIONS["bf16"]
    bf16_reduce = mem.with_reduce_dtype(fp32_reduce, "bfloat16")
    assert mem.pipeline_stage_bytes(n, fp32_reduce, 2) - mem.pipeline_stage_bytes(
        n, bf16_reduce, 2) == pytest.approx(2 * n / 2)


def test_a_pipeline_stage_holds_its_micro_batches_outputs_and_on_the_last_its_logits():
    """Per micro-batch in flight: the stage's blocks and its output (the schedule starts the
    backward from it), or the head and the loss with the logits the schedule holds (eager:
    bf16 beside the fp32 log-softmax; compiled: the logits the loss keeps anyway)."""
    cfg = arch.preset("llama-8b")
    s, h, v = cfg.seq_len, cfg.dim, cfg.vocab_size
    block = mem.block_activation_bytes(cfg, s, 1, tp=2)
    first = mem.stage_activation_bytes(cfg, s, 1, 0, 4, tp=2)
    assert first == pytest.approx(8 * block + 2 * s * h / 2)
    last = mem.stage_activation_bytes(cfg, s, 1, 3, 4, tp=2)
    assert last == pytest.approx(8 * block + mem.head_activation_bytes(cfg, s, 1, tp=2)
                                 + (4 + 2) * s * v / 2)
    compiled = mem.stage_activation_bytes(cfg, s, 1, 3, 4, tp=2, compiled=True)
    assert compiled - mem.stage_activation_bytes(cfg, s, 1, 3, 4, tp=2, compiled=True,
                                                 recompute="full") \
        == pytest.approx(8 * (mem.block_activation_bytes(cfg, s, 1, tp=2, compiled=True)
                              - mem.block_activation_bytes(cfg, s, 1, tp=2, recompute="full")))


@pytest.mark.parametrize("schedule, m, first_held, last_held", [
    ("1F1B", 8, 4, 1),     # p on the first stage, one on the last
    ("GPipe", 8, 8, 8),    # every forward before any backward, on every stage
])
def test_a_pipelined_estimate_is_its_fuller_stage_times_its_micro_batches(schedule, m,
                                                                          first_held, last_held):
    cfg = arch.preset("llama-8b", vocab_size=512)   # a small head: the blocks decide
    kw = dict(micro_batch=1, capacity_bytes=1e12, stage=3, dp=2, pp=4, flash_attention=True,
              microbatches=m, schedule=schedule)
    est = mem.estimate(cfg, **kw)
    per_first = mem.stage_activation_bytes(cfg, cfg.seq_len, 1, 0, 4)
    per_last = mem.stage_activation_bytes(cfg, cfg.seq_len, 1, 3, 4)
    fullest = max(first_held * per_first, last_held * per_last)
    assert est.activations_bytes + est.logits_bytes == pytest.approx(fullest)
    if schedule == "GPipe":
        # It holds the last stage's logits for every micro-batch: with Llama 3's vocabulary
        # that stage is the fuller one by far.
        big = mem.estimate(arch.preset("llama-8b"), **kw)
        held = mem.last_stage_logits_bytes(cfg.seq_len, 1, 128256)
        assert big.logits_bytes == pytest.approx(m * held)


def test_older_schedules_keep_outputs_to_the_steps_end():
    """`step()` returning its outputs (torchtitan until October 2025) keeps the last stage's
    logits of every micro-batch until the next step; torch 2.6's stages kept every stage's
    outputs, receive buffers and input gradients too. 1F1B on 4 ranks, 8 micro-batches, a
    128K vocabulary: the last rank is fullest at its last backward, beside the logits of the
    seven micro-batches before it."""
    cfg = arch.preset("llama-8b")
    kw = dict(micro_batch=1, capacity_bytes=1e12, stage=3, dp=2, pp=4, recompute="full",
              flash_attention=True, microbatches=8)
    none, last, every = (mem.estimate(cfg, outputs_kept=kept, **kw)
                         for kept in ("none", "last", "all"))
    own = 2 * cfg.seq_len * cfg.vocab_size   # one micro-batch's bf16 logits
    held = mem.last_stage_logits_bytes(cfg.seq_len, 1, cfg.vocab_size)
    assert none.logits_bytes == held
    assert last.logits_bytes == held + 7 * own
    assert last.total_bytes == pytest.approx(none.total_bytes + 7 * own)
    assert every.total_bytes > last.total_bytes
