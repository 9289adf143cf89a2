"""Crucible's GPT as a Hugging Face `transformers` model: which HF architecture it is, its
config.json, its weights under HF's names, and the model folder on disk.

Owns the mapping and the folder. Must not: read checkpoints (`weights` does), or import
`transformers` (not an image dependency: the tests load the folders with it).

Two targets, each matched field by field (`target_for`), and anything else refused with the
fields to change:
- `LlamaForCausalLM` (transformers `models/llama/modeling_llama.py`): RMSNorm, SwiGLU, RoPE,
  grouped-query attention, tied or untied embeddings. Crucible's RoPE rotates the two halves of a
  head (`rotate_half`) with inv_freq = theta^(-2i/head_dim), HF Llama's own convention, so q and k
  are copied as they are, without the row permutation that Meta's interleaved-pair checkpoints
  need (HF's `convert_llama_weights_to_hf.py`, `permute`); the export test holds the logits equal.
- `GPT2LMHeadModel` (`models/gpt2/modeling_gpt2.py`): learned positions, biases, LayerNorm, tanh
  GELU (HF's `gelu_new`), tied embeddings, one key/value head per query head. HF's GPT-2 keeps its
  matrices in `Conv1D`, stored (in, out): the four in `_GPT2_CONV1D` are transposed, the same list
  nanoGPT's `from_pretrained` transposes the other way.

Fused weights: `c_attn` rows are grouped per key/value head and SwiGLU's `c_fc` rows alternate
gate and up (`model.unfuse_qkv`, `model.unfuse_gate_up`). Llama's names split them; HF's GPT-2
fuses `c_attn` as [q; k; v], so its rows are put in that order.

The folder is what `save_pretrained` writes: `model.safetensors`, or shards with
`model.safetensors.index.json` once the weights pass `max_shard_size` (split by huggingface_hub's
`split_torch_state_dict_into_shards`, whose 5 GB default the Hub's models follow),
`config.json`, `generation_config.json`, and the job's tokenizer.json copied as it is, with
`tokenizer_config.json` and `special_tokens_map.json` naming its special tokens.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from crucible.api.arch import GPTConfig
from crucible.trainer.model import unfuse_gate_up, unfuse_qkv

LLAMA, GPT2 = "llama", "gpt2"
ARCHITECTURES = {LLAMA: "LlamaForCausalLM", GPT2: "GPT2LMHeadModel"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ExportError(ValueError):
    """A model or tokenizer that cannot be exported; the message says why and what would do."""


# --- which architecture ----------------------------------------------------------------------
@dataclass(frozen=True)
class Need:
    """One field an HF architecture fixes: the job spec's name for it, and the value it needs."""

    field: str  # model.<field> in the job spec
    want: str  # what to write there
    holds: Callable[[GPTConfig], bool]
    has: Callable[[GPTConfig], object]  # the model's value, for the message


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _equal(field: str, attr: str, want) -> Need:
    return Need(field, _yaml(want), lambda c: getattr(c, attr) == want, lambda c: getattr(c, attr))


NEEDS: dict[str, tuple[Need, ...]] = {
    LLAMA: (_equal("norm", "norm", "rmsnorm"), _equal("mlp", "mlp", "swiglu"),
            _equal("position", "position", "rope"), _equal("qkNorm", "qk_norm", False)),
    GPT2: (_equal("position", "position", "learned"), _equal("bias", "bias", True),
           _equal("norm", "norm", "layernorm"), _equal("mlp", "mlp", "gelu"),
           _equal("tiedEmbeddings", "tied_embeddings", True), _equal("qkNorm", "qk_norm", False),
           Need("kvHeads", "0 (one per query head)", lambda c: c.n_kv_heads == c.heads,
                lambda c: c.kv_heads)),
}


def mismatches(cfg: GPTConfig, target: str) -> list[Need]:
    return [need for need in NEEDS[target] if not need.holds(cfg)]


def target_for(cfg: GPTConfig) -> str:
    """LLAMA or GPT2, whichever HF architecture `cfg` is exactly; ExportError saying, for each,
    which fields differ and what they would need to be."""
    missed = {target: mismatches(cfg, target) for target in NEEDS}
    for target, needs in missed.items():
        if not needs:
            return target
    raise ExportError("the model matches no Hugging Face architecture export writes: " + "; ".join(
        f"{ARCHITECTURES[target]} needs " + ", ".join(
            f"model.{n.field}: {n.want} (is {_yaml(n.has(cfg))})" for n in needs)
        for target, needs in missed.items()))


