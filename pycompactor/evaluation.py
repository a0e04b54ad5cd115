"""What compaction buys and loses, measured: the metrics of `pycompactor evaluate`.

A typed API over frozen dataclasses, shared by the command, the demo and `make bench`:

* pure metrics: `compression` (summary UTF-8 bytes / the ten replies' bytes), figure
  retention (`pycompactor.quality.figures.figure_stats`, contract §8) and qualifier
  retention (`pycompactor.quality.qualifiers.qualifier_stats`); attribution, qualifier
  scope and invented figures (`pycompactor.quality.fidelity`: does the summary still
  answer the questions the replies answer, and state no figure they never gave);
  `target_ranges` (the window policy of contract §4), and `reach`: how many of a
  conversation's pairs the next Run sees under a budget with the summaries and without
  any (the raw-only projection: newest pairs only). Reach is planned by the projection's
  own pure planner (`pycompactor.projection.plan_projection`), so it follows contract §9
  to the byte: cost = UTF-8 bytes + 16 per message, a summary block is the range's ten
  user messages plus one assistant message of the marker line and the summary, the
  included history is a contiguous newest suffix, and a block that does not fit falls
  back to its raw pairs.
* the driver `evaluate`, which summarizes every target range of in-memory conversations
  with any `Summarizer` (offline or an OpenAI-compatible model) and measures the
  results. It holds no database connection and writes nothing anywhere: a live
  database's pairs are read beforehand (`pycompactor.cli.evaluate.read_database`).

Aggregates (`Totals`, `ReachTotals`) pool their ranges: overall compression is all the
summaries' bytes over all their replies' bytes, retention all kept over all total.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.projection import (
    PairMeta,
    SourcePair,
    SummaryCandidate,
    plan_projection,
    utf8_len,
)
from pycompactor.quality import fidelity
from pycompactor.quality.fidelity import Question
from pycompactor.quality.figures import figure_stats
from pycompactor.quality.qualifiers import qualifier_stats
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION, Summarizer
from pycompactor.summarizers.outcomes import Failure, Reply

#: The budgets reach is measured at, in KiB (and in bytes): a small, a medium and two
#: large context allowances for history.
BUDGETS_KIB: Final = (8, 16, 32, 64)
DEFAULT_BUDGETS: Final = tuple(k * 1024 for k in BUDGETS_KIB)

#: Ranges the report lists whole (summary beside source), the lowest attribution first.
WORST_RANGES: Final = 5

#: contract §4: the first target needs this many pairs; the newest 20 are never in one.
FIRST_TARGET_PAIRS: Final = 30

# The six ASCII whitespace characters of contract §3: a summary needs another character.
_ASCII_WS: Final = " \t\n\r\f\v"
# Any fixed time: every planned summary is valid and alone in its range, so the
# preference among summaries (which reads it) never decides anything here.
_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class EvalPair:
    """One pair of a conversation under evaluation (pycompactor.models.Pair has the same
    attributes, so the summarizers, the hash and the projection accept both)."""

    pair_index: int
    user_message_id: str
    user_content: str
    assistant_message_id: str
    assistant_content: str


@dataclass(frozen=True, slots=True)
class EvalConversation:
    """A conversation's eligible pairs, oldest first, with its language (`en`, `zh`, or
    `other`: a live database's conversations get `guess_language`'s guess)."""

    conversation_id: str
    language: str
    pairs: tuple[EvalPair, ...]


def conversation_from_texts(conversation_id: str, language: str,
                            texts: Iterable[tuple[str, str]]) -> EvalConversation:
    """A conversation from (user, assistant) texts, oldest first, with message ids
    `u0, a0, u1, a1, ...` (the offline summarizer labels each reply with its id, so the
    ids count in its summary's bytes: short ones, as a JSONL file has none)."""
    return EvalConversation(conversation_id, language, tuple(
        EvalPair(i, f"u{i}", user, f"a{i}", assistant)
        for i, (user, assistant) in enumerate(texts)
    ))


def guess_language(texts: Iterable[str]) -> str:
    """`zh` when most letters are CJK ideographs, `en` when most are ASCII letters,
    else `other`: a live database does not say which language a conversation is in."""
    cjk = latin = 0
    for text in texts:
        for ch in text:
            if "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf":
                cjk += 1
            elif ch.isascii() and ch.isalpha():
                latin += 1
    if cjk == latin == 0:
        return "other"
    # A Chinese character carries about a word; a Latin letter a fifth of one.
    return "zh" if cjk * 5 >= latin else "en"


# --------------------------------------------------------------------------- metrics


def target_ranges(n_pairs: int) -> tuple[int, ...]:
    """The from_pair of every range the window policy makes a target with `n_pairs`
    eligible pairs (contract §4: range k iff 10k + 30 <= N), in order."""
    return tuple(range(0, max(n_pairs - FIRST_TARGET_PAIRS + 1, 0), PAIRS_PER_RANGE))


def compression(replies: Iterable[str], summary: str) -> float:
    """Summary UTF-8 bytes / the replies' UTF-8 bytes (below 1: the summary is smaller).

    Raises ValueError when the replies hold no bytes (a ratio of nothing)."""
    source = sum(utf8_len(r) for r in replies)
    if source == 0:
        raise ValueError("compression of empty replies is undefined")
    return utf8_len(summary) / source


def reply_problem(outcome: Reply | Failure) -> str | None:
    """Why a model's outcome would not be recorded as a summary, or None if it would.

    A `Failure`'s own reason; for a `Reply`, the rules `compaction.complete` applies
    (contract §6, in its order): `not_stopped`, `tool_calls`, `empty`, `too_long`. The
    evaluation writes nothing, so it cannot ask the database; these are the contract's
    rules, not the engine's code.
    """
    if isinstance(outcome, Failure):
        return outcome.reason
    if outcome.finish_reason != "stop":
        return "not_stopped"
    if outcome.tool_call_count != 0:
        return "tool_calls"
    if not outcome.text.strip(_ASCII_WS):
        return "empty"
    if len(outcome.text) > MAX_SUMMARY_CHARS:
        return "too_long"
    return None


@dataclass(frozen=True, slots=True)
class RangeResult:
    """One target range, summarized (or not: `failure` says why) and measured."""

    from_pair: int
    to_pair: int
    #: UTF-8 bytes of the range's ten assistant replies.
    replies_bytes: int
    #: UTF-8 bytes of the summary; None when the attempt failed.
    summary_bytes: int | None
    figures_total: int
    #: Distinct figures of the replies the summary holds verbatim; None when it failed.
    figures_kept: int | None
    qualifiers_total: int
    qualifiers_kept: int | None
    #: Token usage as the API reported it (None: not reported, or the offline model).
    input_tokens: int | None
    output_tokens: int | None
    #: Wall-clock seconds of the model call.
    seconds: float
    failure: str | None = None
    #: Questions the replies answer by a figure (pycompactor.quality.fidelity), and how
    #: many of them the summary answers with the right figure, unambiguously (None: failed).
    attribution_total: int = 0
    attribution_kept: int | None = None
    #: Qualifiers whose own sentence the reader finds again, and how many of the summary
    #: sentences it finds still carry them (None: failed).
    scope_total: int = 0
    scope_kept: int | None = None
    #: Figures of the summary that no reply holds, reply labels aside (contract §8).
    invented: tuple[str, ...] | None = None
    #: For the worst-range listing (not in to_dict: a report lists its worst ranges
    #: whole): the summary, the replies, and the questions the summary did not answer.
    summary: str | None = field(default=None, repr=False)
    replies: tuple[str, ...] = field(default=(), repr=False)
    lost: tuple[Question, ...] = field(default=(), repr=False)

    @property
    def attribution(self) -> float | None:
        """attribution_kept / attribution_total; None without such questions or summary."""
        if self.attribution_kept is None or self.attribution_total == 0:
            return None
        return self.attribution_kept / self.attribution_total

    @property
    def qualifier_scope(self) -> float | None:
        if self.scope_kept is None or self.scope_total == 0:
            return None
        return self.scope_kept / self.scope_total

    @property
    def invented_figures(self) -> int | None:
        return None if self.invented is None else len(self.invented)

    @property
    def compression(self) -> float | None:
        if self.summary_bytes is None or self.replies_bytes == 0:
            return None
        return self.summary_bytes / self.replies_bytes

    @property
    def figure_retention(self) -> float | None:
        """figures_kept / figures_total; None without figures or without a summary."""
        if self.figures_kept is None or self.figures_total == 0:
            return None
        return self.figures_kept / self.figures_total

    @property
    def qualifier_retention(self) -> float | None:
        if self.qualifiers_kept is None or self.qualifiers_total == 0:
            return None
        return self.qualifiers_kept / self.qualifiers_total

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_pair": self.from_pair, "to_pair": self.to_pair,
            "replies_bytes": self.replies_bytes, "summary_bytes": self.summary_bytes,
            "compression": self.compression,
            "figures_total": self.figures_total, "figures_kept": self.figures_kept,
            "figure_retention": self.figure_retention,
            "qualifiers_total": self.qualifiers_total,
            "qualifiers_kept": self.qualifiers_kept,
            "qualifier_retention": self.qualifier_retention,
            "attribution_total": self.attribution_total,
            "attribution_kept": self.attribution_kept, "attribution": self.attribution,
            "qualifier_scope_total": self.scope_total,
            "qualifier_scope_kept": self.scope_kept, "qualifier_scope": self.qualifier_scope,
            "invented_figures": self.invented_figures, "invented": list(self.invented or ()),
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 6), "failure": self.failure,
        }


