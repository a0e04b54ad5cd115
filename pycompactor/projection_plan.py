"""The pure, deterministic core of a projection (no database): judging stored summaries
(`select_summaries`), walking the newest suffix of history that fits the budget
(`_walk`), planning (`plan_projection`), rendering (`render_projection`) and running
them over in-memory pairs (`project_pairs`). `pycompactor.projection` describes both
layers and feeds this one from PostgreSQL."""

from __future__ import annotations

from collections.abc import (
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import datetime
from typing import Final, NamedTuple, Protocol

from pycompactor.errors import UsageError
from pycompactor.hashing import PAIRS_PER_RANGE
from pycompactor.projection_types import (
    _MARKER_LINE_BYTES,
    DID_NOT_FIT,
    MAX_BUDGET_BYTES,
    MESSAGE_OVERHEAD_BYTES,
    RAW,
    STALE_SOURCE,
    SUMMARIZED,
    SUPERSEDED,
    VERSION_NOT_PROJECTABLE,
    ChatMessage,
    HistoryChanged,
    Manifest,
    PairMeta,
    Placement,
    Plan,
    PlanItem,
    Projection,
    RawItem,
    Reason,
    Rejections,
    SourcePair,
    StoredSummary,
    SummaryCandidate,
    SummaryItem,
    _binds_range,
    summary_content,
    utf8_len,
)

# --------------------------------------------------------------------------- pure core


def check_budget(budget_bytes: object) -> int:
    """A budget is a whole number of bytes, 0 or more; anything else is a bad argument."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise UsageError(f"budget_bytes must be a whole number of bytes, got {budget_bytes!r}")
    if budget_bytes < 0:
        raise UsageError(f"budget_bytes must be 0 or more, got {budget_bytes}")
    if budget_bytes > MAX_BUDGET_BYTES:
        raise UsageError(f"budget_bytes must be at most {MAX_BUDGET_BYTES}, got {budget_bytes}")
    return budget_bytes


def model_preference(model: str, projection_models: Sequence[str]) -> int:
    """A model's rank in the owner's projection preference, higher preferred: a model
    named earlier before one named later, named before unnamed (0).

    The twin of compaction.model_preference (contract §9); a caller of
    `project_pairs` passes it as each summary's `model_rank`.
    """
    try:
        return len(projection_models) - list(projection_models).index(model)
    except ValueError:
        return 0


def _preference(summary: SummaryCandidate) -> tuple[int, int, datetime, int]:
    # Sorted descending (contract §9): newer prompt version, then the owner's
    # model preference, then latest completed_at, then higher id.
    return (summary.version_rank, summary.model_rank, summary.completed_at,
            summary.summary_id)


def _range_ids(pairs: Sequence[PairMeta], start: int) -> tuple[str, ...]:
    """Current source ids [u0, a0, ..., u9, a9] of the range starting at pair `start`."""
    return tuple(
        mid for p in pairs[start : start + PAIRS_PER_RANGE]
        for mid in (p.user_message_id, p.assistant_message_id)
    )


def summary_reason(summary: SummaryCandidate, pairs: Sequence[PairMeta],
                   flat_ids: Sequence[str] | None = None) -> Reason | None:
    """The rejection that applies to a summary whatever the budget, or None if it is valid.

    `version_not_projectable`, then `stale_source`: its source is not current (the range is
    gone or incomplete, or its current 20 ids or hash differ from the stored ones). Both
    are decided from metadata for every summary, reachable by the walk or not (contract §9:
    only `did_not_fit` depends on the budget). The ids are compared with `pairs` as well,
    so a plan never uses a block whose pairs it was not given.
    """
    if not summary.projectable:
        return VERSION_NOT_PROJECTABLE
    if not summary.source_current or not _binds_range(summary, len(pairs)):
        return STALE_SOURCE
    start = 2 * summary.from_pair
    current = (_range_ids(pairs, summary.from_pair) if flat_ids is None
               else tuple(flat_ids[start : start + 2 * PAIRS_PER_RANGE]))
    if current != tuple(summary.source_message_ids):
        return STALE_SOURCE
    return None


def _flat_ids(pairs: Sequence[PairMeta]) -> list[str]:
    """[u0, a0, u1, a1, ...] of all pairs: a range's ids are a slice of it."""
    flat: list[str] = []
    for p in pairs:
        flat += (p.user_message_id, p.assistant_message_id)
    return flat


def _summary_message_bytes(from_pair: int, to_pair: int, summary_bytes: int) -> int:
    """UTF-8 bytes of a summary message's content: the marker line (its pair numbers are
    ASCII digits), a newline, the summary; without formatting the line."""
    return _MARKER_LINE_BYTES + len(str(from_pair)) + len(str(to_pair)) + 1 + summary_bytes


#: A raw pair's cost beyond its texts' bytes: two messages.
_RAW_PAIR_OVERHEAD: Final = 2 * MESSAGE_OVERHEAD_BYTES
#: A summary block's cost beyond its texts' bytes: 10 user messages and the summary's.
_BLOCK_OVERHEAD: Final = (PAIRS_PER_RANGE + 1) * MESSAGE_OVERHEAD_BYTES


def _block_cost(user_bytes: Iterable[int], from_pair: int, to_pair: int,
                summary_bytes: int) -> int:
    """Cost of a summary block from its range's user messages' sizes and its summary's."""
    return (sum(user_bytes) + _BLOCK_OVERHEAD
            + _summary_message_bytes(from_pair, to_pair, summary_bytes))


def block_cost(summary: ChosenSummary, pairs: Sequence[PairMeta], first: int = 0) -> int:
    """Cost of a summary block: the range's 10 user messages plus the summary message.
    `pairs` start at pair `first`."""
    users = pairs[summary.from_pair - first : summary.to_pair + 1 - first]
    return _block_cost((p.user_bytes for p in users), summary.from_pair, summary.to_pair,
                       summary.summary_bytes)


@dataclass(frozen=True, slots=True)
class Selection:
    """Outcome of `select_summaries`, before the walk."""

    chosen: dict[int, SummaryCandidate]  # by from_pair
    rejected: dict[int, Reason]  # by summary_id


def select_summaries(
    pairs: Sequence[PairMeta], summaries: Sequence[SummaryCandidate]
) -> Selection:
    """Per range, the chosen summary; per other summary, its rejection reason.

    Reasons are checked in the contract's order: version_not_projectable, stale_source,
    superseded (did_not_fit is decided later, by the walk).
    """
    rejected: dict[int, Reason] = {}
    by_range: dict[int, list[SummaryCandidate]] = {}
    flat_ids = _flat_ids(pairs) if summaries else []
    for summary in summaries:
        reason = summary_reason(summary, pairs, flat_ids)
        if reason is not None:
            rejected[summary.summary_id] = reason
        else:
            by_range.setdefault(summary.from_pair, []).append(summary)
    chosen: dict[int, SummaryCandidate] = {}
    for from_pair, valid in by_range.items():
        best, *others = sorted(valid, key=_preference, reverse=True)
        chosen[from_pair] = best
        for other in others:
            rejected[other.summary_id] = SUPERSEDED
    return Selection(chosen, rejected)


class ChosenSummary(Protocol):
    """What the walk needs of a range's chosen summary (SummaryCandidate has these)."""

    @property
    def summary_id(self) -> int: ...

    @property
    def from_pair(self) -> int: ...

    @property
    def to_pair(self) -> int: ...

    @property
    def summary_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Chosen:
    """A chosen summary as the database's verdict gives it (projection_frame)."""

    summary_id: int
    from_pair: int
    to_pair: int
    summary_bytes: int


class _Columns(NamedTuple):
    """Pairs `first`.. as four columns, the way projection_frame gives them: the walk reads
    them by position and makes no object per pair."""

    user_message_ids: Sequence[str]
    assistant_message_ids: Sequence[str]
    user_bytes: Sequence[int]
    assistant_bytes: Sequence[int]


def _columns(pairs: Sequence[PairMeta]) -> _Columns:
    return _Columns([p.user_message_id for p in pairs], [p.assistant_message_id for p in pairs],
                    [p.user_bytes for p in pairs], [p.assistant_bytes for p in pairs])


class _Walk(NamedTuple):
    """What the walk decided: newest first, the plan items and each included pair's
    placement and summary id; the chosen summaries whose blocks it tried and dropped,
    and the first pair it included. Not `finished` when it needed a pair before those it
    was given."""

    items: list[PlanItem]
    placements: list[Placement]
    summary_ids: list[int | None]
    dropped: set[int]
    remaining: int
    start: int
    finished: bool


_SUMMARIZED_RANGE: Final[list[Placement]] = [SUMMARIZED] * PAIRS_PER_RANGE


def _walk(pairs: _Columns, first: int, chosen: Mapping[int, ChosenSummary],
          budget: int) -> _Walk:
    """The budget walk over pairs `first`.. (all pairs after them; `first` a multiple of
    10), newest first. Not finished when it would need a pair before `first` (the caller
    reads further back and walks again); always finished for first = 0.

    A pair outside any chosen summary's range is taken raw; at a range with a chosen
    summary the whole block is tried, and if it does not fit (`dropped`: `did_not_fit`),
    that range's raw pairs newest first. The first thing that does not fit ends the
    walk, so the included history is always a contiguous newest suffix. A block costs
    `_block_cost`, a raw pair its two texts' bytes and `_RAW_PAIR_OVERHEAD`.
    """
    users, assistants, user_bytes, assistant_bytes = pairs
    remaining = budget
    newest_first: list[PlanItem] = []
    placements: list[Placement] = []
    summary_ids: list[int | None] = []
    dropped: set[int] = set()
    index = first + len(users) - 1
    while index >= 0:
        if index < first:
            return _Walk(newest_first, placements, summary_ids, dropped, remaining,
                         index + 1, False)
        start = index - index % PAIRS_PER_RANGE
        summary = chosen.get(start)
        # A range's block is tried once: if it fits the walk moves past the range, and if
        # it is dropped the walk goes on over the range's raw pairs.
        if summary is not None and summary.summary_id not in dropped:
            # A chosen summary's range is complete and the walk is contiguous, so the walk
            # meets the range at its last pair.
            assert index == summary.to_pair
            low, high = start - first, summary.to_pair + 1 - first
            cost = _block_cost(user_bytes[low:high], start, summary.to_pair,
                               summary.summary_bytes)
            if cost <= remaining:
                remaining -= cost
                newest_first.append(SummaryItem(summary.summary_id, start, summary.to_pair,
                                                tuple(users[low:high])))
                placements += _SUMMARIZED_RANGE
                summary_ids += (summary.summary_id,) * PAIRS_PER_RANGE
                index = start - 1
                continue
            # The block does not fit: fall back to this range's raw pairs, newest first.
            dropped.add(summary.summary_id)
        position = index - first
        cost = user_bytes[position] + assistant_bytes[position] + _RAW_PAIR_OVERHEAD
        if cost > remaining:
            break
        remaining -= cost
        newest_first.append(RawItem(index, users[position], assistants[position]))
        placements.append(RAW)
        summary_ids.append(None)
        index -= 1
    return _Walk(newest_first, placements, summary_ids, dropped, remaining, index + 1, True)


def _plan(walk: _Walk, verdicts: Iterable[tuple[int, int, Reason | None]],
          budget: int) -> Plan:
    """The plan from a finished walk and the summaries' (summary_id, from_pair, reason),
    ordered by (from_pair, summary_id), reason None for the one chosen per range: every
    rejected summary, and at least the chosen ones the walk reached.

    A chosen summary is `did_not_fit` only when the walk tried its block and dropped it
    (contract §9); one beyond the walk's reach was not tried and is not listed (its pairs
    are `omitted`), so the rejections do not grow with the summaries the budget cannot
    reach.
    """
    ids: list[int] = []
    from_pairs: list[int] = []
    reasons: list[Reason] = []
    dropped = walk.dropped
    for summary_id, from_pair, reason in verdicts:
        if reason is None:
            if summary_id not in dropped:
                continue
            reason = DID_NOT_FIT
        ids.append(summary_id)
        from_pairs.append(from_pair)
        reasons.append(reason)
    return Plan(
        items=tuple(reversed(walk.items)),
        pairs=Manifest._of_columns(walk.start, walk.placements[::-1],
                                   walk.summary_ids[::-1]),
        rejected_summaries=Rejections(ids, from_pairs, reasons),
        used_bytes=budget - walk.remaining,
        budget_bytes=budget,
    )


def plan_projection(
    pairs: Sequence[PairMeta], summaries: Sequence[SummaryCandidate], budget_bytes: int
) -> Plan:
    """Decide the projection from metadata alone (pure and deterministic).

    `pairs` are all eligible pairs, pair_index 0..N-1 in order; `summaries` are every
    stored summary of the conversation and scope, in any order, each knowing whether its
    source is current. Every summary gets its reason from metadata, wherever its range
    lies (`select_summaries`); then the walk (`_walk`) decides what fits. A chosen
    summary whose block the walk tried and dropped is `did_not_fit`; one beyond the
    walk's reach is not listed.
    """
    budget = check_budget(budget_bytes)
    if any(p.pair_index != i for i, p in enumerate(pairs)):
        raise ValueError("pairs must be every eligible pair, ordered by pair_index from 0")
    selection = select_summaries(pairs, summaries)
    walk = _walk(_columns(pairs), 0, selection.chosen, budget)
    assert walk.finished  # it was given every pair
    chosen_ids = {s.summary_id for s in selection.chosen.values()}
    verdicts = sorted(
        ((s.summary_id, s.from_pair,
          None if s.summary_id in chosen_ids else selection.rejected[s.summary_id])
         for s in summaries),
        key=lambda v: (v[1], v[0]),
    )
    return _plan(walk, verdicts, budget)


def render_projection(
    plan: Plan, message_texts: Mapping[str, str], summary_texts: Mapping[int, str]
) -> Projection:
    """Turn a plan and the texts it names into chat messages (pure).

    Raises HistoryChanged if a text is missing or its size differs from what was planned
    (the history changed between reads), so the budget holds whatever happens.
    """
    messages: list[ChatMessage] = []
    try:
        for item in plan.items:
            if isinstance(item, RawItem):
                messages.append({"role": "user",
                                 "content": message_texts[item.user_message_id]})
                messages.append({"role": "assistant",
                                 "content": message_texts[item.assistant_message_id]})
            else:
                messages.extend({"role": "user", "content": message_texts[mid]}
                                for mid in item.user_message_ids)
                # The summary is a lossy account of assistant replies only: it travels in
                # an assistant message, never as something the user said.
                messages.append({
                    "role": "assistant",
                    "content": summary_content(item.from_pair, item.to_pair,
                                               summary_texts[item.summary_id]),
                })
    except KeyError as exc:
        raise HistoryChanged(
            f"history changed while projecting ({exc.args[0]!r} disappeared); project again"
        ) from None
    # message_cost of each, summed with one call per message (a projection's last step,
    # paid on every call).
    used = (sum(len(m["content"].encode("utf-8")) for m in messages)
            + MESSAGE_OVERHEAD_BYTES * len(messages))
    if used != plan.used_bytes or used > plan.budget_bytes:
        raise HistoryChanged(
            f"history changed while projecting (planned {plan.used_bytes} bytes, "
            f"texts cost {used}); project again"
        )
    return Projection(
        messages=tuple(messages),
        pairs=plan.pairs,
        rejected_summaries=plan.rejected_summaries,
        used_bytes=used,
        budget_bytes=plan.budget_bytes,
    )


def project_pairs(
    pairs: Sequence[SourcePair], summaries: Sequence[StoredSummary], *, budget_bytes: int
) -> Projection:
    """The whole projection over in-memory pairs and summaries (no database).

    It follows the database path step for step: each summary's source is judged by
    recomputing its range's ids and hash (`pycompactor.source_hash`, the Python twin of
    the SQL) from `pairs`, so both paths give the same projection and the same reasons.
    """
    budget = check_budget(budget_bytes)
    metas = [
        PairMeta(p.pair_index, p.user_message_id, p.assistant_message_id,
                 utf8_len(p.user_content), utf8_len(p.assistant_content))
        for p in pairs
    ]
    plan = plan_projection(metas, [s.candidate(pairs) for s in summaries], budget)
    texts = {p.user_message_id: p.user_content for p in pairs}
    texts.update({p.assistant_message_id: p.assistant_content for p in pairs})
    return render_projection(plan, texts, {s.summary_id: s.summary for s in summaries})
