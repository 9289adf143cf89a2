"""The real-text corpus fixture of the trainer tests, shared here."""

from tests.trainer.conftest import corpus  # noqa: F401  (a pytest fixture)