def measure_range(pairs: Sequence[SourcePair], summary: str | None, *,
                  input_tokens: int | None = None, output_tokens: int | None = None,
                  seconds: float = 0.0, failure: str | None = None) -> RangeResult:
    """The measures of one range's summary (pure); `summary` None for a failed attempt."""
    if len(pairs) != PAIRS_PER_RANGE:
        raise ValueError(f"a range holds exactly {PAIRS_PER_RANGE} pairs, got {len(pairs)}")
    replies = [p.assistant_content for p in pairs]
    figures = figure_stats(pairs, summary or "")
    qualified = qualifier_stats(replies, summary or "")
    labels = [p.assistant_message_id for p in pairs]
    asked = fidelity.questions(replies, summary or "", labels)
    attributed = [q for q in asked if q.kind == "figure"]
    scoped = [q for q in asked if q.kind == "qualifier"]
    done = summary is not None
    return RangeResult(
        from_pair=pairs[0].pair_index, to_pair=pairs[-1].pair_index,
        replies_bytes=sum(utf8_len(r) for r in replies),
        summary_bytes=None if summary is None else utf8_len(summary),
        figures_total=figures.total,
        figures_kept=None if summary is None else figures.kept,
        qualifiers_total=qualified.total,
        qualifiers_kept=None if summary is None else qualified.kept,
        input_tokens=input_tokens, output_tokens=output_tokens, seconds=seconds,
        failure=failure,
        attribution_total=len(attributed),
        attribution_kept=sum(q.kept for q in attributed) if done else None,
        scope_total=len(scoped),
        scope_kept=sum(q.kept for q in scoped) if done else None,
        invented=None if summary is None else tuple(sorted(fidelity.invented(
            replies, summary, labels))),
        summary=summary, replies=tuple(replies),
        lost=tuple(q for q in asked if not q.kept) if done else (),
    )


