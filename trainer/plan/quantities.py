"""Quantities people type and read: `1.3e9`, `1.3B`, `20T`, `6e23` in; `1.30 B`, `5.76e23 FLOP` out.

Owns parsing (with errors that say what was wrong) and SI formatting. Knows nothing about models
or hardware. The suffixes are the ones model cards use: k = 1e3, M = 1e6, B (or G) = 1e9,
T = 1e12, P = 1e15; `m` is read as M because nobody plans a model in milli-parameters.
"""

from __future__ import annotations

import math
import re

SUFFIXES = {"k": 1e3, "K": 1e3, "M": 1e6, "m": 1e6, "B": 1e9, "b": 1e9, "G": 1e9, "g": 1e9,
            "T": 1e12, "t": 1e12, "P": 1e15, "p": 1e15}

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:[_,]?\d)*(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]?)\s*$")


class QuantityError(ValueError):
    """A number the user typed that cannot be used; the message says why."""


def parse_quantity(text: str | float | int, *, name: str = "value", positive: bool = True,
                   allow_zero: bool = False) -> float:
    """`1.3e9`, `1.3B`, `20T`, `350M`, `6e23`, `1_000` -> float.

    Raises QuantityError naming `name` for empty, malformed, non-finite, negative or (unless
    `allow_zero`) zero input.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        raw = str(text).strip()
        if not raw:
            raise QuantityError(f"{name} is empty; give a number such as 1.3e9 or 1.3B")
        match = _NUMBER.match(raw)
        if not match:
            raise QuantityError(f"{name} {raw!r} is not a number; use forms like 1.3e9, 1.3B, "
                                "20T or 6e23 (suffixes k, M, B, T, P)")
        digits, suffix = match.groups()
        if suffix and suffix not in SUFFIXES:
            raise QuantityError(f"{name} {raw!r} has an unknown suffix {suffix!r}; use k, M, B, "
                                "T or P")
        value = float(digits.replace("_", "").replace(",", "")) * SUFFIXES.get(suffix, 1.0)
    if not math.isfinite(value):
        raise QuantityError(f"{name} must be finite, got {value}")
    if positive and value < 0:
        raise QuantityError(f"{name} must be positive, got {value:g}")
    if positive and value == 0 and not allow_zero:
        raise QuantityError(f"{name} must be greater than zero")
    return value


def parse_fraction(text: str | float, *, name: str) -> float:
    """A share in (0, 1], also accepted as a percentage: `0.4` or `40%`."""
    raw = str(text).strip()
    percent = raw.endswith("%")
    value = parse_quantity(raw.rstrip("%"), name=name)
    if percent:
        value /= 100
    if not 0 < value <= 1:
        raise QuantityError(f"{name} must be in (0, 1] (or a percentage up to 100%), got {raw}")
    return value


_PREFIXES = [(1e15, "P"), (1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")]


def human(value: float, unit: str = "") -> str:
    """A short human form: 1.30B params, 5.76e+23 FLOP, 2.0 GiB, 3.5 h."""
    if value is None:
        return "-"
    if unit == "B":  # bytes: binary units, as nvidia-smi and torch report memory
        for size, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if unit == "B/s":  # link bandwidths are quoted in decimal GB/s on datasheets
        return f"{value / 1e9:.3g} GB/s"
    if unit == "s":
        return duration(value)
    if unit in ("FLOP", "FLOP/s"):
        return f"{value:.3g} {unit}"
    if unit == "USD":
        return f"${value:,.0f}" if abs(value) >= 100 else f"${value:,.2f}"
    if unit in ("1", ""):
        return f"{value:.3g}"
    if unit == "count":  # a bare count with an SI suffix: 7B, 1.4T
        return human(value, "").rstrip() if abs(value) < 1e3 else human(value, "_")[:-2]
    for size, prefix in _PREFIXES:
        if abs(value) >= size:
            return f"{value / size:.3g}{prefix} {unit}".rstrip()
    return f"{value:.3g} {unit}".rstrip()


def duration(seconds: float) -> str:
    """Seconds as the largest sensible unit: 45 s, 12.5 min, 3.2 h, 41.7 days, 2.1 years."""
    s = float(seconds)
    if math.isinf(s):
        return "inf"
    if abs(s) < 120:
        return f"{s:.3g} s"
    if abs(s) < 7200:
        return f"{s / 60:.3g} min"
    if abs(s) < 3 * 86400:
        return f"{s / 3600:.3g} h"
    if abs(s) < 2 * 365 * 86400:
        return f"{s / 86400:.3g} days"
    return f"{s / (365 * 86400):.3g} years"
