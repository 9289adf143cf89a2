"""GPT architecture as data: presets, parameter count and training FLOPs per token.

Torch-free on purpose: the planner and the config reviewer size models with these numbers, and
the spec validates a model's shape (so the operator can) without importing torch;
`trainer/model.py` builds exactly this architecture (a test checks that the real module's
parameter count equals `param_count`).

Two families share one block with switches. GPT: shapes from GPT-2 (Radford et al. 2019,
nanoGPT's `model.py` naming) and the GPT-3 paper's Table 2.1 for the larger sizes, pre-norm with
rotary position embeddings (Su et al. 2021) and no biases, as in most current LLMs; a `gpt2-exact`
style config (learned positions, biases, LayerNorm with bias, vocab 50257) reproduces GPT-2 124M's
124,439,808 params. Llama: RMSNorm (Zhang & Sennrich 2019), a SwiGLU MLP (Shazeer 2020), grouped
query attention (Ainslie et al. 2023), RoPE with Llama 3's base, untied embeddings (Touvron et al.
2023; Llama 3, Grattafiori et al. 2024); the 1B, 3B and 8B shapes are Llama 3.2 1B, 3.2 3B and
3.1 8B's published configs, the small ones are sized in the same proportions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

Position = Literal["rope", "learned"]
Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "swiglu"]


_FINGERPRINT_KEYS = {"layers": "n_layer", "heads": "n_head", "dim": "d_model"}
# Fields that came after checkpoints existed, with their defaults (see `fingerprint`).
_ADDED_LATER = {"kv_heads": 0, "norm": "layernorm", "mlp": "gelu", "norm_eps": 1e-5}


@dataclass(frozen=True)
class GPTConfig:
    """Architecture fields only; training settings live in the job config."""

    layers: int
    heads: int
    dim: int
    seq_len: int
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 (nanoGPT): faster matmuls
    d_ff: int = 0  # 0 means 4 * dim, GPT-2's MLP width
    tied_embeddings: bool = True  # GPT-2 ties the input embedding and the output layer
    position: Position = "rope"
    bias: bool = False  # biases in linear layers and LayerNorms (GPT-2 had them; few LLMs do now)
    rope_theta: float = 10000.0  # RoFormer's base
    qk_norm: bool = False  # normalise queries and keys per head (Wortsman et al. 2023, §3.1)
    kv_heads: int = 0  # 0: one key/value head per query head; fewer: grouped-query attention
    norm: Norm = "layernorm"
    mlp: Mlp = "gelu"  # swiglu: silu(x W_gate) * (x W_up), then W_down (d_ff is the inner width)
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("layers", "heads", "dim", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; dim/heads = {self.head_dim}")
        if self.kv_heads < 0 or self.heads % self.n_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}): each key/value head serves a whole group")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): head_dim per key/value head."""
        return self.n_kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.dim

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> dict:
        """What a checkpoint's model hash is computed from. Its keys are frozen (like parameter
        names, they are part of every committed checkpoint): the fields were once named in
        nanoGPT's vocabulary, and renaming a field must not orphan the checkpoints made before.
        Fields added later count only when set away from their default, for the same reason."""
        out = {_FINGERPRINT_KEYS.get(k, k): v for k, v in asdict(self).items()
               if k not in _ADDED_LATER or v != _ADDED_LATER[k]}
        # The fused weights' row order (model.py: by key/value head group, gate and up
        # interleaved). Checkpoints from the earlier [q; k; v] and [gate; up] order hash
        # differently, so they are refused by name instead of loading with heads scrambled.
        out["fused_rows"] = FUSED_ROWS
        return out


# The row order of the fused c_attn and SwiGLU c_fc weights (model.py's `unfuse_qkv`).
FUSED_ROWS = "kv-groups"


PRESETS: dict[str, GPTConfig] = {
    # A few hundred thousand parameters: trains in seconds on CPU, for tests and the demo.
    "tiny": GPTConfig(layers=2, heads=4, dim=128, seq_len=128, vocab_size=4096),
    # GPT-2 small/medium (Radford et al. 2019, Table 2).
    "gpt2-124m": GPTConfig(layers=12, heads=12, dim=768, seq_len=1024),
    "gpt2-350m": GPTConfig(layers=24, heads=16, dim=1024, seq_len=1024),
    # GPT-3 paper Table 2.1 "Large" (760M) and "XL" (1.3B), at GPT-2's vocabulary.
    "gpt2-760m": GPTConfig(layers=24, heads=16, dim=1536, seq_len=1024),
    "1.3b": GPTConfig(layers=24, heads=16, dim=2048, seq_len=2048),
}