# --- config.json -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's special tokens. Crucible ends every document with `eos`, so the next
    begins after one: it is the beginning-of-sequence token too, as in GPT-2."""

    eos: str
    eos_id: int
    pad: str | None = None
    pad_id: int | None = None


def hf_config(cfg: GPTConfig, target: str, special: SpecialTokens, dtype: str) -> dict:
    """config.json for `target`, in the field names of its transformers config class."""
    ids = {"bos_token_id": special.eos_id, "eos_token_id": special.eos_id,
           "pad_token_id": special.pad_id}
    common = {"architectures": [ARCHITECTURES[target]], "model_type": target,
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tied_embeddings,
              "initializer_range": 0.02, "use_cache": True, "dtype": dtype, **ids}
    if target == LLAMA:
        return {**common, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
                "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
                "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
                "rms_norm_eps": cfg.norm_eps, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
                "attention_dropout": 0.0,
                # transformers 5 reads rope_parameters; 4.x reads the flat rope_theta.
                "rope_theta": cfg.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    # Crucible trains without dropout; GPT2Config's defaults (0.1) would add it to fine-tuning.
    return {**common, "n_positions": cfg.seq_len, "n_embd": cfg.dim, "n_layer": cfg.layers,
            "n_head": cfg.heads, "n_inner": cfg.ffn_dim, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True}


def generation_config(special: SpecialTokens) -> dict:
    return {"bos_token_id": special.eos_id, "eos_token_id": special.eos_id,
            "pad_token_id": special.pad_id}


def tokenizer_config(special: SpecialTokens, seq_len: int) -> dict:
    """tokenizer_config.json for a tokenizer.json: HF's fast tokenizer, which adds no token of
    its own around the text (Crucible's shards have none either)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
            "clean_up_tokenization_spaces": False, **special_tokens_map(special)}


def special_tokens_map(special: SpecialTokens) -> dict:
    tokens = {"bos_token": special.eos, "eos_token": special.eos}
    return tokens | ({"pad_token": special.pad} if special.pad is not None else {})


# --- weights -----------------------------------------------------------------------------------
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of Crucible's model state by name, with its shape (the DCP keys' contract)."""
    d, f, kv, v = cfg.dim, cfg.ffn_dim, cfg.kv_dim, cfg.vocab_size
    up = 2 * f if cfg.mlp == "swiglu" else f
    with_bias = {"attn.c_attn": (d + 2 * kv, d), "attn.c_proj": (d, d), "mlp.c_fc": (up, d),
                 "mlp.c_proj": (d, f)}
    norm_bias = cfg.bias and cfg.norm == "layernorm"
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, d), "lm_head.weight": (v, d),
                                          "ln_f.weight": (d,)}
    if norm_bias:
        shapes["ln_f.bias"] = (d,)
    if cfg.position == "learned":
        shapes["wpe.weight"] = (cfg.seq_len, d)
    for i in range(cfg.layers):
        for name, shape in with_bias.items():
            shapes[f"h.{i}.{name}.weight"] = shape
            if cfg.bias:
                shapes[f"h.{i}.{name}.bias"] = shape[:1]
        for norm in ("ln_1", "ln_2"):
            shapes[f"h.{i}.{norm}.weight"] = (d,)
            if norm_bias:
                shapes[f"h.{i}.{norm}.bias"] = (d,)
        if cfg.qk_norm:
            shapes[f"h.{i}.attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"h.{i}.attn.k_norm.weight"] = (cfg.head_dim,)
    return shapes


def check_shapes(cfg: GPTConfig, state: dict[str, torch.Tensor]) -> None:
    """Crucible's model state holds exactly the tensors `cfg` has, each of its shape."""
    want = expected_shapes(cfg)
    missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or extra:
        raise ExportError(f"the checkpoint's model state does not fit the model: missing "
                          f"{missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise ExportError(f"{name} is {tuple(state[name].shape)} in the checkpoint, the "
                              f"model needs {shape}")


