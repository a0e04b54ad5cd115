"""Naive whole-sentence selection: the baseline an offline summarizer must beat.

Measured on public text: take every sentence of the replies (as the measures split
them, pycompactor.quality.qualifiers.statements) that holds a
figure (contract §8) or a qualifier of the scope set (pycompactor.quality.qualifiers), most
per byte first, until the summary would pass a byte target. It never cuts a sentence,
so each line keeps what its figures are about as far as its own sentence says it. A
summarizer that compresses harder must still answer more of the replies' questions
(pycompactor.quality.fidelity) at the same bytes, or it is not worth its cleverness.

- a sentence's **facts**: its distinct figures plus its distinct qualifiers;
- ranked by facts per UTF-8 byte, highest first (earlier sentences first on a tie), and
  with `caveats_first` every sentence holding a qualifier before any without;
- kept greedily while the summary (sentences joined by newlines) stays within `target`
  x the replies' UTF-8 bytes and the contract's 6,000 characters; a sentence that does
  not fit is skipped for smaller ones;
- written in reply order, one sentence a line, a repeated sentence once.

Offline and deterministic; `pycompactor evaluate --compare` and the bench measure it
under the model ids below. It is not a worker model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from pycompactor.models import AssistantReply
from pycompactor.quality.figures import figures
from pycompactor.quality.qualifiers import scope_qualifiers, statements, unwrap
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS, OfflineSummarizer

#: The baseline's model id in reports, and its caveats-first variant's.
BASELINE_MODEL: Final = "baseline/whole-sentences"
BASELINE_CAVEATS_MODEL: Final = "baseline/whole-sentences-caveats-first"
BASELINE_MODELS: Final = (BASELINE_MODEL, BASELINE_CAVEATS_MODEL)


def _utf8(text: str) -> int:
    return len(text.encode("utf-8"))


def select(replies: Sequence[str], target: float, *, caveats_first: bool = False) -> str:
    """The baseline summary of the replies within `target` x their UTF-8 bytes (pure)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
    budget = target * sum(_utf8(r) for r in replies)
    found: list[str] = list(dict.fromkeys(s for r in replies for s in statements(unwrap(r))))
    ranked = []
    for order, sentence in enumerate(found):
        caveats = scope_qualifiers(sentence)
        facts = len(figures(sentence)) + len(caveats)
        if facts:
            ranked.append((caveats_first and not caveats, -facts / _utf8(sentence), order))
    chosen: set[int] = set()
    used_bytes = used_chars = 0
    for _, _, order in sorted(ranked):
        sentence = found[order]
        sep = 1 if chosen else 0  # the newline before every line but the first
        if (used_bytes + sep + _utf8(sentence) <= budget
                and used_chars + sep + len(sentence) <= MAX_SUMMARY_CHARS):
            chosen.add(order)
            used_bytes += sep + _utf8(sentence)
            used_chars += sep + len(sentence)
    return "\n".join(found[i] for i in sorted(chosen))


class BaselineSummarizer(OfflineSummarizer):
    """The baseline as a summarizer, so `evaluate` measures it like any model."""

    def __init__(self, target: float, *, caveats_first: bool = False) -> None:
        if not 0.0 < target <= 1.0:
            raise ValueError(f"target must be a share above 0 and at most 1, got {target}")
        self._target = target
        self._caveats_first = caveats_first

    @property
    def model(self) -> str:
        return BASELINE_CAVEATS_MODEL if self._caveats_first else BASELINE_MODEL

    def _text(self, pairs: Sequence[AssistantReply]) -> str:
        return select([p.assistant_content for p in pairs], self._target,
                      caveats_first=self._caveats_first)
