"""Qualifiers: the words that change what a figure means, and whether a summary kept them.

A summary that keeps "15.4" but drops "no longer" or "only" states a different fact. The
evaluation measures this as *qualifier retention*, and `pycompactor/extractive-2` keeps a
qualifier with the fact it qualifies. Both use the definitions here:

- a **qualifier** is one of `QUALIFIERS_EN` (matched case-insensitively as whole words;
  a contraction's `n't` counts as `not`) or `QUALIFIERS_ZH` (matched as substrings, the
  longest first, since Chinese has no word boundaries);
- a **qualified fact** is a pair (figure, qualifier) found in one sentence: a figure of
  contract §8 and a qualifier of the same sentence;
- **qualifier retention** of a summary is the share of the replies' distinct qualified
  facts that some sentence of the summary states whole (the figure and the qualifier in
  one sentence). A dropped figure therefore also loses its qualified facts.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from pycompactor.quality.figures import FIGURE

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

#: The scope set: the same kinds plus hedges, superlatives, bounds and time
#: scope, the words whose loss turns "unlikely to add up to 100%" into "adds up to 100%"
#: or "the smallest key size is 512 bits" into "the key size is 512 bits". The fidelity
#: measures (pycompactor.quality.fidelity) and later summarizers use it; extractive-2 keeps
#: QUALIFIERS_EN/ZH above, so its summaries stay byte-identical under its model id.
QUALIFIERS_EN_V2: Final[tuple[str, ...]] = (
    *QUALIFIERS_EN,
    # hedges
    "unlikely", "likely", "may", "might", "possibly", "probably", "approximately",
    "roughly", "estimated",
    # superlatives and bounds
    "smallest", "largest", "lowest", "highest", "minimum", "maximum", "exactly",
    "more than", "less than", "fewer than", "at the earliest", "at the latest",
    # time scope and universality
    "since", "before", "after", "always", "temporarily",
)
#: Chinese, the same kinds as QUALIFIERS_EN_V2.
QUALIFIERS_ZH_V2: Final[tuple[str, ...]] = (
    *QUALIFIERS_ZH,
    "不太可能", "可能", "也许", "大约", "大概", "约为", "估计",
    "最小", "最大", "最低", "最高", "最少", "至多", "不超过", "超过", "少于", "多于", "恰好",
    "以来", "直到", "之前", "之后", "总是", "从不", "暂时",
)


def _en_pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    # Phrases before their words (longest first); whole words, any case, any whitespace.
    return re.compile(
        r"\b(?:"
        + "|".join(re.escape(q).replace(r"\ ", r"\s+")
                   for q in sorted(words, key=len, reverse=True))
        + r")\b|n't\b",
        re.IGNORECASE,
    )


def _zh_pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(sorted(words, key=len, reverse=True)))


_EN: Final = _en_pattern(QUALIFIERS_EN)
_ZH: Final = _zh_pattern(QUALIFIERS_ZH)
_EN_V2: Final = _en_pattern(QUALIFIERS_EN_V2)
_ZH_V2: Final = _zh_pattern(QUALIFIERS_ZH_V2)
# Sentence ends: ASCII .!?; followed by whitespace (so 10.37 stays one figure), Chinese
# 。！？；, and line breaks.
_ASCII_END: Final = r"(?<=[.!?;])\s+"
_HARD_END: Final = r"[。！？；\n\r]+"
_SENTENCE_END: Final = re.compile(f"{_ASCII_END}|{_HARD_END}")
_WS_RUN: Final = re.compile(r"\s+")


# A line broken inside a sentence (a docstring, a man page, an e-mail wrapped at 72
# columns): it ends in a letter, a digit, a comma or ")", and the next line goes on in
# lowercase (or, after a letter or comma, opens a parenthesis or a quote).
_WRAPPED: Final = re.compile(
    r"(?:(?<=[A-Za-z0-9,])[ \t]*\r?\n[ \t]*(?=[a-z(`'\"])"
    r"|(?<=\))[ \t]*\r?\n[ \t]*(?=[a-z]))"
)


# A fenced code block (```), whose lines are statements of their own, not a wrapped
# sentence ("x = 1\ny = 2" stays two lines).
_FENCED: Final = re.compile(r"^[ \t]*```.*?(?:^[ \t]*```[^\n]*$|\Z)", re.MULTILINE | re.DOTALL)


def unwrap(text: str) -> str:
    """The text with its hard line wraps undone, so that a sentence broken across lines
    reads as one ("stdout and stderr are not captured, and those attributes\nwill be
    None." is one sentence, not two); a fenced code block stays as written. The fidelity
    measures read replies this way; the qualifier retention of extractive-1/-2
    (`sentences` alone) does not."""
    out, at = [], 0
    for block in _FENCED.finditer(text):
        out.append(_WRAPPED.sub(" ", text[at:block.start()]))
        out.append(block.group(0))
        at = block.end()
    out.append(_WRAPPED.sub(" ", text[at:]))
    return "".join(out)


def sentences(text: str) -> list[str]:
    """The sentences of a text, as the qualifier measures split it."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


# Where `statements` must not end a sentence: after an abbreviation that never ends one,
_ABBREVIATION: Final = re.compile(r"(?:^|[\s(\[])(?:e\.g|i\.e|vs|cf|viz|approx|resp|incl|esp)\.$",
                                  re.IGNORECASE)
# … nor after the number of a numbered list's item ("2. Install the package."): alone,
# "2." states nothing.
_LIST_NUMBER: Final = re.compile(r"^\d{1,3}\.$")
_HARD_BREAK: Final = re.compile(_HARD_END)
# … and where `sentences` misses an end: after a parenthesis or a quote that closes on a
# sentence's end ("(Write %% for a literal %.) Note that …").
_STATEMENT_END: Final = re.compile(rf"{_ASCII_END}|(?<=[.!?][)\]”’\"])\s+(?=[A-Z(\[“\"])")


def statements(text: str) -> list[str]:
    """The sentences of a text as the fidelity measures and the later summarizers read
    them: `sentences`, except that a sentence does not end after an abbreviation that
    never ends one ("shared memory vs. semaphores", "e.g. a socket") nor inside the
    parentheses it opened ("(System V vs. POSIX; see below)"), when they close on the
    same line (a piece cut there, "POSIX) are treated differently", names nothing) nor
    after a numbered item's number ("2. Install it." is one statement), and
    does end after a parenthesis or quote that closes on an end, before a capital
    ("(Write %% for a literal %.)" and "Note that …" are two statements). extractive-2
    keeps `sentences`, so its summaries stay byte-identical."""
    out: list[str] = []
    for line in _HARD_BREAK.split(text):
        pieces = [p.strip() for p in _STATEMENT_END.split(line) if p.strip()]
        # The parentheses open after each piece, counted from the line's start, and the
        # fewest open after any later piece: a parenthesis opened in a statement closes
        # on the line when a later count falls back to the statement's opening count.
        depth = list(itertools.accumulate(p.count("(") - p.count(")") for p in pieces))
        fewest_later = list(itertools.accumulate(reversed(depth), min))[::-1][1:]
        start, opening = 0, 0
        for i, piece in enumerate(pieces):
            if i + 1 < len(pieces) and (
                    _ABBREVIATION.search(piece)
                    or (i == start and _LIST_NUMBER.match(piece))
                    or depth[i] > opening >= fewest_later[i]):
                continue
            out.append(" ".join(pieces[start:i + 1]))
            start, opening = i + 1, depth[i]
    return out


def qualifiers(sentence: str) -> set[str]:
    """The distinct qualifiers of a sentence, lowercased, `n't` as `not`."""
    found = {_WS_RUN.sub(" ", m.group(0).lower()) for m in _EN.finditer(sentence)}
    if "n't" in found:
        found.discard("n't")
        found.add("not")
    found.update(m.group(0) for m in _ZH.finditer(sentence))
    return found


def qualifier_spans(sentence: str) -> list[tuple[int, int, str]]:
    """The scope set's qualifiers of a sentence (QUALIFIERS_EN_V2, QUALIFIERS_ZH_V2) as
    (start, end, qualifier) in text order: lowercased, `n't` as `not`."""
    found = []
    for m in _EN_V2.finditer(sentence):
        word = _WS_RUN.sub(" ", m.group(0).lower())
        found.append((m.start(), m.end(), "not" if word == "n't" else word))
    found.extend((m.start(), m.end(), m.group(0)) for m in _ZH_V2.finditer(sentence))
    return sorted(found)


def scope_qualifiers(sentence: str) -> set[str]:
    """The distinct qualifiers of the scope set in a sentence (see qualifier_spans)."""
    return {q for _, _, q in qualifier_spans(sentence)}


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