def _llama_layer(cfg: GPTConfig, get: Callable[[str], torch.Tensor],
                 i: int) -> Iterable[tuple[str, torch.Tensor]]:
    src, dst = f"h.{i}.", f"model.layers.{i}."
    yield dst + "input_layernorm.weight", get(src + "ln_1.weight")
    yield dst + "post_attention_layernorm.weight", get(src + "ln_2.weight")
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        q, k, v = unfuse_qkv(get(f"{src}attn.c_attn.{kind}"), cfg)
        gate, up = unfuse_gate_up(get(f"{src}mlp.c_fc.{kind}"))
        yield from ((f"{dst}self_attn.{n}_proj.{kind}", t) for n, t in zip("qkv", (q, k, v)))
        yield f"{dst}self_attn.o_proj.{kind}", get(f"{src}attn.c_proj.{kind}")
        yield f"{dst}mlp.gate_proj.{kind}", gate
        yield f"{dst}mlp.up_proj.{kind}", up
        yield f"{dst}mlp.down_proj.{kind}", get(f"{src}mlp.c_proj.{kind}")


def _llama(cfg: GPTConfig, get) -> Iterable[tuple[str, torch.Tensor]]:
    yield "model.embed_tokens.weight", get("wte.weight")
    for i in range(cfg.layers):
        yield from _llama_layer(cfg, get, i)
    yield "model.norm.weight", get("ln_f.weight")


def _gpt2(cfg: GPTConfig, get) -> Iterable[tuple[str, torch.Tensor]]:
    # Same names under `transformer.`, positions in wpe; Conv1D matrices transposed.
    for name in expected_shapes(cfg):
        if name != "lm_head.weight":
            tensor = get(name)
            if ".attn.c_attn." in name:
                tensor = torch.cat(unfuse_qkv(tensor, cfg))
            yield f"transformer.{name}", tensor.t() if name.endswith(_GPT2_CONV1D) else tensor


def _owned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy in `dtype` (one copy, whatever the view)."""
    return tensor.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def hf_state_dict(cfg: GPTConfig, target: str, state: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Crucible's full model state (parameter names as in model.py) under `target`'s names, in
    `dtype`, every tensor contiguous and owning its memory (safetensors refuses views that share
    a buffer). A tied output layer is left out: HF ties it back from the embedding on load."""
    check_shapes(cfg, state)
    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    convert = _llama if target == LLAMA else _gpt2
    out = {name: _owned(t, dtype) for name, t in convert(cfg, get)}
    if not cfg.tied_embeddings:
        out["lm_head.weight"] = _owned(get("lm_head.weight"), dtype)
    left = sorted(state.keys() - used - {"lm_head.weight"})
    if left:
        raise ExportError(f"{ARCHITECTURES[target]} has no place for {left[:5]}")
    return out


# --- the folder ------------------------------------------------------------------------------
def check_shard_size(max_shard_size: str | int) -> None:
    """ExportError unless huggingface_hub reads `max_shard_size` ("5GB", "300KB", bytes)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
    except ValueError as err:
        raise ExportError(f"--max-shard-size {max_shard_size}: {err}") from None


def write_weights(folder: Path, tensors: dict[str, torch.Tensor], max_shard_size: str | int,
                  progress: bool) -> list[str]:
    """model.safetensors, or its shards and index, as `save_pretrained` writes them (the
    recipe in huggingface_hub's `split_torch_state_dict_into_shards` docs); the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from tqdm import tqdm

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in tqdm(split.filename_to_tensors.items(), desc="writing",
                                unit="file", disable=not progress):
        save_file({n: tensors[n] for n in names}, str(folder / filename),
                  metadata={"format": "pt"})
    files = list(split.filename_to_tensors)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        _write_json(folder / "model.safetensors.index.json", index)
        files.append("model.safetensors.index.json")
    return files


def write_folder(folder: Path, cfg: GPTConfig, target: str, tensors: dict[str, torch.Tensor],
                 tokenizer_json: Path, special: SpecialTokens, *, max_shard_size: str | int,
                 progress: bool = False) -> list[str]:
    """The whole model folder into `folder` (which exists): weights, configs, tokenizer; the
    names of the files written."""
    files = write_weights(folder, tensors, max_shard_size, progress)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")  # "float32", ...
    docs = {"config.json": hf_config(cfg, target, special, dtype),
            "generation_config.json": generation_config(special),
            "tokenizer_config.json": tokenizer_config(special, cfg.seq_len),
            "special_tokens_map.json": special_tokens_map(special)}
    for name, doc in docs.items():
        _write_json(folder / name, doc)
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    return [*files, *docs, "tokenizer.json"]


def _write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
