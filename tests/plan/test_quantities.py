"""Numbers as people type them: 1.3e9, 1.3B, 20T, 6e23; and clear errors for the rest."""

import pytest

from crucible.trainer.plan.quantities import QuantityError, human, parse_fraction, parse_quantity


@pytest.mark.parametrize("text, value", [
    ("1.3e9", 1.3e9), ("1.3B", 1.3e9), ("20T", 20e12), ("6e23", 6e23), ("350M", 350e6),
    ("1_000", 1000.0), ("2.5k", 2500.0), (" 7 B ", 7e9), (".5T", 0.5e12), (42, 42.0),
])
def test_parses_model_card_forms(text, value):
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("abc", "not a number"), ("1.3X", "unknown suffix"), ("-5", "positive"),
    ("0", "greater than zero"), ("inf", "not a number"), ("1e999", "finite"),
])
def test_rejects_bad_numbers_with_a_reason(text, words):
    with pytest.raises(QuantityError, match=words):
        parse_quantity(text, name="--params")


def test_error_names_the_flag():
    with pytest.raises(QuantityError, match="--tokens"):
        parse_quantity("-1T", name="--tokens")


def test_fraction_accepts_percent_and_rejects_out_of_range():
    assert parse_fraction("40%", name="--mfu") == pytest.approx(0.4)
    assert parse_fraction("0.45", name="--mfu") == pytest.approx(0.45)
    with pytest.raises(QuantityError, match=r"\(0, 1\]"):
        parse_fraction("1.5", name="--mfu")


def test_human_units():
    assert human(1.3e9, "param") == "1.3B param"
    assert human(80 * 2**30, "B") == "80.0 GiB"
    assert human(7200, "s") == "2 h"
    assert human(7e9, "count") == "7B"
