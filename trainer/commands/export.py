"""`crucible export --config job.yaml --out DIR [--step N]`: a committed checkpoint and the job's
tokenizer as a Hugging Face model folder, which `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load.

Llama-style models become `LlamaForCausalLM`, GPT-2-exact ones `GPT2LMHeadModel`
(`trainer/huggingface.py` says which fields decide, and refuses the rest by name). The weights
are read like `crucible eval` reads them (`trainer/weights.py`: the model's part of the newest
commit, or of step N, verified; no optimizer state) and rank 0 writes the folder: into
`DIR.partial` first, renamed to DIR once complete, so a folder at DIR is never half-written.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="the job config (or PretrainJob) trained with")
    parser.add_argument("--out", required=True, type=Path,
                        help="the model folder to write (must not exist, or be empty)")
    parser.add_argument("--step", type=int, help="the committed step to export (default: newest)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights' dtype (default: float32, the checkpoint's own: exact)")
    # huggingface_hub's split_torch_state_dict_into_shards default, which the Hub's models follow.
    parser.add_argument("--max-shard-size", default="5GB",
                        help="split model.safetensors into files of at most this size, with an "
                        "index, as save_pretrained does (default: 5GB)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar (default: when stderr is a terminal)")


def _say(message: str) -> None:
    print(f"crucible export: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.cli import UserError, load_checkpointed_job

    cfg = load_checkpointed_job(args.config, "export")
    if not cfg.data.tokenizer:
        raise UserError("the config has no data.tokenizer: the model folder needs the tokenizer "
                        "the shards were encoded with",
                        hint="set data.tokenizer to its tokenizer.json")
    out = args.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder", hint="choose a new --out")

    from crucible.trainer import huggingface as hf

    model_cfg = cfg.model.to_arch()
    try:
        target = hf.target_for(model_cfg)
        hf.check_shard_size(args.max_shard_size)
    except hf.ExportError as err:
        raise UserError(str(err)) from None
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    from crucible.trainer import parallel
    from crucible.trainer.checkpoint import CheckpointError
    from crucible.trainer.weights import NoCommit, full_state, load_committed

    with tempfile.TemporaryDirectory(prefix="crucible-export-") as scratch:
        tokenizer, special = _tokenizer(cfg.data.tokenizer, Path(scratch))
        env = parallel.init_distributed()
        try:
            if env.is_main:
                _say(f"loading {cfg.checkpoint.uri} ("
                     + (f"step {args.step}" if args.step is not None else "newest commit") + ")")
            model, manifest = load_committed(cfg, env, step=args.step, exact=True)
            state = full_state(model)
            del model
            if env.is_main:
                files = _write(out, model_cfg, target, state, tokenizer, special, args, progress)
        except (CheckpointError, NoCommit, hf.ExportError) as err:
            raise UserError(str(err)) from None
        finally:
            parallel.shutdown()
    if env.is_main:
        step = manifest["step"]
        print(f"exported step {step} ({cfg.checkpoint.uri}/step_{step}) as "
              f"{hf.ARCHITECTURES[target]} to {out}: {', '.join(files)}")
    return 0


def _tokenizer(path: str, scratch: Path):
    """The job's tokenizer.json as a local file (downloaded when an s3:// URI) and its special
    tokens; UserError for what the folder cannot carry."""
    from crucible.trainer import storage
    from crucible.trainer.cli import UserError
    from crucible.trainer.huggingface import SpecialTokens
    from crucible.trainer.tokenizer.codec import CodecError, open_codec
    from crucible.trainer.tokenizer.vocabulary import EOT, PAD

    local = Path(path)
    if storage.is_s3(path):
        local = scratch / "tokenizer.json"
        try:
            storage.download_file(path, local)
        except Exception as err:  # noqa: BLE001 - any storage error: one line saying why
            raise UserError(f"data.tokenizer cannot be downloaded: "
                            f"{storage.explain(err, path)}") from None
    try:
        codec = open_codec(local)
    except CodecError as err:
        raise UserError(f"data.tokenizer: {err}") from None
    if codec.family != "hf":
        raise UserError(f"data.tokenizer {path} is a SentencePiece model; export writes "
                        "tokenizer.json tokenizers only",
                        hint="train the tokenizer with `crucible tokenizer train` (byte-level BPE)")
    pad = PAD if codec.pad_id is not None else None
    return local, SpecialTokens(EOT, codec.eot_id, pad, codec.pad_id)


def _write(out: Path, model_cfg, target: str, state: dict, tokenizer: Path, special,
           args: argparse.Namespace, progress: bool) -> list[str]:
    """Rank 0: the whole folder under DIR.partial, then renamed to DIR; the files written."""
    import shutil

    from crucible.trainer import huggingface as hf

    tensors = hf.hf_state_dict(model_cfg, target, state, hf.DTYPES[args.dtype])
    state.clear()  # the converted copy is all that is needed from here on
    size_mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
    _say(f"writing {len(tensors)} tensors ({size_mb:,.1f} MB, {args.dtype}) to {out}")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an export that died before its rename
    partial.mkdir(parents=True)
    files = hf.write_folder(partial, model_cfg, target, tensors, tokenizer, special,
                            max_shard_size=args.max_shard_size, progress=progress)
    if out.exists():
        out.rmdir()  # checked empty before any work
    partial.rename(out)
    return files
