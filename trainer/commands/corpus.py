"""`crucible corpus run | report | manifest`: the command line of the corpus pipeline.

Owns: argument parsing and turning bad input into `UserError` (one line, a hint, no traceback).
Must not: import numpy, trafilatura or any step at import time (`crucible --help` stays fast);
they load inside `run`.

    crucible corpus run --config corpus.yaml [--shards N] [--workers K]   all stages, this machine
    crucible corpus run --config corpus.yaml --shard auto/N               one Indexed Job worker
    crucible corpus run --config corpus.yaml --ray [ADDRESS] [--shards N]  on a Ray cluster
        [--ray-resources STAGE=cpu:N,memory:Q ...]                        (no ADDRESS: a local one)
    crucible corpus report --config corpus.yaml [--shards N]              re-render the report
    crucible corpus manifest --config corpus.yaml --workers N --image IMG the Indexed Job YAML
        [--s3-secret NAME] [--s3-key AWS_ACCESS_KEY_ID=accessKey ...] [--scratch 32Gi]
        [--engine ray [--ray-resources ...]]                              or the KubeRay RayJob
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
                     help="number of shards (default: --workers; with --ray: the run's if resumed, "
                          "else 4 per CPU of the cluster)")
    run.add_argument("--workers", type=int, default=None,
                     help="processes for a local run (default 1); CPUs of a Ray this run starts "
                          "(default: all)")
    run.add_argument("--shard", help="i/N or auto/N: run as worker i of an N-worker job "
                                     "(auto reads JOB_COMPLETION_INDEX)")
    run.add_argument("--wait-timeout-s", type=float, default=24 * 3600,
                     help="worker mode: how long to wait for the other workers at a stage barrier")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bars with docs/s (default: when stderr is a terminal; "
                          "with --ray: off, a line per finished stage instead)")
    run.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="run the tasks on Ray: auto (the cluster this machine is in), "
                          "host:port, ray://host:port, or nothing to start one here")
    _add_ray_resources(run)
    run.add_argument("--ray-retries", type=int, default=3,
                     help="with --ray: attempts after a worker or node dies, or a storage hiccup")

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
    manifest.add_argument("--shards", type=int, default=None,
                          help="Indexed Job: shards of the corpus (default: one per worker); a "
                               "multiple of --workers makes a lost pod redo one shard, not 1/N")
    manifest.add_argument("--allow-instance-metadata", action="store_true",
                          help="let the pods reach the cloud's instance metadata (169.254.169.254) "
                               "and with it the node's role, e.g. for GKE workload identity; by "
                               "default their NetworkPolicy blocks it and the AWS SDK does not try")
    manifest.add_argument("--engine", choices=("indexed-job", "ray"), default="indexed-job",
                          help="an Indexed Job (no operator needed) or a KubeRay RayJob")
    _add_ray_resources(manifest)


def _add_ray_resources(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-resources", action="append", default=[],
                        metavar="STAGE=cpu:N,memory:Q",
                        help="with Ray: what each task of STAGE reserves (repeatable; default "
                             "cpu:1 and no memory reservation), e.g. buckets=cpu:1,memory:2Gi")


def _stage_resources(specs: list[str]) -> dict:
    from crucible.trainer.corpus.ray_runner import ResourceError, parse_stage_resources

    resources = {}
    for spec in specs:
        try:
            stage, wanted = parse_stage_resources(spec)
        except ResourceError as err:
            raise UserError(f"--ray-resources {err}") from None
        if stage in resources:
            raise UserError(f"--ray-resources: stage {stage} given twice")
        resources[stage] = wanted
    return resources


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


def _manifest(args: argparse.Namespace) -> int:
    from crucible.trainer.corpus.indexed_job import render_job, to_yaml

    config, text = _load_config(args)
    if args.engine == "indexed-job" and args.ray_resources:
        raise UserError("--ray-resources is for --engine ray")
    if args.ray_resources:                        # refused here, not in a pod
        from crucible.trainer.corpus.pipeline import Job
        from crucible.trainer.corpus.ray_runner import ResourceError, resources_by_stage

        try:
            resources_by_stage([s.name for s in Job(config, 1).stages()],
                               _stage_resources(args.ray_resources))
        except ResourceError as err:
            raise UserError(f"--ray-resources: {err}") from None
    try:
        if args.engine == "ray":
            from crucible.trainer.corpus.rayjob import render_rayjob

            objects = render_rayjob(args.name, args.image, text, args.workers,
                                    namespace=args.namespace, s3_secret=args.s3_secret or None,
                                    s3_keys=_s3_keys(args.s3_key), scratch=args.scratch,
                                    ray_resources=args.ray_resources,
                                    instance_metadata=args.allow_instance_metadata)
        else:
            objects = render_job(args.name, args.image, text, args.workers,
                                 namespace=args.namespace, s3_secret=args.s3_secret or None,
                                 s3_keys=_s3_keys(args.s3_key), scratch=args.scratch,
                                 shards=args.shards,
                                 instance_metadata=args.allow_instance_metadata)
    except ValueError as err:
        raise UserError(str(err)) from None
    sys.stdout.write(to_yaml(objects))
    return 0


def _run_on_ray(args: argparse.Namespace, config) -> int:
    from crucible.trainer.corpus import ray_runner
    from crucible.trainer.corpus.pipeline import RunMismatch

    if args.shard:
        raise UserError("--ray and --shard are two engines; pick one",
                        "--shard i/N is one Indexed Job worker; --ray runs every task on Ray")
    resources = _stage_resources(args.ray_resources)
    if (args.shards is not None and args.shards < 1) or args.ray_retries < 0 or \
            (args.workers is not None and args.workers < 1):
        raise UserError("--shards and --workers must be >= 1, --ray-retries >= 0")

    def finished(usage) -> None:
        print(f"stage {usage.stage} done: {usage.tasks_run} tasks in {usage.wall_s:.1f}s"
              + (f" ({usage.tasks_skipped} done before)" if usage.tasks_skipped else ""),
              flush=True)

    try:
        run = ray_runner.run_ray(config, args.shards, address=args.ray,
                                 progress=bool(args.progress), resources=resources,
                                 max_retries=args.ray_retries, num_cpus=args.workers,
                                 on_stage=finished)
    except ray_runner.RayUnreachable as err:
        raise UserError(str(err), "start one with `ray start --head`, pass --ray auto on a "
                                  "node of the cluster, or --ray alone for a Ray here") from None
    except ray_runner.ResourceError as err:
        raise UserError(f"--ray-resources: {err}") from None
    except RunMismatch as err:
        raise UserError(str(err)) from None
    print(ray_runner.usage_table(run.stages))
    print(f"done ({run.shard_count} shards); report at {config.output}/report.html")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.corpus_command == "manifest":
        return _manifest(args)

    config, _text = _load_config(args)
    from crucible.trainer.corpus import pipeline
    from crucible.trainer.corpus.shards import Shard

    if args.corpus_command == "report":
        job = pipeline.Job(config, args.shards or _shard_count_from_run(config))
        job.report_task(0)
        print(f"wrote {config.output}/report.json and report.html")
        return 0

    if args.ray is not None:
        return _run_on_ray(args, config)
    workers = 1 if args.workers is None else args.workers
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        if args.shard:
            try:
                worker = Shard.parse(args.shard, dict(os.environ))
            except ValueError as err:
                raise UserError(str(err),
                                "use --shard 0/4, or auto/4 inside an Indexed Job") from None
            if args.shards is not None and args.shards < 1:
                raise UserError("--shards must be >= 1")
            pipeline.run_worker(config, worker, progress, wait_timeout_s=args.wait_timeout_s,
                                shard_count=args.shards)
            print(f"worker {worker}: done; report at {config.output}/report.html")
            return 0
        shards = args.shards or workers
        if shards < 1 or workers < 1:
            raise UserError("--shards and --workers must be >= 1")
        wall_s = pipeline.run_local(config, shards, workers, progress)
    except pipeline.RunMismatch as err:
        raise UserError(str(err)) from None
    timings = ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in wall_s.items())
    print(f"done ({timings}); report at {config.output}/report.html")
    return 0
