"""`crucible export`: a committed checkpoint loads in Hugging Face `transformers` and computes the
same logits as Crucible's own model; its tokenizer encodes as Crucible's does.

The reference side reads the commit with DCP's plain single-process load into a bare `GPT`
(not through the export's own path), so a wrong split, transpose or RoPE convention shows up as a
logits difference. Two short CPU runs: `llama-tiny` (GQA, SwiGLU, RMSNorm, RoPE at Llama 3's
base, untied) and `tiny` made GPT-2-exact (learned positions, biases).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from crucible.api.arch import PRESETS, preset
from crucible.trainer import huggingface as hf
from crucible.trainer.model import GPT
from tests.support.training import job_config, run_crucible, write_config

TEXT = ("def mean(xs):\n    \"\"\"Return the arithmetic mean of *xs*.\"\"\"\n    return sum(xs) / "
        "len(xs)  # raises ZeroDivisionError on []\n\nThe with statement — café, naïve ✓")
# The reference side's DCP load runs without a process group, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOLERANCE = 1e-4  # fp32 on both sides; what differs is the order of the sums


def _train(corpus, root: Path, name: str, model: dict) -> Path:
    cfg = job_config(corpus, root / "run", name=name, steps=4, evalTokens=4096)
    cfg["model"] = {**cfg["model"], **model}
    cfg["checkpoint"] = {"uri": str(root / "ckpt"), "everySteps": 2, "everyMinutes": 0}
    path = write_config(cfg, root / "job.yaml")
    train = run_crucible("train", "--config", str(path))
    assert train.returncode == 0, train.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def llama_job(corpus, tmp_path_factory) -> Path:
    return _train(corpus, tmp_path_factory.mktemp("llama"), "llamaexport",
                  {"preset": "llama-tiny"})


@pytest.fixture(scope="module")
def gpt2_job(corpus, tmp_path_factory) -> Path:
    return _train(corpus, tmp_path_factory.mktemp("gpt2"), "gpt2export",
                  {"preset": "tiny", "position": "learned", "bias": True})


def _export(job: Path, out: Path, *args: str):
    return run_crucible("export", "--config", str(job), "--out", str(out), *args)


def crucible_logits(job: Path, step: int, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of Crucible's model holding the commit of `step`, read by DCP itself."""
    import torch.distributed.checkpoint as dcp

    from crucible.api.spec import load_train_config

    cfg = load_train_config(job)
    model = GPT(cfg.model.to_arch())
    model.init_weights()
    state = {"app": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=str(Path(cfg.checkpoint.uri) / f"step_{step}"))
    model.load_state_dict(state["app"]["model"])
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0]


def hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weight
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


def assert_same_model(job: Path, folder: Path, step: int, architecture: str, corpus) -> float:
    """The folder's tokenizer encodes TEXT as Crucible's does and decodes it back; its model's
    logits on those tokens match Crucible's. Returns the largest logits difference."""
    from transformers import AutoTokenizer

    from crucible.trainer.tokenizer.codec import open_codec

    assert json.loads((folder / "config.json").read_text())["architectures"] == [architecture]
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT)["input_ids"]
    assert ids == open_codec(corpus.tokenizer).encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|endoftext|>", 0, 1)
    # The one documented difference: HF takes a separator written in the text for the token.
    quoted = "a <|endoftext|> b"
    assert 0 in tok(quoted)["input_ids"] and 0 not in open_codec(corpus.tokenizer).encode(quoted)
    diff = (hf_logits(folder, ids) - crucible_logits(job, step, ids)).abs().max().item()
    print(f"{architecture} step {step}: max |logits difference| {diff:.3g}")
    assert diff < TOLERANCE
    return diff


def test_llama_export_loads_in_transformers_with_crucibles_logits(llama_job, tmp_path, corpus):
    out = tmp_path / "hf"
    done = _export(llama_job, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported step 4" in done.stdout and "LlamaForCausalLM" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"])
    config = json.loads((out / "config.json").read_text())
    llama = preset("llama-tiny")
    assert (config["num_key_value_heads"], config["intermediate_size"], config["rope_theta"],
            config["tie_word_embeddings"], config["max_position_embeddings"]) == (
        llama.n_kv_heads, llama.ffn_dim, llama.rope_theta, False, llama.seq_len)
    assert_same_model(llama_job, out, 4, "LlamaForCausalLM", corpus)


