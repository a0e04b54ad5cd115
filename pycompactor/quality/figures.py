"""Figures (contract §8): which numbers of the ten replies a summary kept verbatim, and
which numbers of a summary none of the replies holds (invented).

The worker reports figures_total, figures_kept and figures_invented of every summary to
`complete`; `--min-figure-retention` fails an attempt that kept too few (`figures_lost`)
and `--max-invented-figures` (default 0) one that invented more (`figures_invented`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

from pycompactor.models import AssistantReply

#: A figure (contract §8): a maximal run of ASCII digits, possibly joined by single
#: `.`, `,`, `:`, `/` or `-` characters to further digits: `10.37`, `2026-10-09`,
#: `1,200`, `14:30` and `0.36` are one figure each.
FIGURE: Final = re.compile(r"[0-9]+(?:[.,:/-][0-9]+)*")
#: The largest --max-invented-figures: a 6,000-character summary holds fewer figures, so
#: a larger allowance would be the gate turned off by another name.
MAX_INVENTED_FIGURES_BOUND: Final = 6000


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
    """contract §8's figures_total and figures_kept of a summary of these replies."""
    source = _source_figures(pairs)
    return FigureStats(len(source), len(source & figures(summary)))


def _source_figures(pairs: Sequence[AssistantReply]) -> set[str]:
    source: set[str] = set()
    for pair in pairs:
        source |= figures(pair.assistant_content)
    return source


def without_labels(pairs: Sequence[AssistantReply], summary: str) -> str:
    """The summary with every bracketed label equal to one of the replies' ids (`[a-17]`,
    the attribution the prompt asks for) replaced by a space: the digits of a reply's id
    are not a figure the summary states. A bracketed text that is no reply's id stays."""
    ids = {pair.assistant_message_id for pair in pairs}
    if not ids or "[" not in summary:
        return summary
    # Longest first, so that an id that is a prefix of another never cuts it.
    pattern = "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
    return re.sub(rf"\[(?:{pattern})\]", " ", summary)


def invented_figures(pairs: Sequence[AssistantReply], summary: str) -> frozenset[str]:
    """contract §8's invented figures: the distinct figures of the summary (bracketed
    labels equal to a reply's id left out) that none of these replies holds.

    A figure is held when a reply holds it as a whole figure (a maximal match of FIGURE),
    as for figures_kept: `1,200` is not held by a reply that says `1,200,000`, nor `10`
    by one that says `2010`.
    """
    return frozenset(figures(without_labels(pairs, summary)) - _source_figures(pairs))
