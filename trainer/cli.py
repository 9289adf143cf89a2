"""The `crucible` command: one entry point for what people and workload pods run.

Each subcommand is registered in COMMANDS and lives in the module of the same name under
`crucible.trainer.commands`. Those modules expose `add_arguments(parser)` and `run(args) -> int`
and must not import torch at import time, so `crucible --help` stays fast and works where torch
is not installed.

User errors (bad config, missing file, missing credentials) are raised as `UserError` and printed
as one line with a hint, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from crucible.api.launch import EXIT_USER_ERROR
from crucible.trainer import __version__

# (subcommand, one-line help); the command's module is crucible.trainer.commands.<subcommand>.
# Grows as capabilities land.
COMMANDS: list[tuple[str, str]] = [
    ("train", "Train a GPT from random init (run under torchrun for several processes)."),
    ("eval", "Score a committed checkpoint on held-out text (loss, bits per byte)."),
    ("export", "Write a committed checkpoint and the job's tokenizer as a Hugging Face model "
     "folder (safetensors, config.json): Llama-style or GPT-2-exact models."),
    ("diagnose", "Replay the stability guard over a run's loss/grad-norm history (JSONL or CSV): "
     "verdicts with reasons, and a PNG."),
    ("demo", "The whole path on this machine in a few minutes: corpus, tokenizer, FSDP training "
     "on 2 CPU processes, evaluation."),
    ("plan", "Compute-optimal budget, memory, parallelism, checkpoint interval and cost; "
     "--emit-job prints a PretrainJob."),
    ("review", "Review a PretrainJob, torchtitan or nanoGPT config stage by stage; exits 1 on "
     "errors."),
    ("simulate", "Goodput of a job at scale under failures (discrete-event simulation): where the "
     "wall time goes, S3-only vs in-memory checkpoints, Llama 3's failure mix."),
    ("decide", "Pretrain, continue pretraining or fine-tune: costs side by side, a recommendation "
     "and what would flip it."),
    ("corpus", "Build a filtered, deduplicated, mixed text corpus from raw sources, with a report "
     "of every removal."),
    ("tokenizer", "Train a tokenizer (BPE or SentencePiece), sweep vocabulary sizes with a "
     "recommendation, encode a corpus into training shards."),
]


class UserError(Exception):
    """An error the user can fix; printed as one line (plus a hint) without a traceback."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def load_checkpointed_job(path: str, verb: str):
    """The job config at `path` for a command that reads its checkpoints (`eval`, `export`): a
    config error, or a config without checkpoint.uri, is a UserError saying so."""
    from crucible.api.spec import ConfigError, load_train_config

    try:
        cfg = load_train_config(path)
    except ConfigError as err:
        raise UserError(str(err)) from None
    if not cfg.checkpoint.uri:
        raise UserError(f"the config has no checkpoint.uri: there is nothing to {verb}")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crucible",
        description="Pretrain language models from random initialization: corpus, tokenizer, "
        "planning, fault-tolerant FSDP training and its diagnosis.",
    )
    parser.add_argument("--version", action="version", version=f"crucible {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS:
        module = importlib.import_module(f"crucible.trainer.commands.{name}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def report_user_error(command: str, err: UserError) -> int:
    """Print a user error as its one line (and hint); the exit code for it."""
    print(f"crucible {command}: error: {err}", file=sys.stderr)
    if err.hint:
        print(f"  hint: {err.hint}", file=sys.stderr)
    return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return int(args._run(args) or 0)
    except UserError as err:
        return report_user_error(args.command, err)
    except KeyboardInterrupt:
        print(f"crucible {args.command}: interrupted", file=sys.stderr)
        return 130

