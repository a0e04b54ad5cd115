"""Figures (DESIGN.md §8): which numbers of the ten replies a summary kept verbatim.

The worker reports figures_total and figures_kept of every summary to `complete`, and
`--min-figure-retention` fails an attempt that kept too few (`figures_lost`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from pycompactor.models import AssistantReply

#: A figure (DESIGN.md §8): a maximal run of ASCII digits, possibly joined by single
#: `.`, `,`, `:`, `/` or `-` characters to further digits: `10.37`, `2026-10-09`,
#: `1,200`, `14:30` and `0.36` are one figure each.
FIGURE: Final = re.compile(r"[0-9]+(?:[.,:/-][0-9]+)*")


def figures(text: str) -> set[str]:
    """The distinct figures of a text."""
    return set(FIGURE.findall(text))


@dataclass(frozen=True, slots=True)
class FigureStats:
    """How many distinct figures the ten replies hold, and how many the summary kept.

    A figure is kept when the summary holds it verbatim as a whole figure (a maximal
    match of FIGURE): `2010` does not keep `10`, and `1,200,000` does not keep `1,200`.
    """

    total: int
    kept: int

    @property
    def retention(self) -> float | None:
        """kept / total, or None for a range without figures."""
        return self.kept / self.total if self.total else None

    def below(self, min_retention: float) -> bool:
        """True if fewer than min_retention x total figures were kept (exact arithmetic:
        0.7 means 7/10, so 7 of 10 figures pass). A range without figures never is."""
        if self.total == 0 or min_retention <= 0:
            return False
        return self.kept < Fraction(repr(min_retention)) * self.total


def figure_stats(pairs: Sequence[AssistantReply], summary: str) -> FigureStats:
    """DESIGN.md §8's figures_total and figures_kept of a summary of these replies."""
    source: set[str] = set()
    for pair in pairs:
        source |= figures(pair.assistant_content)
    return FigureStats(len(source), len(source & figures(summary)))
