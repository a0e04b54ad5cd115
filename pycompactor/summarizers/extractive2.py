"""`pycompactor/extractive-2`: the offline summarizer that states the facts, compactly.

extractive-1 keeps sentences up to the 6,000 characters a summary may hold, so its
summaries are about as long as the replies they replace, and its `[message-id]` labels
are text the next model reads for nothing. extractive-2 is offline and deterministic too,
but writes plain text of at most `target` x the replies' UTF-8 bytes (default 0.35). The
target is a ceiling, not an amount to fill: a summary is worth what it states per byte,
since every byte it saves is history the next Run still sees (contract §9).

1. Facts, not prose. Each sentence holding a figure (contract §8) is cut to the words
   that state it: a few words before and after each figure (what the figure is about, and
   its unit), every qualifier of the sentence with the word it qualifies ("no longer",
   "only", "not", a correction; pycompactor.quality.qualifiers), the words between dropped for an
   ellipsis, still one sentence. A cut that would lose a figure or a qualified fact, as
   the measures read the text, keeps the sentence whole.
2. Each fact once. A greedy cover picks clauses by the figures and qualified facts they
   add per byte, so a figure the replies repeat is written once. When the clauses cannot
   all fit the target, narrower windows are tried, down to the figures and qualifiers
   alone; if even those do not fit, the figures left out are lost, and the worker's figure
   gate (`figures_lost`) sees that from the text, as for any model.
3. Then a little context, while the summary is under `context` x the replies' bytes
   (default 0.05): the first sentence of each paragraph or list item (a release note's
   headline, a parameter's definition), then sentences with a qualifier, then the rest;
   round-robin across the replies, so no long reply starves the others. 5% keeps the
   lead sentences of ranges with few figures while the evaluation corpus's history reach
   at 64 KiB stays 1.9x the raw-only projection's (docs/evaluate.md): 1.95x at 0, 1.87x at
   6%, 1.75x at 8%.
4. Output in reply order, a sentence once even if several replies repeat it, no labels.

A new model id is a new job identity (contract §1): extractive-1's summaries stay valid,
and a range summarized by both keeps both.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from pycompactor.models import AssistantReply
from pycompactor.quality.figures import FIGURE, figures
from pycompactor.quality.qualifiers import QUALIFIERS_EN, QUALIFIERS_ZH, qualifiers
from pycompactor.quality.qualifiers import sentences as qualifier_sentences
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS, OfflineSummarizer, _excerpt

EXTRACTIVE2_MODEL: Final = "pycompactor/extractive-2"
#: The default target: summary UTF-8 bytes at most this share of the replies' bytes.
DEFAULT_TARGET: Final = 0.35
#: Why a summary is longer than its target: the target is below the one character a
#: summary needs (contract §6: a summary has a non-whitespace character).
TARGET_TOO_SMALL: Final = "target_too_small"

_ASCII_WS: Final = " \t\n\r\f\v"
_ASCII_WS_RUN: Final = re.compile(r"[ \t\n\r\f\v]+")
_LINES: Final = re.compile(r"[\n\r]+")
# List markers cost bytes and say nothing: "- ", "* ", "• ", "・".
_BULLET: Final = re.compile(r"^(?:[-*•]\s+|・\s*)")
# After these ends the qualifier measure starts a new sentence at a space (ASCII) or at
# once (CJK); after anything else a newline keeps sentences apart.
_ASCII_END: Final = (".", "!", "?", ";")
_CJK_END: Final = ("。", "！", "？", "；")

_HEAD, _BODY = 0, 1

#: The default context allowance: sentences without figures are added only while the
#: summary is under this share of the replies' bytes (and the target); see step 3 above.
DEFAULT_CONTEXT: Final = 0.05
# Words kept before and after each figure (what it is about, and its unit), widest first:
# narrower windows only when the wider clauses do not all fit the target.
_WINDOWS: Final = ((4, 2), (2, 1), (1, 0), (0, 0))
# A word, or one CJK character (Chinese has no spaces to cut at).
_CJK: Final = "\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef"
_TOKEN: Final = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_GAP: Final = " … "
_GAP_BYTES: Final = len(_GAP.encode("utf-8"))
_STOPS: Final = ".!?;"
# Where the qualifiers of pycompactor.quality.qualifiers stand in a sentence, so a cut keeps them.
_QUALIFIER_SPAN: Final = re.compile(
    r"\b(?:" + "|".join(re.escape(q).replace(r"\ ", r"\s+")
                        for q in sorted(QUALIFIERS_EN, key=len, reverse=True))
    + r")\b|n't\b|" + "|".join(sorted(QUALIFIERS_ZH, key=len, reverse=True)),
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class Extract:
    """A summary and its budget: `over_target` says why `text` is over `target_bytes`
    (None when it is not)."""

    text: str
    target_bytes: int
    over_target: str | None = None


@dataclass(frozen=True, slots=True)
class _Unit:
    reply: int
    position: int
    text: str
    size: int  # UTF-8 bytes, plus one for the separator before it
    chars: int
    figures: frozenset[str]
    facts: frozenset[tuple[str, str]]
    tier: int  # _HEAD: the first sentence of a paragraph or list item
    rank: int  # its place among its reply's units of the same tier


def _units(replies: Sequence[str]) -> list[_Unit]:
    """The sentences of the replies as the qualifier measure splits them, each once."""
    seen: set[str] = set()
    units: list[_Unit] = []
    for r, reply in enumerate(replies):
        if reply in replies[:r]:
            continue  # its sentences are all seen: do not split it again
        ranks = [0, 0]
        position = 0
        for line in _LINES.split(reply):
            for i, raw in enumerate(qualifier_sentences(line)):
                text = _BULLET.sub("", _ASCII_WS_RUN.sub(" ", raw)).strip(_ASCII_WS)
                if not text.strip() or text in seen:
                    continue
                seen.add(text)
                found = figures(text)
                # Only facts need their qualifiers here: the qualifier match is the
                # costliest step of a range (context asks later, and only if it must).
                marks = qualifiers(text) if found else set()
                tier = _HEAD if i == 0 else _BODY
                # The unit is one sentence as the qualifier measure splits text, so its
                # qualified facts (qualifiers.qualified_facts) are all its pairs.
                facts = frozenset((f, q) for f in found for q in marks)
                units.append(_Unit(
                    r, position, text, len(text.encode("utf-8")) + 1, len(text) + 1,
                    frozenset(found), facts, tier, ranks[tier],
                ))
                ranks[tier] += 1
                position += 1
    return units


def _join(chosen: Sequence[_Unit]) -> str:
    parts: list[str] = []
    previous: _Unit | None = None
    for unit in chosen:
        if previous is not None:
            if previous.reply != unit.reply:
                parts.append("\n")
            elif previous.text.endswith(_CJK_END):
                pass  # Chinese text has no space between sentences
            elif previous.text.endswith(_ASCII_END):
                parts.append(" ")
            else:
                parts.append("\n")
        parts.append(unit.text)
        previous = unit
    return "".join(parts)


def target_bytes(replies: Sequence[str], target: float = DEFAULT_TARGET) -> int:
    """The most UTF-8 bytes a summary of these replies may take at this target."""
    return int(target * sum(len(r.encode("utf-8")) for r in replies))


def _clause(unit: _Unit, before: int, after: int) -> _Unit:
    """The unit cut to the words that state its facts: `before` and `after` words around
    each figure, every qualifier of its sentence and the word it qualifies, other words
    left out with an ellipsis. The whole unit when the cut would lose a figure or a
    qualified fact (the measures' own functions re-read the cut)."""
    text = unit.text
    tokens = [(m.start(), m.end()) for m in _TOKEN.finditer(text)]
    last = len(tokens) - 1
    keep: set[int] = set()
    for i, (start, end) in enumerate(tokens):
        if FIGURE.search(text, start, end):
            keep.update(range(max(0, i - before), min(last, i + after) + 1))
    if unit.facts:
        ends = [end for _, end in tokens]
        for m in _QUALIFIER_SPAN.finditer(text):
            # The tokens it overlaps, and the word it negates or bounds: "not required",
            # "only 3".
            first = bisect_right(ends, m.start())
            stop = bisect_left(ends, m.end())
            if first <= stop <= last:
                keep.update(range(first, min(last, stop + min(1, after)) + 1))
    runs: list[list[int]] = []
    for i in sorted(keep):
        if runs and (i == runs[-1][1] + 1 or len(
                text[tokens[runs[-1][1]][1]:tokens[i][0]].encode("utf-8")) <= _GAP_BYTES):
            runs[-1][1] = i  # the words between cost no more than the ellipsis
        else:
            runs.append([i, i])
    parts = [text[tokens[first][0]:tokens[end][1]] for first, end in runs]
    for k, (_, end) in enumerate(runs):
        if end != last:
            # An inner cut must not end the sentence: the fact and its qualifiers stay in
            # one sentence, as the qualifier measure reads it.
            parts[k] = parts[k].rstrip(_STOPS)
    cut = _GAP.join(p for p in parts if p)
    if len(cut) >= len(text) or not _states(cut, unit):
        return unit
    return _Unit(unit.reply, unit.position, cut, len(cut.encode("utf-8")) + 1, len(cut) + 1,
                 unit.figures, unit.facts, unit.tier, unit.rank)


def fact_clauses(replies: Sequence[str]) -> list[str]:
    """The tightest clauses stating the replies' figures and qualified facts (the figures
    and qualifiers alone, with what lies between them when no longer than an ellipsis):
    when these fit the target together, `extract` states every figure and fact."""
    last = _WINDOWS[-1]
    return [_clause(u, *last).text for u in _units(replies) if u.figures]


def _states(cut: str, unit: _Unit) -> bool:
    """Whether `cut`, as one sentence, still holds the unit's figures and qualified facts."""
    if len(qualifier_sentences(cut)) != 1 or not unit.figures <= figures(cut):
        return False
    return not unit.facts or unit.facts <= {
        (f, q) for f in unit.figures for q in qualifiers(cut)}


class _Choice:
    """Units chosen so far and what they cost, against the budget and the 6,000 chars."""

    def __init__(self, units: Sequence[_Unit], budget: int) -> None:
        self.units = units
        self.budget = budget
        self.chosen: set[int] = set()
        self.used = self.chars = 0

    def fits(self, u: _Unit, budget: int | None = None) -> bool:
        # (The first unit's separator is never written: hence the `+ 1`.)
        return (self.used + u.size <= (self.budget if budget is None else budget) + 1
                and self.chars + u.chars <= MAX_SUMMARY_CHARS + 1)

    def take(self, i: int) -> None:
        self.chosen.add(i)
        self.used += self.units[i].size
        self.chars += self.units[i].chars


def extract(replies: Sequence[str], target: float = DEFAULT_TARGET,
            context: float = DEFAULT_CONTEXT) -> Extract:
    """The extractive-2 summary of some replies, at most `target` x their UTF-8 bytes.

    Deterministic. States every figure, with the qualifiers of its sentence, whenever the
    tightest clauses stating them fit the target together; then adds context sentences
    while the summary stays within `context` x the replies' bytes (and the target). Never
    over the target, except with `over_target` set when even one character would be (a
    summary cannot be empty); never over 6,000 characters.
    """
    if not 0.0 < target <= 1.0:  # NaN fails this too
        raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
    if not 0.0 <= context <= 1.0:
        raise ValueError(f"context must be a share from 0 to 1, got {context}")
    budget = target_bytes(replies, target)
    whole = _units(replies)
    factual = [i for i, u in enumerate(whole) if u.figures]
    # The widest clauses whose cover states every figure and fact; else the tightest's.
    for before, after in _WINDOWS:
        units = [_clause(u, before, after) if u.figures else u for u in whole]
        choice = _Choice(units, budget)
        if _cover(units, factual, choice):
            break
    allowance = min(budget, target_bytes(replies, context))
    for i in _context(units):
        if choice.used >= allowance:
            break
        if choice.fits(units[i], allowance):
            choice.take(i)
    if choice.chosen:
        return Extract(_join([units[i] for i in sorted(choice.chosen)]), budget)
    return _fallback(replies, whole, budget)


def _context(units: Sequence[_Unit]) -> Iterator[int]:
    """Context, best first: sentences without figures and with a word (a lone "." says
    nothing); the heads, then sentences with a qualifier, then the rest, round-robin
    across the replies. Lazily: most summaries stop within the heads, and the qualifier
    search is not asked of the other sentences unless they are reached."""
    candidates = [i for i, u in enumerate(units)
                  if not u.figures and any(c.isalnum() for c in u.text)]
    yield from sorted((i for i in candidates if units[i].tier == _HEAD),
                      key=lambda i: (units[i].rank, units[i].reply, i))
    ranks: dict[tuple[int, bool], int] = {}
    keyed: list[tuple[bool, int, int, int]] = []
    for i in candidates:
        u = units[i]
        if u.tier != _HEAD:
            plain = _QUALIFIER_SPAN.search(u.text) is None
            rank = ranks.get((u.reply, plain), 0)
            ranks[(u.reply, plain)] = rank + 1
            keyed.append((plain, rank, u.reply, i))
    yield from (key[-1] for key in sorted(keyed))


def _cover(units: Sequence[_Unit], factual: Sequence[int], choice: _Choice) -> bool:
    """Greedy cover of the figures and qualified facts, by what each byte adds: a clause
    that states nothing new (a figure or fact an earlier pick states) is not written.
    True when every figure and fact is covered."""
    wanted: set[object] = set()
    for i in factual:
        wanted |= units[i].figures | units[i].facts
    pool = list(factual)
    while wanted and pool:
        best, best_value = -1, 0.0
        for i in pool:
            u = units[i]
            # A figure counts double: losing it loses its facts too.
            gain = 2 * len(u.figures & wanted) + len(u.facts & wanted)
            if gain and choice.fits(u) and gain / u.size > best_value:
                best, best_value = i, gain / u.size
        if best < 0:
            return False
        choice.take(best)
        pool.remove(best)
        wanted -= units[best].figures | units[best].facts
    return not wanted


def _fallback(replies: Sequence[str], units: Sequence[_Unit], budget: int) -> Extract:
    """No whole sentence fits: an excerpt of the best one, else a single character."""
    if units:
        best = max(units, key=lambda u: (len(u.figures), -u.reply, -u.position))
        room = min(budget, MAX_SUMMARY_CHARS)
        while room > 0:
            text = _excerpt(best.text, room)
            if len(text.encode("utf-8")) <= budget and text.strip(_ASCII_WS):
                return Extract(text, budget)
            room -= max(1, (len(text.encode("utf-8")) - budget) // 4)
    # Content the sentence split strips (NBSP, U+3000, ...) still counts (contract §3).
    first = next((c for reply in replies for c in reply if c not in _ASCII_WS), "-")
    over = TARGET_TOO_SMALL if len(first.encode("utf-8")) > budget else None
    return Extract(first, budget, over)


class Extractive2Summarizer(OfflineSummarizer):
    """`pycompactor/extractive-2`: deterministic, offline, compressed to a target."""

    def __init__(self, target: float = DEFAULT_TARGET, context: float = DEFAULT_CONTEXT) -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
        if not 0.0 <= context <= 1.0:
            raise ValueError(f"context must be a share from 0 to 1, got {context}")
        self._target = target
        self._context = context

    @property
    def model(self) -> str:
        return EXTRACTIVE2_MODEL

    @property
    def target(self) -> float:
        return self._target

    @property
    def context(self) -> float:
        return self._context

    def _text(self, pairs: Sequence[AssistantReply]) -> str:
        return extract([p.assistant_content for p in pairs], self._target, self._context).text
