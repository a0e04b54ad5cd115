"""`pycompactor/extractive-1`: the offline, deterministic summarizer (no model at all).

It keeps whole sentences of the ten replies, those with figures first, each labelled with
its message id, within the 6,000 characters a summary may hold; the demo, the tests and
air-gapped workers use it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Final, Self

from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.models import AssistantReply
from pycompactor.quality.figures import FIGURE
from pycompactor.summarizers.outcomes import INVALID_TEXT, Failure, ModelOutcome, Reply, storable

OFFLINE_MODEL: Final = "pycompactor/extractive-1"
#: The summary limit of contract §8, as this summarizer's own output budget (the
#: database enforces the limit on every summary: compaction.reply_problem).
MAX_SUMMARY_CHARS: Final = 6000
# The six ASCII whitespace characters of contract §3; NBSP, U+3000 etc. count as content.
_ASCII_WS: Final = " \t\n\r\f\v"

# Sentence ends: ASCII .!? followed by whitespace, and the Chinese 。！？ (no space
# needed), each possibly followed by a closing quote or bracket that stays with it.
# Newlines always end a sentence (list items, headings).
_SENTENCE_SPLIT = re.compile(
    r"(?<=[.!?])[ \t\r\f\v]+"
    r"|(?<=[.!?][\"')\]”’])[ \t\r\f\v]+"
    r"|(?<=[。！？])(?![。！？”’」』）)\]\"'])[ \t\r\f\v]*"
    r"|(?<=[。！？][”’」』）)\]\"'])[ \t\r\f\v]*"
)
_LINE_BREAKS = re.compile(r"[\n\r]+")
_ASCII_WS_RUN = re.compile(r"[ \t\n\r\f\v]+")
_DIGIT = re.compile(r"\d")
# Named entities, heuristically: a capitalised word that does not open the sentence,
# an acronym, or a CJK title or quotation (《基金》, 「…」).
_ENTITY = re.compile(
    r"(?<=[^\s.!?。！？])\s+[A-Z][\w&'-]*|\b[A-Z]{2,}\b|[《「『][^》」』]+[》」』]"
)
_ELLIPSIS = "…"
_CJK_ENDS = frozenset("。！？”’」』）")


def split_sentences(text: str) -> list[str]:
    """Sentences of a reply, with runs of ASCII whitespace collapsed to one space."""
    sentences: list[str] = []
    # Only \n and \r end lines: str.splitlines() would also split on U+0085, U+2028 and
    # others, which §3 counts as content.
    for line in _LINE_BREAKS.split(text):
        for piece in _SENTENCE_SPLIT.split(line):
            sentence = _ASCII_WS_RUN.sub(" ", piece).strip(_ASCII_WS)
            if sentence:
                sentences.append(sentence)
    return sentences


def _tier(sentence: str) -> int:
    """2: figures or dates; 1: named entities; 0: the rest."""
    if _DIGIT.search(sentence):
        return 2
    if _ENTITY.search(sentence):
        return 1
    return 0


def _label(message_id: str) -> str:
    return f"[{message_id}]"


def extractive_summary(pairs: Sequence[AssistantReply], limit: int = MAX_SUMMARY_CHARS) -> str:
    """Deterministic extract of the replies, one labelled line per reply, <= limit chars.

    Sentences are chosen greedily by tier (figures and dates, then named entities, then
    the rest) and, within a tier, round-robin across replies so that no long reply
    starves the others; a sentence that does not fit is skipped, not cut. So if all the
    sentences holding digits fit together, every number and date is kept, and if
    everything fits, everything is kept. Replies left without a sentence then get a
    truncated prefix of their best one, if room is left. Output keeps reply order and
    each reply's sentence order.
    """
    sentences = [split_sentences(p.assistant_content) for p in pairs]
    labels = [_label(p.assistant_message_id) for p in pairs]

    candidates: list[tuple[int, int, int, int]] = []  # (-tier, rank, reply, sentence)
    for r, reply_sentences in enumerate(sentences):
        rank_in_tier = [0, 0, 0]
        for s, sentence in enumerate(reply_sentences):
            tier = _tier(sentence)
            candidates.append((-tier, rank_in_tier[tier], r, s))
            rank_in_tier[tier] += 1
    candidates.sort()

    chosen: list[dict[int, str]] = [{} for _ in pairs]
    used = 0
    lines = 0

    def cost(r: int, text: str) -> int:
        if chosen[r]:
            return 1 + len(text)  # a space before it on the reply's line
        return len(labels[r]) + 1 + len(text) + (1 if lines else 0)  # label, newline

    def take(r: int, s: int, text: str) -> None:
        nonlocal used, lines
        used += cost(r, text)
        if not chosen[r]:
            lines += 1
        chosen[r][s] = text

    for _neg_tier, _rank, r, s in candidates:
        if used >= limit - 1:
            break  # the smallest addition costs two characters
        text = sentences[r][s]
        if used + cost(r, text) <= limit:
            take(r, s, text)

    # Replies with nothing chosen (their sentences were all too long): share what is
    # left and give each a cut prefix of its most informative sentence.
    starved = [r for r in range(len(pairs)) if not chosen[r] and sentences[r]]
    for i, r in enumerate(starved):
        share = (limit - used) // (len(starved) - i)
        best = min(c for c in candidates if c[2] == r)[3]
        room = share - cost(r, "")
        if room >= 2:
            text = sentences[r][best]
            take(r, best, _excerpt(text, room))

    out = "\n".join(
        labels[r] + " " + _join([chosen[r][s] for s in sorted(chosen[r])])
        for r in range(len(pairs))
        if chosen[r]
    )
    if not out:
        # Only labels longer than the limit can get here; keep the text, drop the label.
        first = next((" ".join(s) for s in sentences if s), "")
        out = _excerpt(first, limit)
    return out


def _join(sentences: list[str]) -> str:
    """Join with a space, except after CJK sentence ends (no space in Chinese text).

    Budgeting counts a space everywhere, so leaving one out only makes the text shorter.
    """
    parts = [sentences[0]]
    for previous, sentence in itertools.pairwise(sentences):
        parts.append(sentence if previous[-1] in _CJK_ENDS else " " + sentence)
    return "".join(parts)


def _excerpt(text: str, room: int) -> str:
    """At most `room` characters of a sentence, around its first digit if it has one.

    A cut sentence still carries its first figure or date when the figure lies deep in
    a long run of text.
    """
    if len(text) <= room:
        return text
    digit = _DIGIT.search(text)
    start = 0
    if digit is not None and digit.start() > room // 4:
        start = min(digit.start() - room // 4, len(text) - (room - 1))
    lead = _ELLIPSIS if start > 0 else ""
    body_len = room - len(lead) - (1 if start + room - len(lead) < len(text) else 0)
    end = start + body_len
    # Never cut a figure in two: `2026-10` of `2026-10-09` would be a different figure.
    # (No figure is cut at the start: it lies before the first digit.)
    for match in FIGURE.finditer(text, start, len(text)):
        if match.start() >= end:
            break
        if match.end() > end and match.start() > start:
            end = match.start()
            break
    body = text[start:end]
    body_len = len(body)
    tail = _ELLIPSIS if start + body_len < len(text) else ""
    return lead + body + tail


class OfflineSummarizer:
    """What every offline summarizer shares: ten replies in, a normal stop out (the same
    for the same replies on every machine), nothing to close. A subclass names its model
    and writes the text (`_text`)."""

    @property
    def model(self) -> str:
        raise NotImplementedError

    def _text(self, pairs: Sequence[AssistantReply]) -> str:
        raise NotImplementedError

    def summarize(self, pairs: Sequence[AssistantReply]) -> ModelOutcome:
        if len(pairs) != PAIRS_PER_RANGE:
            raise ValueError(f"a summary covers exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
        text = self._text(pairs)
        if not storable(text):
            return Failure(INVALID_TEXT, "reply holds NUL or a lone surrogate")
        return Reply(text, "stop", 0, None)

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ExtractiveSummarizer(OfflineSummarizer):
    """`pycompactor/extractive-1`: deterministic, offline, no model at all.

    Its output is the same for the same replies on every machine and run, and always a
    normal stop, so it exercises the whole pipeline without a network.
    """

    @property
    def model(self) -> str:
        return OFFLINE_MODEL

    def _text(self, pairs: Sequence[AssistantReply]) -> str:
        return extractive_summary(pairs)
