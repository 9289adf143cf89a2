"""`crucible train --config job.yaml`: the entry point every worker process runs under torchrun.

Parses and validates the config, runs the loop, prints a one-line summary. Config, data and
batch-arithmetic mistakes become one-line errors (`UserError`) before any step is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from crucible.api.launch import EXIT_GUARD_ABORT, EXIT_OK, EXIT_TERMINATED, STORAGE_UNAVAILABLE

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True,
                        help="job config YAML, or a PretrainJob manifest")
    parser.add_argument("--progress", action="store_true", help="progress bar instead of log lines")
    parser.add_argument("--summary-json", help="write the run summary to this file (rank 0)")
    parser.add_argument("--max-steps", type=int, help="stop after this many steps in this run "
                        "(the LR schedule still follows the whole plan)")


def run(args: argparse.Namespace) -> int:
    from crucible.trainer.cli import UserError, report_user_error

    try:
        code = _train(args)
    except UserError as err:  # reported here: a refused resume must not abort in teardown either
        code = report_user_error("train", err)
    _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """End a multi-process run with its own exit code, skipping interpreter teardown.

    By now the process group is destroyed, the last checkpoint committed, the metrics and the
    Lease closed (loop.train's `finally`). Yet a 2-process gloo run here aborted now and then in
    C++ static destruction after all of that ("terminate called without an active exception",
    SIGABRT, about 1 run in 15, in torch's teardown; the cause was not found), and torchrun would
    report a finished run as a failed one. One process needs no such care."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _train(args: argparse.Namespace) -> int:
    from crucible.api.spec import ConfigError, load_train_config
    from crucible.trainer.cli import UserError

    # torchrun restarts its workers inside the pod: an earlier attempt's message (an outage, say)
    # must not stand for how this one ends.
    _termination_message("")
    try:
        cfg = load_train_config(args.config)
    except ConfigError as err:
        raise UserError(str(err), hint="fields and defaults: see api/spec.py or "
                        "`kubectl explain pretrainjob.spec`") from None

    import logging

    rank0 = int(os.environ.get("RANK", "0")) == 0
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for chatty in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from crucible.api.layout import LayoutError
    from crucible.api.sharding import ShardingError
    from crucible.trainer.pipeline import PipelineError
    from crucible.trainer import loop
    from crucible.trainer.checkpoint import CheckpointError, StoreUnavailable
    from crucible.trainer.data import DataError

    try:
        summary = loop.train(cfg, progress=args.progress, max_steps=args.max_steps)
    except StoreUnavailable as err:
        # Told to the operator through the termination message: an outage, restarted without
        # spending the job's restart budget.
        _termination_message(f"{STORAGE_UNAVAILABLE}: {err}")
        raise UserError(str(err)) from None
    except (DataError, loop.BatchError, ShardingError, LayoutError, PipelineError,
            CheckpointError) as err:
        raise UserError(str(err)) from None
    except loop.Terminated as err:
        print(f"crucible train: {err}", file=sys.stderr)
        return EXIT_TERMINATED  # infrastructure for the operator: killed by a signal, in effect
    except loop.GuardAbort as err:
        message = f"stopped by the stability guard: {err}"
        _termination_message(message)
        print(f"crucible train: {message}", file=sys.stderr)
        # An application failure for the operator, whose maxRestartsWithoutProgress then stops
        # restarting a run that cannot get past its spike.
        return EXIT_GUARD_ABORT
    if args.summary_json and int(os.environ.get("RANK", "0")) == 0:
        with open(args.summary_json, "w") as f:
            json.dump(summary.to_dict(), f, indent=2, default=lambda o: o.__dict__)
    return EXIT_OK


def _termination_message(message: str) -> None:
    """Leave the reason where Kubernetes shows it in the pod's status (kubectl describe)."""
    if os.path.exists(TERMINATION_LOG) and os.access(TERMINATION_LOG, os.W_OK):
        with open(TERMINATION_LOG, "w") as f:
            f.write(message[:4000])
