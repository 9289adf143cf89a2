"""The `crucible-operator` command: runs the PretrainJob controller.

This folder is the namespace package `crucible.operator`. It deliberately has no `__init__.py`:
with the repository root on `sys.path` (as under `python -m pytest`), a regular package named
`operator` would shadow the standard library's `operator` module, which torch and many others
import. A namespace portion never wins over a real module, so the stdlib stays reachable.
"""

from __future__ import annotations

import argparse
import sys

VERSION = "0.1.0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crucible-operator",
        description="Reconcile PretrainJob resources (crucible.dev/v1alpha1) into elastic "
        "torchrun pods; watch pod and node health; resume from the latest checkpoint.",
    )
    parser.add_argument("--version", action="version", version=f"crucible-operator {VERSION}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
