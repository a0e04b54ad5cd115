"""Rendering for the command line: aligned text tables and JSON.

The commands (`cli`, `audit`, `demo`) render through these; this module imports nothing
of the package, so it sits below all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (the readable default; --json is for scripts)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_json(value: Any) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2, sort_keys=False))


def jsonable(value: Any) -> Any:
    """A database value as JSON: times as ISO 8601, intervals as seconds."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    return value


def cell(row: Mapping[str, Any], column: str) -> object:
    """One table cell of an audit or demo row; `pairs` and `figures_kept` are derived."""
    if column == "pairs":
        return f"{row['from_pair']}-{row['to_pair']}" if row.get("from_pair") is not None else None
    if column == "figures_kept" and row.get("figures_total") is not None:
        # "27/30": kept of the range's distinct figures (contract §8).
        return f"{row['figures_kept']}/{row['figures_total']}"
    value = row.get(column)
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, timedelta):
        return f"{value.total_seconds():.1f}s"
    return value


class PlacedPair(Protocol):
    """A projection manifest entry, as far as rendering needs it."""

    @property
    def pair_index(self) -> int: ...
    @property
    def placement(self) -> str: ...
    @property
    def summary_id(self) -> int | None: ...


def placement_runs(entries: Iterable[PlacedPair]) -> list[tuple[int, int, str, int | None]]:
    """Consecutive pairs with the same placement and summary as one (first, last,
    placement, summary_id) run, so a long history's omitted part is one table row."""
    runs: list[tuple[int, int, str, int | None]] = []
    for entry in entries:
        if runs and runs[-1][2:] == (entry.placement, entry.summary_id):
            first, _, placement, summary_id = runs[-1]
            runs[-1] = (first, entry.pair_index, placement, summary_id)
        else:
            runs.append((entry.pair_index, entry.pair_index, entry.placement, entry.summary_id))
    return runs
