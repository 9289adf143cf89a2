"""`crucible tokenizer train | sweep | encode`: the command line of the tokenizer.

Owns: argument parsing, reading inputs, printing results, and turning bad input into `UserError`
(one line, a hint, no traceback). Must not: import numpy, tokenizers, sentencepiece or matplotlib
at import time (`crucible --help` stays fast); they load inside `run`.

    crucible tokenizer train  INPUT... --out DIR [--vocab-size N] [--kind bpe|spm-bpe|spm-unigram]
    crucible tokenizer sweep  INPUT... --out DIR [--sizes 4096,8192,...] [--model gpt2-124m]
    crucible tokenizer encode INPUT... --tokenizer FILE --out DIR [--val-fraction 0.05]

INPUT is a file, a folder or a glob: JSONL (.gz/.zst; the `text` field), Parquet, plain text
(one document per file), or a `crucible corpus run` output folder. `train` and `sweep` hold out
the same documents `encode` puts in the validation shards (same --val-fraction and --seed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crucible.trainer.cli import UserError

# The default size: the sweep's recommendation for gpt2-124m on this project's reference corpus
# (docs/tokenizer.md has the measurement and the reasoning).
DEFAULT_VOCAB_SIZE = 16384
DEFAULT_MODEL = "gpt2-124m"
VAL_FRACTION = 0.05  # documents held out for validation shards (and the sweep's measurements)


def _inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, folders or globs: JSONL(.gz/.zst), Parquet, text, or a corpus run")
    p.add_argument("--text-field", default="text", help="JSONL/Parquet text field (default text)")
    p.add_argument("--max-mb", type=float, default=None,
                   help="read at most this many MB of text (default: everything)")
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION,
                   help=f"share of documents held out for validation (default {VAL_FRACTION})")
    p.add_argument("--seed", type=int, default=0, help="seed of the document split (default 0)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars (default: when stderr is a terminal)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from crucible.trainer.tokenizer.trainers import DEFAULT_KIND, KINDS

    sub = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = sub.add_parser("train", help="train a tokenizer on the training split")
    _inputs(train)
    train.add_argument("--out", required=True, help="folder for tokenizer.json/.model + metadata")
    train.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                       help=f"vocabulary size, rounded up to a multiple of 128 (default "
                            f"{DEFAULT_VOCAB_SIZE}: see docs/tokenizer.md)")
    train.add_argument("--kind", choices=KINDS, default=DEFAULT_KIND,
                       help="bpe (HF byte-level, default) or SentencePiece with byte fallback")
    train.add_argument("--min-frequency", type=int, default=None,
                       help="BPE: merge only pairs seen this often (default 2)")

    sweep = sub.add_parser("sweep", help="measure several vocabulary sizes and recommend one")
    _inputs(sweep)
    sweep.add_argument("--out", required=True, help="folder for v<size>/ tokenizers, sweep.json, "
                       "sweep.png")
    sweep.add_argument("--sizes", default=None,
                       help="comma-separated vocabulary sizes (default 4096,...,131072)")
    sweep.add_argument("--kind", choices=KINDS, default=DEFAULT_KIND)
    sweep.add_argument("--model", default=DEFAULT_MODEL,
                       help="planned model: a preset or a PretrainJob / job config / torchtitan / "
                            f"nanoGPT file (default {DEFAULT_MODEL})")
    sweep.add_argument("--seq-len", type=int, default=None,
                       help="planned context length (default: the model's)")
    sweep.add_argument("--min-frequency", type=int, default=None)
    sweep.add_argument("--json", action="store_true", help="print sweep.json instead of the table")

    enc = sub.add_parser("encode", help="tokenize documents into train/val shards")
    _inputs(enc)
    enc.add_argument("--tokenizer", required=True, help="tokenizer.json or SentencePiece .model")
    enc.add_argument("--out", required=True, help="folder for train/*.bin, val/*.bin, encode.json")
    enc.add_argument("--shard-tokens", type=int, default=None,
                     help="tokens per shard, cut at document ends (default 16,777,216)")
    enc.add_argument("--overwrite", action="store_true", help="replace shards already in --out")


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.tokenizer.codec import CodecError
    from crucible.trainer.tokenizer.documents import DocumentError, DocumentSource
    from crucible.trainer.tokenizer.encode import EncodeError
    from crucible.trainer.tokenizer.vocabulary import VocabError

    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        docs = DocumentSource(args.inputs, text_field=args.text_field,
                              max_bytes=int(args.max_mb * 1e6) if args.max_mb else None)
        action = {"train": _train, "sweep": _sweep, "encode": _encode}[args.tokenizer_command]
        code = action(args, docs, progress)
    except DocumentError as err:
        raise UserError(str(err), "give JSONL/Parquet/text files, folders or a corpus run "
                        "folder") from None
    except VocabError as err:
        raise UserError(str(err)) from None
    except CodecError as err:
        raise UserError(str(err), "pass a tokenizer made by `crucible tokenizer train`") from None
    except EncodeError as err:
        raise UserError(str(err)) from None
    if docs.malformed:
        print(f"skipped malformed records: {dict(docs.malformed)}", file=sys.stderr)
    return code


def _train(args, docs, progress: bool) -> int:
    import time

    from crucible.trainer.tokenizer import trainers
    from crucible.trainer.tokenizer.documents import split_stream
    from crucible.trainer.tokenizer.metadata import read_metadata

    if args.min_frequency is not None and args.kind != "bpe":
        raise UserError("--min-frequency applies to --kind bpe only")
    start = time.perf_counter()
    path = trainers.train(args.kind, split_stream(docs, args.val_fraction, args.seed),
                          args.vocab_size, args.out, min_frequency=args.min_frequency,
                          sources=docs.paths, show_progress=progress)
    meta = read_metadata(path)
    from crucible.trainer.tokenizer.vocabulary import VocabSize

    size = VocabSize(**{k: meta["vocab"][k] for k in ("requested", "target", "learned",
                                                       "reserved", "multiple")})
    corpus = meta["corpus"]
    print(f"tokenizer: {path} ({meta['family']})")
    print(f"vocabulary: {size.describe()}")
    specials = sorted(meta["settings"]["special_tokens"].items(), key=lambda kv: kv[1])
    print("special ids: " + ", ".join(f"{k}={v}" for k, v in specials))
    print(f"trained on: {corpus['documents']:,} documents, {corpus['bytes'] / 1e6:,.2f} MB "
          f"(held out {args.val_fraction:g} of {docs.documents:,} by document, seed {args.seed}) "
          f"in {time.perf_counter() - start:.1f} s")
    print(f"hash: {meta['hash']}")
    return 0


def _sweep(args, docs, progress: bool) -> int:
    from crucible.trainer.tokenizer import sweep as sweeping
    from crucible.trainer.tokenizer import sweep_report
    from crucible.trainer.tokenizer.documents import split_documents

    model = _model(args.model, args.seq_len)
    sizes = _sizes(args.sizes) if args.sizes else list(sweeping.DEFAULT_SIZES)
    train_docs, held = split_documents(docs, args.val_fraction, args.seed)
    if not held:
        raise UserError(f"no held-out documents among {len(train_docs)}",
                        "raise --val-fraction or give more documents")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(set(sizes)), desc="sweep", unit="size")
    try:
        result = sweeping.run_sweep(train_docs, held, sizes, model, model_name=args.model,
                                    kind=args.kind, out_dir=out, min_frequency=args.min_frequency,
                                    on_point=(lambda _p: bar.update(1)) if bar else None)
    except ValueError as err:
        raise UserError(str(err)) from None
    finally:
        if bar is not None:
            bar.close()
    sweep_report.write_json(result, out / "sweep.json")
    sweep_report.plot(result, out / "sweep.png")
    if args.json:
        print((out / "sweep.json").read_text(), end="")
    else:
        sweep_report.print_table(result)
        print(f"wrote {out / 'sweep.json'} and {out / 'sweep.png'}")
    return 0


def _encode(args, docs, progress: bool) -> int:
    from crucible.trainer.tokenizer.encode import SHARD_TOKENS, SUMMARY, encode_to_shards

    encode_to_shards(args.tokenizer, docs, args.out, val_fraction=args.val_fraction,
                     seed=args.seed, shard_tokens=args.shard_tokens or SHARD_TOKENS,
                     overwrite=args.overwrite, progress=progress)
    import json

    summary = json.loads((Path(args.out) / SUMMARY).read_text())
    for split, s in summary["splits"].items():
        print(f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens, "
              f"{s['bytes'] / 1e6:,.2f} MB of text in {len(s['shards'])} shard(s) under "
              f"{Path(args.out) / split}")
    print(f"tokenizer {summary['tokenizer_hash'][:12]} (vocab {summary['vocab_size']:,}, "
          f"eot {summary['eot_id']}) recorded in every shard header; "
          f"{summary['text_mb_per_s']:.1f} MB/s")
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s.replace("_", "")) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--sizes {text!r} must be whole numbers separated by commas",
                        "e.g. --sizes 4096,8192,16384,32768") from None
    if not sizes:
        raise UserError("--sizes is empty", "e.g. --sizes 4096,8192,16384,32768")
    return sizes


def _model(name: str, seq_len: int | None):
    from dataclasses import replace

    from crucible.api.arch import PRESETS, preset

    if name in PRESETS:
        return preset(name, **({"seq_len": seq_len} if seq_len else {}))
    if not Path(name).is_file():
        raise UserError(f"--model {name!r} is neither a preset nor a config file",
                        f"presets: {', '.join(sorted(PRESETS))}")
    from crucible.trainer.plan import configs

    try:
        cfg = configs.load(name).model
    except ValueError as err:
        raise UserError(f"--model {name}: {err}") from None
    if cfg is None:
        raise UserError(f"--model {name} does not pin down a model shape")
    return replace(cfg, seq_len=seq_len) if seq_len else cfg