@dataclass(frozen=True, slots=True)
class Reach:
    """How many of a conversation's pairs reach the next Run under one budget: with the
    summaries (`compacted`, of which `summarized` travel as summary blocks), with
    the raw-only projection (`raw_only`: newest pairs only), and with summaries of the
    same ranges one byte long (`ceiling`: what no summary of them passes, since a block
    still carries its ten user messages verbatim and the newest pairs stay raw)."""

    budget_bytes: int
    compacted: int
    summarized: int
    raw_only: int
    compacted_bytes: int
    raw_only_bytes: int
    ceiling: int

    @property
    def gain(self) -> int:
        """Pairs compaction adds (negative when its blocks cost more than raw pairs)."""
        return self.compacted - self.raw_only

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "compacted": self.compacted,
                "summarized": self.summarized, "raw_only": self.raw_only, "gain": self.gain,
                "compacted_bytes": self.compacted_bytes, "raw_only_bytes": self.raw_only_bytes,
                "ceiling": self.ceiling}


def _metas(pairs: Sequence[SourcePair]) -> list[PairMeta]:
    return [PairMeta(i, p.user_message_id, p.assistant_message_id,
                     utf8_len(p.user_content), utf8_len(p.assistant_content))
            for i, p in enumerate(pairs)]


def _candidates(pairs: Sequence[SourcePair],
                summaries: Mapping[int, str]) -> list[SummaryCandidate]:
    out = []
    for from_pair, text in sorted(summaries.items()):
        block = pairs[from_pair : from_pair + PAIRS_PER_RANGE]
        if from_pair % PAIRS_PER_RANGE or len(block) != PAIRS_PER_RANGE:
            raise ValueError(f"no range of {PAIRS_PER_RANGE} pairs starts at pair {from_pair}")
        # Summarized in memory from these very pairs: its source is current by definition.
        out.append(SummaryCandidate(
            summary_id=from_pair + 1, from_pair=from_pair,
            to_pair=from_pair + PAIRS_PER_RANGE - 1,
            source_message_ids=tuple(m for p in block
                                     for m in (p.user_message_id, p.assistant_message_id)),
            source_hash="0" * 64, prompt_version=PROMPT_VERSION, projectable=True,
            version_rank=0, completed_at=_EPOCH, summary_bytes=utf8_len(text),
            source_current=True,
        ))
    return out


