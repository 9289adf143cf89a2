"""The repository root, for tests that read committed files or run commands from it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
