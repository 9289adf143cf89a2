"""`crucible corpus run | report | manifest`: the command line of the corpus pipeline.

Owns: argument parsing and turning bad input into `UserError` (one line, a hint, no traceback).
Must not: import numpy, trafilatura or any step at import time (`crucible --help` stays fast);
they load inside `run`.

    crucible corpus run --config corpus.yaml [--shards N] [--workers K]   all stages, this machine
    crucible corpus run --config corpus.yaml --shard auto/N               one Indexed Job worker
    crucible corpus report --config corpus.yaml [--shards N]              re-render the report
    crucible corpus manifest --config corpus.yaml --workers N --image IMG the Indexed Job YAML
        [--s3-secret NAME] [--s3-key AWS_ACCESS_KEY_ID=accessKey ...] [--scratch 32Gi]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from crucible.trainer.cli import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="corpus_command", metavar="ACTION", required=True)

    run = sub.add_parser("run", help="run every stage (or one worker's share with --shard)")
    run.add_argument("--config", required=True,
                     help="corpus YAML (see crucible.trainer.corpus.config)")
    run.add_argument("--output", help="override the config's output folder")
    run.add_argument("--shards", type=int, default=None,
                     help="number of shards for a local run (default: --workers)")
    run.add_argument("--workers", type=int, default=1, help="processes for a local run")
    run.add_argument("--shard", help="i/N or auto/N: run as worker i of an N-worker job "
                                     "(auto reads JOB_COMPLETION_INDEX)")
    run.add_argument("--wait-timeout-s", type=float, default=24 * 3600,
                     help="worker mode: how long to wait for the other workers at a stage barrier")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bars with docs/s (default: when stderr is a terminal)")

    report = sub.add_parser("report", help="rebuild report.json and report.html from the stats")
    report.add_argument("--config", required=True)
    report.add_argument("--output")
    report.add_argument("--shards", type=int, default=None, help="default: from run.json")

    manifest = sub.add_parser("manifest", help="print the Kubernetes Indexed Job for a config")
    manifest.add_argument("--config", required=True)
    manifest.add_argument("--workers", type=int, required=True)
    manifest.add_argument("--image", required=True)
    manifest.add_argument("--name", default="corpus")
    manifest.add_argument("--namespace", default="default")
    manifest.add_argument("--s3-secret", default="s3-creds",
                          help="Secret with AWS_* keys for s3:// paths ('' for none)")
    manifest.add_argument("--s3-key", action="append", default=[], metavar="VAR=KEY",
                          help="read AWS_* variable VAR from the Secret's KEY (repeatable; "
                               "default: the key named like the variable)")
    manifest.add_argument("--scratch", default="32Gi",
                          help="size limit of the pods' writable emptyDir (temporary files)")


def _load_config(args: argparse.Namespace):
    from crucible.api.spec import ConfigError
    from crucible.trainer.corpus.config import load

    path = Path(args.config)
    if not path.is_file():
        raise UserError(f"config {path} does not exist", "pass --config path/to/corpus.yaml")
    text = path.read_text()
    try:
        config = load(text)
    except ConfigError as err:
        raise UserError(f"config {path}: {err}") from None
    if getattr(args, "output", None):
        from dataclasses import replace

        config = replace(config, output=args.output, raw={**config.raw, "output": args.output})
    return config, text


def _s3_keys(pairs: list[str]) -> dict[str, str]:
    keys = {}
    for pair in pairs:
        var, sep, key = pair.partition("=")
        if not sep or not var or not key:
            raise UserError(f"--s3-key {pair!r}: want VAR=KEY",
                            "e.g. --s3-key AWS_ACCESS_KEY_ID=accessKey")
        keys[var] = key
    return keys


def _shard_count_from_run(config) -> int:
    import json

    from crucible.trainer import storage

    uri = storage.join(config.output, "run.json")
    if not storage.exists(uri):
        raise UserError(f"no run in {config.output}", "run `crucible corpus run` first")
    return int(json.loads(storage.read_bytes(uri))["shards"])


def run(args: argparse.Namespace) -> int:
    if args.corpus_command == "manifest":
        from crucible.trainer.corpus.indexed_job import render_job, to_yaml

        _config, text = _load_config(args)
        try:
            objects = render_job(args.name, args.image, text, args.workers,
                                 namespace=args.namespace, s3_secret=args.s3_secret or None,
                                 s3_keys=_s3_keys(args.s3_key), scratch=args.scratch)
        except ValueError as err:
            raise UserError(str(err)) from None
        sys.stdout.write(to_yaml(objects))
        return 0

    config, _text = _load_config(args)
    from crucible.trainer.corpus import pipeline
    from crucible.trainer.corpus.shards import Shard

    if args.corpus_command == "report":
        job = pipeline.Job(config, args.shards or _shard_count_from_run(config))
        job.report_task(0)
        print(f"wrote {config.output}/report.json and report.html")
        return 0

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        if args.shard:
            try:
                worker = Shard.parse(args.shard, dict(os.environ))
            except ValueError as err:
                raise UserError(str(err),
                                "use --shard 0/4, or auto/4 inside an Indexed Job") from None
            pipeline.run_worker(config, worker, progress, wait_timeout_s=args.wait_timeout_s)
            print(f"worker {worker}: done; report at {config.output}/report.html")
            return 0
        shards = args.shards or args.workers
        if shards < 1 or args.workers < 1:
            raise UserError("--shards and --workers must be >= 1")
        wall_s = pipeline.run_local(config, shards, args.workers, progress)
    except pipeline.RunMismatch as err:
        raise UserError(str(err)) from None
    timings = ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in wall_s.items())
    print(f"done ({timings}); report at {config.output}/report.html")
    return 0