def reach(pairs: Sequence[SourcePair], summaries: Mapping[int, str],
          budgets: Iterable[int] = DEFAULT_BUDGETS) -> tuple[Reach, ...]:
    """Reach of the next Run at each budget, with `summaries` (text by from_pair) and
    without any, planned by the projection's planner (contract §9; pure).

    `pairs` are every eligible pair of the conversation, oldest first (EvalPair, or the
    engine's own pycompactor.models.Pair).
    """
    metas = _metas(pairs)
    candidates = _candidates(pairs, summaries)
    smallest = _candidates(pairs, dict.fromkeys(summaries, "-"))
    out = []
    for budget in budgets:
        compacted = plan_projection(metas, candidates, budget)
        raw_only = plan_projection(metas, [], budget)
        ceiling = plan_projection(metas, smallest, budget)
        out.append(Reach(
            budget_bytes=budget,
            compacted=len(metas) - compacted.pairs.omitted,
            summarized=sum(1 for p in compacted.pairs if p.placement == "summarized"),
            raw_only=len(metas) - raw_only.pairs.omitted,
            compacted_bytes=compacted.used_bytes, raw_only_bytes=raw_only.used_bytes,
            ceiling=len(metas) - ceiling.pairs.omitted,
        ))
    return tuple(out)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class ConversationResult:
    conversation_id: str
    language: str
    pairs: int
    ranges: tuple[RangeResult, ...]
    reach: tuple[Reach, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "language": self.language,
                "pairs": self.pairs, "ranges": [r.to_dict() for r in self.ranges],
                "reach": [r.to_dict() for r in self.reach]}


def _ratio(kept: int, total: int) -> float | None:
    return kept / total if total else None


def _sum_reported(values: Iterable[int | None]) -> int | None:
    reported = [v for v in values if v is not None]
    return sum(reported) if reported else None


