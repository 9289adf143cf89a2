"""The GPT module builds exactly the architecture api/arch.py counts, and acts as a causal LM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crucible.api import arch
from crucible.trainer.model import GPT, apply_rope, fuse_qkv, rope_tables, unfuse_qkv


def _numel_on_meta(cfg: arch.GPTConfig) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_gpt2_small_with_gpt2_settings_has_124_439_808_params():
    # GPT-2 124M as released: learned positions, biases, tied embeddings, vocab 50257.
    cfg = arch.preset("gpt2-124m", vocab_size=50257, position="learned", bias=True)
    assert arch.param_count(cfg) == 124_439_808
    assert _numel_on_meta(cfg) == 124_439_808


# The published totals of the models whose shapes the Llama presets take (their config.json).
@pytest.mark.parametrize("name, published", [("llama-1b", 1_235_814_400),
                                              ("llama-3b", 3_212_749_824),
                                              ("llama-8b", 8_030_261_248)])
def test_llama_presets_have_the_published_parameter_counts(name, published):
    assert arch.param_count(arch.PRESETS[name]) == published


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
@pytest.mark.parametrize("variant", [{}, {"tied_embeddings": False}, {"qk_norm": True},
                                     {"bias": True, "position": "learned"}, {"kv_heads": 1},
                                     {"norm": "rmsnorm", "mlp": "swiglu", "d_ff": 96}])
def test_module_parameter_count_equals_formula(name, variant):
    cfg = dataclasses.replace(arch.PRESETS[name], **variant)
    assert _numel_on_meta(cfg) == arch.param_count(cfg)


def test_flops_per_token_by_hand_for_gpt2_small():
    cfg = arch.preset("gpt2-124m", vocab_size=50257, position="learned", bias=True)
    per_block = 7_087_872  # 2 LN (2·1536) + attn (4·768² + 4·768) + MLP (2·768·3072 + 3072 + 768)
    assert arch.block_params(cfg) == per_block
    n_matmul = 12 * per_block + 50257 * 768  # blocks + output layer
    expected = 6 * n_matmul + 12 * 12 * 768 * 1024  # PaLM App. B: 6N + 12·L·d·T
    assert arch.flops_per_token(cfg) == expected == 855_157_248


def test_flops_per_token_by_hand_for_llama_8b():
    # GQA: q and o are d x d, k and v d x 1024 (8 heads of 128); SwiGLU: three d x 14336.
    d, f, kv, layers, vocab, T = 4096, 14336, 1024, 32, 128256, 8192
    per_block = 2 * d + (2 * d * d + 2 * d * kv) + 3 * d * f
    assert arch.block_params(arch.PRESETS["llama-8b"]) == per_block
    expected = 6 * (layers * per_block + vocab * d) + 12 * layers * d * T
    assert arch.flops_per_token(arch.PRESETS["llama-8b"]) == expected


def test_kv_heads_must_divide_heads():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        arch.preset("llama-tiny", kv_heads=3)


def test_fingerprint_keeps_the_old_field_names_and_names_the_fused_row_order():
    # The fields added for Llama count only away from their default; the fused weights' row
    # order is named, so a checkpoint written in the earlier [q; k; v] order (whose hash lacks
    # it) is refused as another architecture instead of loading with its heads scrambled.
    assert arch.PRESETS["tiny"].fingerprint() == {
        "n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 128, "vocab_size": 4096,
        "d_ff": 0, "tied_embeddings": True, "position": "rope", "bias": False,
        "rope_theta": 10000.0, "qk_norm": False, "fused_rows": "kv-groups"}


def test_grouped_attention_equals_attention_from_separate_projections():
    # The fused layout's meaning, computed the textbook way: q, k, v from their own matrices,
    # query head i attending with key/value head i // group.
    model = _tiny("llama-tiny")
    cfg, attn = model.cfg, model.h[0].attn
    wq, wk, wv = unfuse_qkv(attn.c_attn.weight.detach(), cfg)
    x = torch.randn(2, 16, cfg.dim)
    B, T, hd, group = 2, 16, cfg.head_dim, cfg.heads // cfg.n_kv_heads
    q = (x @ wq.T).view(B, T, cfg.heads, hd).transpose(1, 2)
    k = (x @ wk.T).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2).repeat_interleave(group, 1)
    v = (x @ wv.T).view(B, T, cfg.n_kv_heads, hd).transpose(1, 2).repeat_interleave(group, 1)
    cos, sin = rope_tables(cfg)
    q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = y.transpose(1, 2).reshape(B, T, cfg.dim) @ attn.c_proj.weight.detach().T
    with torch.no_grad():
        got = attn(x, (cos[:T], sin[:T]))
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.equal(fuse_qkv(wq, wk, wv, cfg), attn.c_attn.weight.detach())
    assert arch.PRESETS["llama-tiny"].fingerprint()["kv_heads"] == 2


def _tiny(preset: str = "tiny", **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dataclasses.replace(arch.PRESETS[preset], vocab_size=97, **kw)
    model = GPT(cfg)
    model.init_weights()
    return model


@pytest.mark.parametrize("preset, position", [("tiny", "rope"), ("tiny", "learned"),
                                              ("llama-tiny", "rope")])
def test_output_at_a_position_ignores_later_tokens(preset, position):
    model = _tiny(preset, position=position)
    idx = torch.randint(0, 97, (2, 32))
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 97
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert a.shape == (2, 32, 97)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5)
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)


def test_rope_rotates_without_changing_norms_and_encodes_relative_position():
    cfg = arch.PRESETS["tiny"]
    cos, sin = rope_tables(cfg)
    q = torch.randn(1, 1, cfg.seq_len, cfg.head_dim)
    rq = apply_rope(q, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-4)
    # The same vector at positions (i, j) and (i+5, j+5) gives the same dot product.
    v = torch.randn(cfg.head_dim)
    x = v.expand(1, 1, cfg.seq_len, cfg.head_dim)
    r = apply_rope(x, cos, sin)[0, 0]
    assert torch.allclose(r[3] @ r[10], r[8] @ r[15], atol=1e-4)


def test_init_scheme_matches_gpt2():
    model = _tiny()
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))
    std = model.h[0].mlp.c_fc.weight.std().item()
    assert 0.018 < std < 0.022
    residual = model.h[0].attn.c_proj.weight.std().item()
    assert residual == pytest.approx(0.02 / (2 * model.cfg.layers) ** 0.5, rel=0.1)
    assert model.lm_head.weight is model.wte.weight


def test_loss_of_untrained_model_is_near_uniform():
    model = _tiny()
    idx, targets = torch.randint(0, 97, (2, 4, 64))
    loss = model(idx, targets)
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.2


def test_sequence_longer_than_context_is_refused():
    model = _tiny()
    with pytest.raises(ValueError, match="longer than model.seqLen"):
        model(torch.zeros(1, model.cfg.seq_len + 1, dtype=torch.long))


def test_grouped_query_attention_equals_multi_head_attention_with_shared_key_value_heads():
    # A GQA model is an MHA model whose query heads in a group see copies of one key/value head.
    gqa = _tiny("llama-tiny")
    mha = GPT(dataclasses.replace(gqa.cfg, kv_heads=0))
    cfg, state = gqa.cfg, gqa.state_dict()
    d, hd, group = cfg.dim, cfg.head_dim, cfg.heads // cfg.n_kv_heads

    def widen(t: torch.Tensor) -> torch.Tensor:  # (kv_dim, d) -> (d, d), each head `group` times
        return t.view(cfg.n_kv_heads, hd, d).repeat_interleave(group, 0).reshape(d, d)

    for key, w in list(state.items()):
        if key.endswith("attn.c_attn.weight"):
            q, k, v = unfuse_qkv(w, gqa.cfg)
            state[key] = fuse_qkv(q, widen(k), widen(v), mha.cfg)
    mha.load_state_dict(state)
    mha.rope_cos.copy_(gqa.rope_cos), mha.rope_sin.copy_(gqa.rope_sin)
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        assert torch.allclose(gqa(idx), mha(idx), atol=1e-5)


def test_llama_blocks_are_rmsnorm_and_swiglu_with_untied_head():
    model = _tiny("llama-tiny")
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and isinstance(model.h[0].ln_1, torch.nn.RMSNorm)
    assert torch.equal(model.h[0].ln_2.weight, torch.ones_like(model.h[0].ln_2.weight))
    assert model.h[0].mlp.c_fc.weight.shape == (2 * model.cfg.ffn_dim, model.cfg.dim)
    assert model.lm_head.weight is not model.wte.weight
    x = torch.randn(3, model.cfg.dim)
    gate, up = (x @ model.h[0].mlp.c_fc.weight.T).unflatten(-1, (-1, 2)).unbind(-1)  # alternating rows
    expected = (torch.nn.functional.silu(gate) * up) @ model.h[0].mlp.c_proj.weight.T
    assert torch.allclose(model.h[0].mlp(x), expected, atol=1e-6)


def test_rope_in_bf16_stays_close_to_fp32():
    cfg = arch.PRESETS["llama-tiny"]
    cos, sin = rope_tables(cfg)
    q = torch.randn(2, cfg.heads, cfg.seq_len, cfg.head_dim)
    exact = apply_rope(q, cos, sin)
    fast = apply_rope(q.bfloat16(), cos, sin)
    assert fast.dtype == torch.bfloat16
    assert torch.allclose(fast.float(), exact, atol=0.05, rtol=0.02)


def test_rope_rounds_exactly_as_the_two_halves_computed_apart():
    # The rotation is written over the whole head (x·cos + roll(x)·signed_sin) to launch half
    # the kernels; it must round exactly like RoFormer's form on the halves, in fp32 and bf16.
    cfg = arch.PRESETS["llama-tiny"]
    cos, signed_sin = rope_tables(cfg)
    half = cfg.head_dim // 2
    c, s = cos[:, :half], signed_sin[:, half:]
    assert torch.equal(signed_sin[:, :half], -s)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, cfg.heads, cfg.seq_len - 3, cfg.head_dim).to(dtype)
        x1, x2 = x.chunk(2, dim=-1)
        cc, ss = c[:x.size(2)].to(dtype), s[:x.size(2)].to(dtype)
        reference = torch.cat([x1 * cc - x2 * ss, x1 * ss + x2 * cc], dim=-1)
        assert torch.equal(apply_rope(x, cos, signed_sin), reference), dtype


def test_rope_forward_and_backward_dispatch_a_handful_of_ops():
    # Eagerly each dispatched op is a kernel launch (and host time) on a GPU: the rotation of
    # queries and keys is 4 ops forward and about as many backward, once per block for both.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    cfg = arch.PRESETS["llama-tiny"]
    cos, signed_sin = rope_tables(cfg)
    x = torch.randn(2, cfg.heads + cfg.n_kv_heads, cfg.seq_len, cfg.head_dim, requires_grad=True)
    with Count() as count:
        apply_rope(x, cos, signed_sin).sum().backward()
    compute = [op for op in count.ops if "roll" in op or "mul" in op or "add" in op]
    assert len(compute) <= 8, count.ops
    assert len(count.ops) <= 14, count.ops
