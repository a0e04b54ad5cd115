"""`pycompactor/extractive-2`: the offline summarizer that compresses to a target.

extractive-1 keeps sentences up to the 6,000 characters a summary may hold, so its
summaries are about as long as the replies they replace, and its `[message-id]` labels
are text the next model reads for nothing. extractive-2 is offline and deterministic too,
but it writes at most `target` x the replies' UTF-8 bytes (default 0.35), as plain text:

1. Facts first. Every sentence holding a figure (DESIGN.md §8) is kept whole when they all
   fit the target together, so every figure and every qualifier sharing a sentence with
   one ("no longer", "only", "not", a correction; pycompactor.qualifiers) stays with the
   fact it qualifies. When they do not all fit, sentences are chosen greedily by new
   figures and qualified facts per byte; the figures left out are then lost, and the
   worker's figure gate (`figures_lost`) sees that from the text, as for any model.
2. Then, in what budget is left: the first sentence of each paragraph or list item (a
   release note's headline, a parameter's definition), then sentences with a qualifier,
   then the rest; round-robin across the replies, so no long reply starves the others.
3. Output in reply order, a sentence once even if several replies repeat it, no labels.

A new model id is a new job identity (DESIGN.md §1): extractive-1's summaries stay valid,
and a range summarized by both keeps both.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from pycompactor.extractive import MAX_SUMMARY_CHARS, _excerpt
from pycompactor.figures import figures
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.models import AssistantReply
from pycompactor.outcomes import INVALID_TEXT, Failure, ModelOutcome, Reply, storable
from pycompactor.qualifiers import qualifiers
from pycompactor.qualifiers import sentences as qualifier_sentences

EXTRACTIVE2_MODEL: Final = "pycompactor/extractive-2"
#: The default target: summary UTF-8 bytes at most this share of the replies' bytes.
DEFAULT_TARGET: Final = 0.35
#: Why a summary is longer than its target: the target is below the one character a
#: summary needs (DESIGN.md §6: a summary has a non-whitespace character).
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

_HEAD, _QUALIFIED, _REST = 0, 1, 2


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
    tier: int
    rank: int  # its place among its reply's units of the same tier


def _units(replies: Sequence[str]) -> list[_Unit]:
    """The sentences of the replies as the qualifier measure splits them, each once."""
    seen: set[str] = set()
    units: list[_Unit] = []
    for r, reply in enumerate(replies):
        if reply in replies[:r]:
            continue  # its sentences are all seen: do not split it again
        ranks = [0, 0, 0]
        position = 0
        for line in _LINES.split(reply):
            for i, raw in enumerate(qualifier_sentences(line)):
                text = _BULLET.sub("", _ASCII_WS_RUN.sub(" ", raw)).strip(_ASCII_WS)
                if not text.strip() or text in seen:
                    continue
                seen.add(text)
                found = figures(text)
                # Heads without figures are ranked without asking for qualifiers: the
                # qualifier match is the costliest step of a range.
                marks = qualifiers(text) if found or i else set()
                tier = _HEAD if i == 0 else _QUALIFIED if marks else _REST
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


def extract(replies: Sequence[str], target: float = DEFAULT_TARGET) -> Extract:
    """The extractive-2 summary of some replies, at most `target` x their UTF-8 bytes.

    Deterministic. Keeps every figure whenever the sentences holding figures fit the target
    together. Never over the target, except with `over_target` set when even one character
    would be (a summary cannot be empty); never over 6,000 characters.
    """
    if not 0.0 < target <= 1.0:  # NaN fails this too
        raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
    budget = target_bytes(replies, target)
    units = _units(replies)
    chosen: set[int] = set()
    used = chars = 0

    def fits(u: _Unit) -> bool:
        return used + u.size <= budget + 1 and chars + u.chars <= MAX_SUMMARY_CHARS + 1

    def take(i: int) -> None:
        nonlocal used, chars
        chosen.add(i)
        used += units[i].size
        chars += units[i].chars

    factual = [i for i, u in enumerate(units) if u.figures]
    # (The first unit's separator is never written: hence the `+ 1` in fits.)
    if (sum(units[i].size for i in factual) <= budget + 1
            and sum(units[i].chars for i in factual) <= MAX_SUMMARY_CHARS + 1):
        for i in factual:
            take(i)
    else:
        _cover(units, factual, fits, take)
    rest = sorted((i for i in range(len(units)) if i not in chosen),
                  key=lambda i: (units[i].tier, units[i].rank, units[i].reply, i))
    for i in rest:
        if used >= budget:
            break
        if fits(units[i]):
            take(i)
    if chosen:
        text = _join([units[i] for i in sorted(chosen)])
        return Extract(text, budget)
    return _fallback(replies, units, budget)


def _cover(units: Sequence[_Unit], factual: Sequence[int], fits: Callable[[_Unit], bool],
           take: Callable[[int], None]) -> None:
    """Greedy cover of the figures and qualified facts, by what each byte adds."""
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
            if gain and fits(u) and gain / u.size > best_value:
                best, best_value = i, gain / u.size
        if best < 0:
            return
        take(best)
        pool.remove(best)
        wanted -= units[best].figures | units[best].facts


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
    # Content the sentence split strips (NBSP, U+3000, ...) still counts (DESIGN.md §3).
    first = next((c for reply in replies for c in reply if c not in _ASCII_WS), "-")
    over = TARGET_TOO_SMALL if len(first.encode("utf-8")) > budget else None
    return Extract(first, budget, over)


class Extractive2Summarizer:
    """`pycompactor/extractive-2`: deterministic, offline, compressed to a target."""

    def __init__(self, target: float = DEFAULT_TARGET) -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
        self._target = target

    @property
    def model(self) -> str:
        return EXTRACTIVE2_MODEL

    @property
    def target(self) -> float:
        return self._target

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome:
        if len(pairs) != PAIRS_PER_RANGE:
            raise ValueError(f"a summary covers exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
        text = extract([p.assistant_content for p in pairs], self._target).text
        if not storable(text):
            return Failure(INVALID_TEXT, "reply holds NUL or a lone surrogate")
        return Reply(text, "stop", 0, None)

    def close(self) -> None:
        pass

    def __enter__(self) -> Extractive2Summarizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