@dataclass(frozen=True, slots=True)
class Totals:
    """Ranges pooled: sums over the summarized ranges (failed ones are only counted)."""

    ranges: int
    failed: int
    replies_bytes: int
    summary_bytes: int
    figures_total: int
    figures_kept: int
    qualifiers_total: int
    qualifiers_kept: int
    input_tokens: int | None
    output_tokens: int | None
    seconds: float
    attribution_total: int = 0
    attribution_kept: int = 0
    scope_total: int = 0
    scope_kept: int = 0
    #: Invented figures, summed over the summarized ranges.
    invented_figures: int = 0

    @property
    def compression(self) -> float | None:
        return _ratio(self.summary_bytes, self.replies_bytes)

    @property
    def attribution(self) -> float | None:
        return _ratio(self.attribution_kept, self.attribution_total)

    @property
    def qualifier_scope(self) -> float | None:
        return _ratio(self.scope_kept, self.scope_total)

    @property
    def figure_retention(self) -> float | None:
        return _ratio(self.figures_kept, self.figures_total)

    @property
    def qualifier_retention(self) -> float | None:
        return _ratio(self.qualifiers_kept, self.qualifiers_total)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranges": self.ranges, "failed": self.failed,
            "replies_bytes": self.replies_bytes, "summary_bytes": self.summary_bytes,
            "compression": self.compression,
            "figures_total": self.figures_total, "figures_kept": self.figures_kept,
            "figure_retention": self.figure_retention,
            "qualifiers_total": self.qualifiers_total,
            "qualifiers_kept": self.qualifiers_kept,
            "qualifier_retention": self.qualifier_retention,
            "attribution_total": self.attribution_total,
            "attribution_kept": self.attribution_kept, "attribution": self.attribution,
            "qualifier_scope_total": self.scope_total, "qualifier_scope_kept": self.scope_kept,
            "qualifier_scope": self.qualifier_scope,
            "invented_figures": self.invented_figures,
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 6),
        }


def totals(ranges: Iterable[RangeResult]) -> Totals:
    """Pool ranges (pure): ratios of sums, over the ranges that got a summary."""
    ranges = tuple(ranges)
    done = [r for r in ranges if r.failure is None]
    return Totals(
        ranges=len(ranges), failed=len(ranges) - len(done),
        replies_bytes=sum(r.replies_bytes for r in done),
        summary_bytes=sum(r.summary_bytes or 0 for r in done),
        figures_total=sum(r.figures_total for r in done),
        figures_kept=sum(r.figures_kept or 0 for r in done),
        qualifiers_total=sum(r.qualifiers_total for r in done),
        qualifiers_kept=sum(r.qualifiers_kept or 0 for r in done),
        input_tokens=_sum_reported(r.input_tokens for r in ranges),
        output_tokens=_sum_reported(r.output_tokens for r in ranges),
        seconds=sum(r.seconds for r in ranges),
        attribution_total=sum(r.attribution_total for r in done),
        attribution_kept=sum(r.attribution_kept or 0 for r in done),
        scope_total=sum(r.scope_total for r in done),
        scope_kept=sum(r.scope_kept or 0 for r in done),
        invented_figures=sum(r.invented_figures or 0 for r in done),
    )


@dataclass(frozen=True, slots=True)
class ReachTotals:
    """Reach at one budget, summed over conversations."""

    budget_bytes: int
    conversations: int
    pairs: int
    compacted: int
    raw_only: int
    #: Pairs reached were every summary one byte (Reach.ceiling).
    ceiling: int

    @property
    def gain(self) -> int:
        return self.compacted - self.raw_only

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "conversations": self.conversations,
                "pairs": self.pairs, "compacted": self.compacted, "raw_only": self.raw_only,
                "gain": self.gain, "ceiling": self.ceiling}