def _llama(layers: int, heads: int, kv_heads: int, dim: int, d_ff: int, seq_len: int,
           vocab_size: int, tied_embeddings: bool = False) -> GPTConfig:
    return GPTConfig(layers=layers, heads=heads, kv_heads=kv_heads, dim=dim, d_ff=d_ff,
                     seq_len=seq_len, vocab_size=vocab_size, tied_embeddings=tied_embeddings,
                     norm="rmsnorm", mlp="swiglu", rope_theta=500000.0)


# Llama 3's tokenizer has 128,256 tokens (a multiple of 64); the small presets take Llama 2's
# 32,000, which keeps the embedding tables from dwarfing the blocks.
PRESETS.update({
    # For tests and the demo: GQA with 2 query heads per key/value head, SwiGLU at 8/3 d.
    "llama-tiny": _llama(2, 4, 2, 128, 344, 128, 4096),
    # Llama 2's MLP ratio (8/3 d), GQA 3:1 and 4:1: 150M and 400M parameters.
    "llama-150m": _llama(16, 12, 4, 768, 2048, 2048, 32000),
    "llama-400m": _llama(24, 16, 4, 1024, 3584, 2048, 32000),
    # Llama 3.2 1B and 3B (tied embeddings) and Llama 3.1 8B, as published (config.json).
    "llama-1b": _llama(16, 32, 8, 2048, 8192, 8192, 128256, tied_embeddings=True),
    "llama-3b": _llama(28, 24, 8, 3072, 8192, 8192, 128256, tied_embeddings=True),
    "llama-8b": _llama(32, 32, 8, 4096, 14336, 8192, 128256),
})


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# --- counting -----------------------------------------------------------------------------------
def _norm_params(cfg: GPTConfig) -> int:
    # LayerNorm: weight (+ bias); RMSNorm: a weight only.
    return 2 * cfg.dim if cfg.bias and cfg.norm == "layernorm" else cfg.dim


def block_params(cfg: GPTConfig) -> int:
    """Parameters of one transformer block: two norms, attention, MLP."""
    d, f, kv = cfg.dim, cfg.ffn_dim, cfg.kv_dim
    attn = (d * (d + 2 * kv) + d * d  # c_attn (q, k, v) + c_proj
            + (d + 2 * kv + d if cfg.bias else 0))
    up = 2 * f if cfg.mlp == "swiglu" else f  # SwiGLU's c_fc holds the gate and the up projection
    mlp = d * up + f * d + (up + d if cfg.bias else 0)  # c_fc + c_proj
    qk = 2 * cfg.head_dim if cfg.qk_norm else 0  # one weight vector for q, one for k (no bias)
    return 2 * _norm_params(cfg) + attn + mlp + qk


def embedding_params(cfg: GPTConfig) -> int:
    """Token embedding (+ learned positions); the output layer when it is not tied."""
    wpe = cfg.seq_len * cfg.dim if cfg.position == "learned" else 0
    lm_head = 0 if cfg.tied_embeddings else cfg.vocab_size * cfg.dim
    return cfg.vocab_size * cfg.dim + wpe + lm_head


def param_count(cfg: GPTConfig) -> int:
    return embedding_params(cfg) + cfg.layers * block_params(cfg) + _norm_params(cfg)


def non_embedding_params(cfg: GPTConfig) -> int:
    """Kaplan et al. 2020's N: everything but the embedding tables (and an untied output layer)."""
    return param_count(cfg) - embedding_params(cfg)


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6·N_matmul + 12·L·d·T (PaLM, Chowdhery et al. 2022, App. B).

    N_matmul counts the weights that take part in matrix multiplies: every block weight plus the
    output layer (V·d, tied or not); the embedding lookup is not a matmul. The 6 is 2 FLOPs per
    multiply-add times 3 (forward, and twice that for backward). The attention term counts
    QK^T and attention·V for the full T×T square, as PaLM and torchtitan do, not half of it
    for the causal mask, so MFU figures are comparable with theirs.
    """
    t = seq_len or cfg.seq_len
    n_matmul = cfg.layers * block_params(cfg) + cfg.vocab_size * cfg.dim
    return 6.0 * n_matmul + 12.0 * cfg.layers * cfg.dim * t
