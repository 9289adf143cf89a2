"""Tests of the contract between the planes (`crucible.api`)."""
