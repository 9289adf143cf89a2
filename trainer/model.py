"""The GPT, single-device code, readable top to bottom (smallest part first, whole model last).

Follows nanoGPT's `model.py` (karpathy/nanoGPT) and GPT-2 (Radford et al. 2019): the parameter
names (`wte`, `wpe`, `h.N.attn.c_attn`, `c_proj`, `ln_f`, `lm_head`) are GPT-2's and are a
contract, since they become checkpoint keys. Differences, each a config switch in api/arch.py:
rotary position embeddings (Su et al. 2021) instead of learned ones, no biases, optional
QK-norm (Wortsman et al. 2023). The architecture's parameter count is `arch.param_count`; a test
holds the two equal, and with GPT-2's own settings both give 124,439,808.

This module never imports torch.distributed: sharding, compile and activation checkpointing are
applied from the outside by `parallel.py`. Weights are created on whatever device the module is
built on (the meta device, for sharded training) and filled by `init_weights`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from crucible.api.arch import GPTConfig


def rope_tables(cfg: GPTConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (T, head_dim/2), in fp32."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x (B, nh, T, hd) by the position's angle."""
    T = x.size(-2)
    x1, x2 = x.float().chunk(2, dim=-1)  # each (B, nh, T, hd/2)
    cos, sin = cos[:T], sin[:T]  # (T, hd/2), broadcast over B and nh
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim, bias=cfg.bias)  # q, k, v at once
        self.c_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        if cfg.qk_norm:
            self.q_norm = nn.LayerNorm(cfg.head_dim, bias=False)
            self.k_norm = nn.LayerNorm(cfg.head_dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, C = x.size()
        nh, hd = self.cfg.heads, self.cfg.head_dim
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Flash / memory-efficient kernels on GPU, the math kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's tanh GELU


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.position == "learned":
            self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight  # one tensor, two uses (GPT-2, Press & Wolf 2017)
        if cfg.position == "rope":
            # Derived from the config, never trained or saved (non-persistent buffers).
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim // 2), persistent=False)

    @torch.no_grad()
    def init_weights(self, generator_for=None) -> None:
        """GPT-2's scheme: N(0, 0.02) for matrices and embeddings, N(0, 0.02/sqrt(2L)) for the
        projections that write into the residual stream (GPT-2 paper §2.3), zero biases, unit
        norms. `generator_for(name, shape) -> Tensor` may supply each full initial tensor (the
        sharded path uses it so every world size starts from the same weights); without it,
        tensors are filled in place from torch's global RNG.
        """
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                std = residual_std
            elif param.dim() >= 2:
                std = 0.02
            else:
                std = None  # biases and norm weights
            if std is None:
                value = 1.0 if ("ln_" in name or "_norm" in name) and name.endswith("weight") else 0.0
                param.fill_(value)
            elif generator_for is None:
                nn.init.normal_(param, mean=0.0, std=std)
            else:
                param.copy_(generator_for(name, std))
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, V), or the mean cross-entropy if targets given."""
        B, T = idx.size()
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seqLen {self.cfg.seq_len}")
        x = self.wte(idx)  # (B, T, C)
        rope = None
        if self.cfg.position == "learned":
            x = x + self.wpe(torch.arange(T, device=idx.device))  # (T, C) broadcast over B
        else:
            rope = (self.rope_cos, self.rope_sin)
        for block in self.h:
            x = block(x, rope)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        # fp32 softmax: bf16 logits lose the small probabilities the loss is made of.
        return F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
