"""The GPT, single-device code, readable top to bottom (smallest part first, whole model last).

Follows nanoGPT's `model.py` (karpathy/nanoGPT) and GPT-2 (Radford et al. 2019): the parameter
names (`wte`, `wpe`, `h.N.attn.c_attn`, `c_proj`, `ln_f`, `lm_head`) are GPT-2's and are a
contract, since they become checkpoint keys. Differences, each a config switch in api/arch.py:
rotary position embeddings (Su et al. 2021) instead of learned ones, no biases, optional
QK-norm (Wortsman et al. 2023), and the Llama family's parts: RMSNorm, a SwiGLU MLP and grouped
query attention (fewer key/value heads, each shared by a group of query heads). Fused weights
stay fused under every switch (`c_attn` holds q, k and v; SwiGLU's `c_fc` holds the gate and the
up projection): one matmul each, and `crucible export` splits them into Hugging Face's names.
Their rows are ordered so that any block of whole key/value head groups (and of whole gate/up
pairs) is contiguous: `c_attn` holds, for each key/value head, its group of query heads, then the
key, then the value (Megatron-LM's fused query_key_value order), and `c_fc` interleaves gate and
up row by row. A tensor-parallel rank's row-wise shard of either is then whole heads (whole
hidden units), the same computation as the unsharded layer on fewer heads, and a checkpoint is
one layout for every tensor-parallel degree.
The architecture's parameter count is `arch.param_count`; a test holds the two equal, and with
GPT-2's own settings both give 124,439,808.

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
    """The rotation's tables, each (T, head_dim), in fp32: cos of the angles, and sin with the
    first half negated (the sign of the rotation's first output), both repeated over the two
    halves of a head, so `apply_rope` is two multiplies and an add over the whole head."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x (B, n, T, hd) by the position's angle:
    (x1·cos − x2·sin, x2·cos + x1·sin), written as x·cos + roll(x)·signed_sin over the whole
    head. Eagerly the same roundings as the two halves computed apart (negating is exact and a
    sum does not depend on its order), in 4 ops and their 4 gradients instead of 8 and 10, each
    a kernel launch on a GPU. Compiled, the fused kernel may contract a product and a sum into
    one FMA (Triton does on CUDA) for either form, rounding a few last bits otherwise.

    In x's own dtype (the model casts the fp32 tables once per forward, `GPT.forward`): a bf16
    rotation of a bf16 query loses nothing the bf16 matmul that follows would keep, and saves
    the fp32 round trip's extra kernels and memory."""
    T = x.size(-2)
    if T != cos.size(0):
        cos, signed_sin = cos[:T], signed_sin[:T]
    cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)  # (T, hd), broadcast over B and n
    return x * cos + x.roll(x.size(-1) // 2, dims=-1) * signed_sin


def unfuse_qkv(t: torch.Tensor, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`c_attn`'s weight or bias (rows first) as the separate q (heads·hd rows, head order), k and
    v (kv_heads·hd rows each): rows are grouped per key/value head as [its query heads, k, v]."""
    group = cfg.heads // cfg.n_kv_heads
    q, k, v = t.unflatten(0, (cfg.n_kv_heads, group + 2, cfg.head_dim)).split([group, 1, 1], dim=1)
    return q.flatten(0, 2), k.flatten(0, 2), v.flatten(0, 2)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """The inverse of `unfuse_qkv`: separate q, k, v rows in c_attn's grouped order."""
    hd, nkv = cfg.head_dim, cfg.n_kv_heads
    parts = (q.unflatten(0, (nkv, -1, hd)), k.unflatten(0, (nkv, 1, hd)), v.unflatten(0, (nkv, 1, hd)))
    return torch.cat(parts, dim=1).flatten(0, 2)


def unfuse_gate_up(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU `c_fc`'s weight or bias (rows first) as gate and up: rows alternate gate, up."""
    gate, up = t.unflatten(0, (-1, 2)).unbind(1)
    return gate, up


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The inverse of `unfuse_gate_up`."""
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def norm_layer(cfg: GPTConfig, width: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=cfg.norm_eps)
    return nn.LayerNorm(width, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.c_attn = nn.Linear(cfg.dim, cfg.dim + 2 * cfg.kv_dim, bias=cfg.bias)  # q, k, v
        self.c_proj = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        if cfg.qk_norm:
            self.q_norm = nn.LayerNorm(cfg.head_dim, bias=False)
            self.k_norm = nn.LayerNorm(cfg.head_dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.size()
        group, hd = self.cfg.heads // self.cfg.n_kv_heads, self.cfg.head_dim
        # (B, T, groups, group + 2, hd): per key/value head, its query heads, the key, the value.
        # `groups` is read from the output, not the config: under tensor parallelism this rank
        # computes its own share of the groups (parallel.py).
        qkv = self.c_attn(x).unflatten(-1, (-1, group + 2, hd))
        q, k, v = qkv.split([group, 1, 1], dim=3)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Queries in (B, T, heads, hd) memory order: a copy here (a group's query heads are not
        # next to the next group's), which nothing keeps for backward, so that the rotation's
        # output, the one attention keeps, is dense in that order and attention's output needs
        # no transposed copy either. Keys and values stay views.
        q = q.reshape(B, T, -1, hd).transpose(1, 2)  # (B, heads, T, hd): head g·group + j
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)  # (B, groups, T, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Flash / memory-efficient kernels on GPU, the math kernel on CPU; with GQA each key/value
        # head serves its `group` query heads (query head i uses key/value head i // group, the
        # order above) without being copied out first.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=group > 1)  # (B, heads, T, hd)
        return self.c_proj(y.transpose(1, 2).flatten(2))  # (B, T, heads·hd)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        up = 2 * cfg.ffn_dim if self.swiglu else cfg.ffn_dim  # SwiGLU: gate and up, interleaved
        self.c_fc = nn.Linear(cfg.dim, up, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).unflatten(-1, (-1, 2)).unbind(-1)  # rows alternate
            return self.c_proj(F.silu(gate) * up)
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's tanh GELU


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = norm_layer(cfg, cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm_layer(cfg, cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T).

    In fp32: bf16 logits lose the small probabilities the loss is made of. Eager, the upcast
    is a full fp32 copy of the logits (4·B·T·V bytes, 1.6 GB for GPT-2 124M at micro-batch 8)
    before the softmax; compiled (`parallel.shard` compiles it with the blocks, as torchtitan
    compiles its loss), inductor can fuse the cast into the softmax's kernels instead."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.loss_fn = cross_entropy_loss  # a plain function: parallel.shard may compile it
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.position == "learned":
            self.wpe = nn.Embedding(cfg.seq_len, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = norm_layer(cfg, cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight  # one tensor, two uses (GPT-2, Press & Wolf 2017)
        if cfg.position == "rope":
            # Derived from the config, never trained or saved (non-persistent buffers).
            self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)

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
        """idx (B, T) token ids -> logits (B, T, V), or the mean cross-entropy if targets given.

        A pipeline stage (pipeline.py) lacks the parts other stages hold: without the embedding
        it takes the previous stage's activations (B, T, C) for `idx`, and without the head it
        returns its own."""
        return self.forward_through(idx, targets, self.h, embed=self.wte is not None,
                                    head=self.lm_head is not None)

    def forward_through(self, idx: torch.Tensor, targets: torch.Tensor | None,
                        blocks, *, embed: bool, head: bool) -> torch.Tensor:
        """`forward` over `blocks` only, embedding `idx` first when `embed` and ending with
        the head when `head` (an interleaved pipeline stage runs a share of this model's
        blocks, and embeds or ends only when it is the first or the last of all stages)."""
        B, T = idx.shape[:2]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seqLen {self.cfg.seq_len}")
        x = self.wte(idx) if embed else idx  # (B, T, C)
        rope = None
        if self.cfg.position == "learned":
            if embed:
                x = x + self.wpe(torch.arange(T, device=idx.device))  # (T, C) broadcast over B
        else:
            # fp32 tables (angles up to seq_len radians need its mantissa), cast once here
            # rather than in every block; each attention cuts them to its own length (a
            # pipeline stage's input may be one tensor-parallel rank's slice of the sequence,
            # whose length is not the attention's).
            rope = (self.rope_cos.to(x.dtype), self.rope_sin.to(x.dtype))
        for block in blocks:
            x = block(x, rope)
        if not head:
            return x
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)
