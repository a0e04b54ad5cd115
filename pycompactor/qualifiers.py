"""Qualifiers: the words that change what a figure means, and whether a summary kept them.

A summary that keeps "15.4" but drops "no longer" or "only" states a different fact. The
evaluation measures this as *qualifier retention*, and `pycompactor/extractive-2` keeps a
qualifier with the fact it qualifies. Both use the definitions here:

- a **qualifier** is one of `QUALIFIERS_EN` (matched case-insensitively as whole words;
  a contraction's `n't` counts as `not`) or `QUALIFIERS_ZH` (matched as substrings, the
  longest first, since Chinese has no word boundaries);
- a **qualified fact** is a pair (figure, qualifier) found in one sentence: a figure of
  DESIGN §8 and a qualifier of the same sentence;
- **qualifier retention** of a summary is the share of the replies' distinct qualified
  facts that some sentence of the summary states whole (the figure and the qualifier in
  one sentence). A dropped figure therefore also loses its qualified facts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from pycompactor.figures import FIGURE

#: English qualifiers: negation, time limits, exclusivity, exceptions, replacements,
#: bounds and corrections. Multi-word phrases are matched before their words.
QUALIFIERS_EN: Final[tuple[str, ...]] = (
    "no longer", "as of", "at least", "at most", "up to", "rather than", "not", "no",
    "never", "only", "except", "instead", "unless", "until", "without", "previously",
    "formerly", "deprecated", "removed", "correction", "incorrect", "incorrectly",
)
#: Chinese qualifiers, the same kinds.
QUALIFIERS_ZH: Final[tuple[str, ...]] = (
    "不再", "不是", "不能", "不会", "不", "没有", "未", "无", "仅", "只", "除了", "除外",
    "而是", "改为", "截至", "至少", "最多", "此前", "以前", "更正", "已弃用", "已移除",
)

_EN: Final = re.compile(
    r"\b(?:"
    + "|".join(re.escape(q).replace(r"\ ", r"\s+")
               for q in sorted(QUALIFIERS_EN, key=len, reverse=True))
    + r")\b|n't\b",
    re.IGNORECASE,
)
_ZH: Final = re.compile("|".join(sorted(QUALIFIERS_ZH, key=len, reverse=True)))
# Sentence ends: ASCII .!?; followed by whitespace (so 10.37 stays one figure), Chinese
# 。！？；, and line breaks.
_SENTENCE_END: Final = re.compile(r"(?<=[.!?;])\s+|[。！？；\n\r]+")
_WS_RUN: Final = re.compile(r"\s+")


def sentences(text: str) -> list[str]:
    """The sentences of a text, as the qualifier measures split it."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def qualifiers(sentence: str) -> set[str]:
    """The distinct qualifiers of a sentence, lowercased, `n't` as `not`."""
    found = {_WS_RUN.sub(" ", m.group(0).lower()) for m in _EN.finditer(sentence)}
    if "n't" in found:
        found.discard("n't")
        found.add("not")
    found.update(m.group(0) for m in _ZH.finditer(sentence))
    return found


def qualified_facts(text: str) -> frozenset[tuple[str, str]]:
    """Every (figure, qualifier) pair that shares a sentence of the text."""
    facts: set[tuple[str, str]] = set()
    for sentence in sentences(text):
        found = qualifiers(sentence)
        if found:
            facts.update((f, q) for f in FIGURE.findall(sentence) for q in found)
    return frozenset(facts)


@dataclass(frozen=True, slots=True)
class QualifierStats:
    """How many distinct qualified facts the replies state, and how many the summary kept."""

    total: int
    kept: int

    @property
    def retention(self) -> float | None:
        """kept / total, or None when the replies state no qualified fact."""
        return self.kept / self.total if self.total else None


def qualifier_stats(replies: Iterable[str], summary: str) -> QualifierStats:
    """Qualifier retention of a summary of these replies (see the module docstring)."""
    source: set[tuple[str, str]] = set()
    for reply in replies:
        source |= qualified_facts(reply)
    return QualifierStats(len(source), len(source & qualified_facts(summary)))
