"""GPT architecture as data: presets, parameter count and training FLOPs per token.

Torch-free on purpose: the planner and the config reviewer size models with these numbers, and
the spec validates a model's shape (so the operator can) without importing torch;
`trainer/model.py` builds exactly this architecture (a test checks that the real module's
parameter count equals `param_count`).

Shapes follow GPT-2 (Radford et al. 2019, nanoGPT's `model.py` naming) and the GPT-3 paper's
Table 2.1 for the larger sizes; the default block is pre-norm with rotary position embeddings
(Su et al. 2021) and no biases, as in most current LLMs. A `gpt2-exact` style config (learned
positions, biases, LayerNorm with bias, vocab 50257) reproduces GPT-2 124M's 124,439,808 params.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

Position = Literal["rope", "learned"]


_FINGERPRINT_KEYS = {"layers": "n_layer", "heads": "n_head", "dim": "d_model"}


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

    def __post_init__(self):
        for name in ("layers", "heads", "dim", "seq_len", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension; dim/heads = {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.dim

    def to_dict(self) -> dict:
        return asdict(self)

    def fingerprint(self) -> dict:
        """What a checkpoint's model hash is computed from. Its keys are frozen (like parameter
        names, they are part of every committed checkpoint): the fields were once named in
        nanoGPT's vocabulary, and renaming a field must not orphan the checkpoints made before."""
        return {_FINGERPRINT_KEYS.get(k, k): v for k, v in asdict(self).items()}


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


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


# --- counting -----------------------------------------------------------------------------------
def _norm_params(cfg: GPTConfig) -> int:
    return 2 * cfg.dim if cfg.bias else cfg.dim  # LayerNorm weight (+ bias)


def block_params(cfg: GPTConfig) -> int:
    """Parameters of one transformer block: two norms, attention, MLP."""
    d, f = cfg.dim, cfg.ffn_dim
    attn = 3 * d * d + d * d + (3 * d + d if cfg.bias else 0)  # c_attn (q,k,v) + c_proj
    mlp = d * f + f * d + (f + d if cfg.bias else 0)  # c_fc + c_proj
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
