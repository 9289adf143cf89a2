"""Published training recipes the planner and the reviewer compare against.

Owns reference data, no logic beyond lookups and a shape for a bare parameter count:
- GPT-3 (Brown et al. 2020) Table 2.1: per model size its layers, width, heads, batch size in
  tokens and peak learning rate; App. B: linear warmup over the first 375M tokens, cosine decay
  to 10% of the peak, Adam β = (0.9, 0.95), ε = 1e-8, weight decay 0.1, gradient clip 1.0.
- torchtitan's Llama 3 flavours (pytorch/torchtitan, torchtitan/models/llama3/__init__.py) with
  the FFN widths their `multiple_of`/`ffn_dim_multiplier` rule gives and Llama 3's 128,256-token
  vocabulary (meta-llama/llama3 MODEL_CARD.md, tokenizer.py), untied embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from crucible.api.arch import GPTConfig

GPT3_WARMUP_TOKENS = 375e6  # GPT-3 App. B
GPT3_MIN_LR_RATIO = 0.1  # GPT-3 App. B: cosine decay to 10% of the peak


@dataclass(frozen=True)
class Gpt3Row:
    """One row of GPT-3's Table 2.1."""

    name: str
    params: float
    layers: int
    dim: int
    heads: int
    batch_tokens: float
    lr: float


GPT3_TABLE_2_1 = (
    Gpt3Row("GPT-3 Small", 125e6, 12, 768, 12, 0.5e6, 6.0e-4),
    Gpt3Row("GPT-3 Medium", 350e6, 24, 1024, 16, 0.5e6, 3.0e-4),
    Gpt3Row("GPT-3 Large", 760e6, 24, 1536, 16, 0.5e6, 2.5e-4),
    Gpt3Row("GPT-3 XL", 1.3e9, 24, 2048, 24, 1e6, 2.0e-4),
    Gpt3Row("GPT-3 2.7B", 2.7e9, 32, 2560, 32, 1e6, 1.6e-4),
    Gpt3Row("GPT-3 6.7B", 6.7e9, 32, 4096, 32, 2e6, 1.2e-4),
    Gpt3Row("GPT-3 13B", 13e9, 40, 5140, 40, 2e6, 1.0e-4),
    Gpt3Row("GPT-3 175B", 175e9, 96, 12288, 96, 3.2e6, 0.6e-4),
)


def gpt3_row(params: float) -> Gpt3Row:
    """The Table 2.1 row nearest in log-parameters."""
    return min(GPT3_TABLE_2_1, key=lambda row: abs(math.log(row.params / params)))


@dataclass(frozen=True)
class LlamaFlavor:
    """A torchtitan Llama 3 flavour: grouped-query attention and a SwiGLU MLP."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128256

    @property
    def params(self) -> int:
        head_dim = self.dim // self.n_heads
        attn = 2 * self.dim * self.dim + 2 * self.dim * self.n_kv_heads * head_dim
        mlp = 3 * self.dim * self.ffn_dim
        block = attn + mlp + 2 * self.dim
        return self.n_layers * block + 2 * self.vocab_size * self.dim + self.dim

    def to_gpt(self, seq_len: int) -> GPTConfig:
        """The flavour as Crucible's model spells a Llama: grouped-query attention with RoPE
        (Llama 3's base 500,000), RMSNorm and a SwiGLU MLP of the flavour's width, untied
        embeddings: what the memory model counts is this very block's."""
        return GPTConfig(layers=self.n_layers, heads=self.n_heads, dim=self.dim,
                         seq_len=seq_len, vocab_size=self.vocab_size, d_ff=self.ffn_dim,
                         tied_embeddings=False, position="rope", bias=False,
                         rope_theta=500000.0, kv_heads=self.n_kv_heads, norm="rmsnorm",
                         mlp="swiglu")


LLAMA3_FLAVORS = {
    "8B": LlamaFlavor(4096, 32, 32, 8, 14336),
    "70B": LlamaFlavor(8192, 80, 64, 8, 28672),
    "405B": LlamaFlavor(16384, 126, 128, 8, 53248),
}

# GPT-3 Table 2.1 keeps dim/layers between ~43 and 128; 128 for the 6.7B–175B models.
TARGET_ASPECT = 128
HEAD_DIM = 128
# Heads in multiples of 8, a node's GPUs, so that tensor parallelism up to a node gives each
# rank whole heads: true of GPT-3's shapes from 6.7B up (Table 2.1) and of every head count,
# 24 to 160, of the Megatron-LM configurations in Narayanan et al. 2021, Table 1.
HEAD_MULTIPLE = 8


def shape_for_params(params: float, seq_len: int, vocab_size: int = 50304) -> GPTConfig:
    """A GPT shape with about `params` parameters, for when only a count was given.

    Width is a multiple of 128 (head dimension 128), and from 1024 on of 8 heads' width
    (`HEAD_MULTIPLE`); depth makes 12·L·d² + V·d ≈ N, and among those the shape whose d/L is
    closest to GPT-3's large models (128) wins.
    """
    if params < 1e6:
        raise ValueError(f"{params:g} parameters is too small to shape a GPT; give --model")
    best, best_score = None, math.inf
    for layers in range(2, 257):
        d = (-vocab_size + math.sqrt(vocab_size**2 + 48 * layers * params)) / (24 * layers)
        step = HEAD_DIM * HEAD_MULTIPLE if d >= HEAD_DIM * HEAD_MULTIPLE else HEAD_DIM
        dim = max(HEAD_DIM, round(d / step) * step)
        count = 12 * layers * dim**2 + vocab_size * dim
        score = abs(math.log(count / params)) * 4 + abs(math.log((dim / layers) / TARGET_ASPECT))
        if score < best_score:
            best, best_score = (layers, dim), score
    layers, dim = best
    return GPTConfig(layers=layers, heads=dim // HEAD_DIM, dim=dim,
                     seq_len=seq_len, vocab_size=vocab_size)