def reach_totals(conversations: Sequence[ConversationResult],
                 budgets: Sequence[int]) -> tuple[ReachTotals, ...]:
    """Per budget, the pairs reached with and without compaction over all conversations."""
    out = []
    for i, budget in enumerate(budgets):
        out.append(ReachTotals(
            budget_bytes=budget, conversations=len(conversations),
            pairs=sum(c.pairs for c in conversations),
            compacted=sum(c.reach[i].compacted for c in conversations),
            raw_only=sum(c.reach[i].raw_only for c in conversations),
            ceiling=sum(c.reach[i].ceiling for c in conversations),
        ))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Report:
    """Everything `pycompactor evaluate` measured: per conversation and range, and pooled."""

    model: str
    #: The OpenAI API called (`chat`, `responses`), None for an offline summarizer.
    api: str | None
    source: str
    budgets: tuple[int, ...]
    conversations: tuple[ConversationResult, ...]

    @property
    def ranges(self) -> tuple[RangeResult, ...]:
        return tuple(r for c in self.conversations for r in c.ranges)

    @property
    def overall(self) -> Totals:
        return totals(self.ranges)

    def by_language(self) -> dict[str, Totals]:
        """Pooled per language, languages in alphabetical order."""
        languages = sorted({c.language for c in self.conversations})
        return {lang: totals(r for c in self.conversations if c.language == lang
                             for r in c.ranges)
                for lang in languages}

    @property
    def reach(self) -> tuple[ReachTotals, ...]:
        return reach_totals(self.conversations, self.budgets)

    def worst(self, n: int = WORST_RANGES) -> tuple[tuple[str, RangeResult], ...]:
        """The n summarized ranges with the lowest attribution (then the lowest qualifier
        scope; ranges without a figure question last), as (conversation_id, range)."""
        ranked = sorted(
            ((c.conversation_id, r) for c in self.conversations for r in c.ranges
             if r.failure is None and (r.attribution_total or r.scope_total)),
            key=lambda cr: (_or_one(cr[1].attribution), _or_one(cr[1].qualifier_scope)))
        return tuple(ranked[:n])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (what `pycompactor evaluate --json` prints)."""
        return {
            "model": self.model, "api": self.api, "source": self.source,
            "budgets": list(self.budgets),
            "overall": self.overall.to_dict(),
            "by_language": {k: v.to_dict() for k, v in self.by_language().items()},
            "reach": [r.to_dict() for r in self.reach],
            "worst": [worst_dict(cid, r) for cid, r in self.worst()],
            "conversations": [c.to_dict() for c in self.conversations],
        }


def _or_one(value: float | None) -> float:
    return 1.0 if value is None else value


def worst_dict(conversation_id: str, r: RangeResult) -> dict[str, Any]:
    """A range of the worst-range listing, with its summary, replies and lost questions."""
    return {"conversation_id": conversation_id, "from_pair": r.from_pair,
            "to_pair": r.to_pair, "compression": r.compression,
            "attribution": r.attribution, "qualifier_scope": r.qualifier_scope,
            "invented": list(r.invented or ()), "summary": r.summary, "replies": list(r.replies),
            "lost": [q.to_dict() for q in r.lost]}


# --------------------------------------------------------------------------- driver


Clock = Callable[[], float]


def summarize_range(pairs: Sequence[SourcePair], summarizer: Summarizer, *,
                    clock: Clock = time.monotonic) -> tuple[str | None, RangeResult]:
    """One model call on a range, measured: (the summary or None, its RangeResult)."""
    started = clock()
    outcome = summarizer.summarize(pairs)
    seconds = clock() - started
    problem = reply_problem(outcome)
    summary = outcome.text if isinstance(outcome, Reply) and problem is None else None
    return summary, measure_range(
        pairs, summary, input_tokens=outcome.input_tokens,
        output_tokens=outcome.output_tokens, seconds=seconds, failure=problem)


def evaluate_conversation(conversation: EvalConversation, summarizer: Summarizer, *,
                          budgets: Sequence[int] = DEFAULT_BUDGETS,
                          clock: Clock = time.monotonic) -> ConversationResult:
    """Summarize every target range of a conversation (contract §4) and measure it all."""
    pairs = conversation.pairs
    if any(p.pair_index != i for i, p in enumerate(pairs)):
        raise ValueError(f"conversation {conversation.conversation_id}: pairs must be "
                         "numbered 0, 1, 2, ... oldest first")
    results = []
    summaries: dict[int, str] = {}
    for from_pair in target_ranges(len(pairs)):
        summary, result = summarize_range(pairs[from_pair : from_pair + PAIRS_PER_RANGE],
                                          summarizer, clock=clock)
        results.append(result)
        if summary is not None:
            summaries[from_pair] = summary
    return ConversationResult(conversation.conversation_id, conversation.language,
                              len(pairs), tuple(results), reach(pairs, summaries, budgets))


def evaluate(conversations: Iterable[EvalConversation], summarizer: Summarizer, *,
             source: str, api: str | None = None,
             budgets: Sequence[int] = DEFAULT_BUDGETS, clock: Clock = time.monotonic,
             progress: Callable[[ConversationResult], None] | None = None) -> Report:
    """Evaluate a summarizer on conversations; `progress` hears of each one as it ends."""
    results = []
    for conversation in conversations:
        result = evaluate_conversation(conversation, summarizer, budgets=budgets, clock=clock)
        results.append(result)
        if progress is not None:
            progress(result)
    return Report(summarizer.model, api, source, tuple(budgets), tuple(results))
