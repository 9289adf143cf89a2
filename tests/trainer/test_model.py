"""The GPT module builds exactly the architecture api/arch.py counts, and acts as a causal LM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crucible.api import arch
from crucible.trainer.model import GPT, apply_rope, rope_tables


def _numel_on_meta(cfg: arch.GPTConfig) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_gpt2_small_with_gpt2_settings_has_124_439_808_params():
    # GPT-2 124M as released: learned positions, biases, tied embeddings, vocab 50257.
    cfg = arch.preset("gpt2-124m", vocab_size=50257, position="learned", bias=True)
    assert arch.param_count(cfg) == 124_439_808
    assert _numel_on_meta(cfg) == 124_439_808


@pytest.mark.parametrize("name", sorted(arch.PRESETS))
@pytest.mark.parametrize("variant", [{}, {"tied_embeddings": False}, {"qk_norm": True},
                                     {"bias": True, "position": "learned"}])
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


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = dataclasses.replace(arch.PRESETS["tiny"], vocab_size=97, **kw)
    model = GPT(cfg)
    model.init_weights()
    return model


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_output_at_a_position_ignores_later_tokens(position):
    model = _tiny(position=position)
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
