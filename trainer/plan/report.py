"""Figures that explain themselves, and how they are shown: a rich table or JSON.

Owns presentation only. A `Figure` carries its value in SI units (FLOP, B for bytes, s, token,
param, USD, or 1 for a ratio), the name of the formula that produced it and where that formula
comes from, so `--json` consumers and people reading the table get the same provenance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from crucible.trainer.plan.quantities import human


@dataclass(frozen=True)
class Figure:
    key: str  # dotted, stable: the JSON key
    label: str
    value: float | str | None
    unit: str  # SI: FLOP, FLOP/s, B, s, token, param, USD, 1
    formula: str
    source: str = ""
    percent: bool = False  # display a dimensionless share as a percentage (JSON keeps the share)

    def shown(self) -> str:
        if isinstance(self.value, str) or self.value is None:
            return "-" if self.value is None else self.value
        if self.percent:
            return f"{100 * self.value:.4g}%"
        return human(self.value, self.unit)


@dataclass
class Section:
    title: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, key: str, label: str, value, unit: str, formula: str, source: str = "",
            percent: bool = False) -> None:
        self.figures.append(Figure(f"{_slug(self.title)}.{key}", label, value, unit, formula,
                                   source, percent))


def _slug(title: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in title.lower()).strip("_")


def to_json(sections: list[Section], extra: dict | None = None) -> str:
    """All figures keyed by their dotted key, with value, unit, formula and source."""
    figures = {}
    for section in sections:
        for fig in section.figures:
            value = fig.value
            if isinstance(value, float) and not math.isfinite(value):
                value = None if math.isnan(value) else ("inf" if value > 0 else "-inf")
            figures[fig.key] = {"label": fig.label, "value": value, "unit": fig.unit,
                                "formula": fig.formula, "source": fig.source}
    doc = {"figures": figures,
           "notes": {_slug(s.title): s.notes for s in sections if s.notes}}
    doc.update(extra or {})
    return json.dumps(doc, indent=2, sort_keys=False)


def render(sections: list[Section], *, width: int | None = None) -> str:
    """Sections as rich tables (figure, value, formula/source), notes under each."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buffer = StringIO()
    console = Console(file=buffer, width=width or 110, force_terminal=False, color_system=None,
                      highlight=False, soft_wrap=False)
    for section in sections:
        table = Table(title=section.title, title_justify="left", show_lines=False, expand=False)
        table.add_column("figure", overflow="fold")
        table.add_column("value", justify="right", overflow="fold")
        table.add_column("formula · source", overflow="fold", style="dim")
        for fig in section.figures:
            where = fig.formula + (f" · {fig.source}" if fig.source else "")
            table.add_row(fig.label, fig.shown(), where)
        console.print(table)
        for note in section.notes:
            console.print(f"  • {note}")
        console.print()
    return buffer.getvalue()
