"""Command-line tools of the local stack (helm, promtool): the ones it builds, else PATH's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

STACK_BIN = Path.home() / ".cache" / "crucible" / "bin"


def tool(name: str) -> str:
    """A binary the stack builds (helm, promtool), or the one on PATH (kind users)."""
    built = Path(os.environ.get("CRUCIBLE_BIN", STACK_BIN)) / name
    if built.is_file():
        return str(built)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found in {built.parent} or on PATH: `make stack` builds it",
                    pytrace=False)
    return found