def test_gpt2_export_sharded_and_an_older_step(gpt2_job, tmp_path, corpus):
    out = tmp_path / "hf"
    done = _export(gpt2_job, out, "--step", "2", "--max-shard-size", "300KB")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported step 2" in done.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / name).is_file() for name in shards)
    assert not (out / "model.safetensors").exists()
    older = assert_same_model(gpt2_job, out, 2, "GPT2LMHeadModel", corpus)
    # Step 2 is not step 4: the newest commit's logits are elsewhere.
    from crucible.trainer.tokenizer.codec import open_codec

    ids = open_codec(corpus.tokenizer).encode(TEXT)
    assert (hf_logits(out, ids) - crucible_logits(gpt2_job, 4, ids)).abs().max() > 100 * older


def test_errors_are_one_line(llama_job, tmp_path, corpus):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("someone else's")

    def fails(job: Path, *args: str, out: Path = tmp_path / "never") -> str:
        done = _export(job, out, *args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert len(done.stderr.splitlines()) <= 3, done.stderr  # progress, error, hint
        assert not (tmp_path / "never").exists() and [p.name for p in busy.iterdir()] == ["notes.txt"]
        return done.stderr

    assert "step 3 is not a committed checkpoint" in fails(llama_job, "--step", "3")
    assert "the newest before it is step 2" in fails(llama_job, "--step", "3")
    assert "is not an empty folder" in fails(llama_job, out=busy)
    assert "--max-shard-size 5 gigs: Unit" in fails(llama_job, "--max-shard-size", "5 gigs")

    cfg = yaml.safe_load(llama_job.read_text())
    cfg["checkpoint"]["uri"] = str(tmp_path / "empty")
    assert "no committed checkpoint under" in fails(write_config(cfg, tmp_path / "a.yaml"))

    del cfg["data"]["tokenizer"]
    assert "no data.tokenizer" in fails(write_config(cfg, tmp_path / "b.yaml"))
    cfg["data"]["tokenizer"] = str(tmp_path / "missing.json")
    assert "does not exist" in fails(write_config(cfg, tmp_path / "c.yaml"))

    cfg["model"] = {"preset": "tiny", "vocabSize": corpus.vocab_size}
    err = fails(write_config(cfg, tmp_path / "d.yaml"))
    assert "GPT2LMHeadModel needs model.position: learned (is rope), model.bias: true" in err


# --- the mapping, without a run --------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_llama_preset_is_llama_and_gpt2_124m_with_learned_positions_is_gpt2(name):
    cfg = preset(name)
    if name.startswith("llama"):
        assert hf.target_for(cfg) == hf.LLAMA
        return
    with pytest.raises(hf.ExportError, match="LlamaForCausalLM needs model.norm: rmsnorm"):
        hf.target_for(cfg)
    assert hf.target_for(preset(name, position="learned", bias=True)) == hf.GPT2


def test_refusals_name_each_field_that_differs():
    gqa_gpt = preset("gpt2-124m", position="learned", bias=True, kv_heads=4, qk_norm=True)
    with pytest.raises(hf.ExportError) as err:
        hf.target_for(gqa_gpt)
    assert "model.qkNorm: false (is true), model.kvHeads: 0 (one per query head) (is 4)" in str(
        err.value)


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_every_tensor_has_one_place_and_bf16_is_a_cast(name):
    cfg = preset(name, position="learned", bias=True) if name == "tiny" else preset(name)
    model = GPT(cfg)
    model.init_weights()
    state = model.state_dict()
    target = hf.target_for(cfg)
    out = hf.hf_state_dict(cfg, target, state, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in out.values())
    assert sum(t.numel() for t in out.values()) == sum(p.numel() for p in model.parameters())
    state.pop("ln_f.weight")
    with pytest.raises(hf.ExportError, match="missing \\['ln_f.weight'\\]"):
        hf.hf_state_dict(cfg, target, state)
