"""Projection for the next Run: source-checked summaries under a UTF-8 byte budget (contract §9).

Two layers:

* a pure, deterministic core over frozen dataclasses. `select_summaries` judges every
  stored summary from metadata (binding, version, whether its source is current): which
  one each range uses, and why each other one is not used; `_walk` decides, from pair
  *metadata* (ids and byte lengths), which newest suffix of history fits the budget;
  `plan_projection` runs both; `render_projection` turns the plan plus the few texts it
  names into chat messages. `project_pairs` runs them over in-memory pairs (judging each
  summary's source with `pycompactor.source_hash`); tests drive it without a database.
  The manifest (`Manifest`) and the rejections (`Rejections`) are sequences whose
  entries are made when read: a long conversation costs no object per pair or summary.
* a thin reading layer that feeds the core from PostgreSQL in one snapshot (so metadata
  and texts agree). One statement (`compaction.projection_read`) gives the newest
  pairs' metadata, every summary's verdict (while the engine keeps its derived state,
  judged when their ranges or they were written; otherwise judged from the views in
  that statement, with every pair) and the texts of what the engine's walk of them
  includes; the driver plans from the metadata itself (`_frame_step`) and renders if
  every text it needs came (`_one_read`). Otherwise (a text not sent) the reads run in
  one read-only repeatable-read transaction (`_projection_steps`): the frame, then only
  the texts the plan includes (a schema before revision 0041 without its derived state
  gives no frame: every pair's and summary's metadata, judged from the views, instead).
  With the derived state, the text read and shipped grows with the budget, not with the
  conversation (docs/projection.md, "Cost"). The reads are written once, driver-free;
  two small drivers run them, usually one round trip: `project_history` on a
  `psycopg.Connection`, `aproject_history` on a `psycopg.AsyncConnection`.

The rules, the marker line and the manifest shape are documented in docs/projection.md.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any, Final, Literal, NamedTuple, Protocol, TypedDict, TypeVar, overload

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from pycompactor import db
from pycompactor.errors import PycompactorError, UsageError, wrap_exceptions
from pycompactor.hashing import PAIRS_PER_RANGE, PairLike, source_hash

EntryT = TypeVar("EntryT")

#: Fixed cost added to the UTF-8 byte length of every message's content (role, framing).
MESSAGE_OVERHEAD_BYTES: Final = 16

#: The largest budget: PostgreSQL's bigint, so a host can store `budget_bytes` and
#: `used_bytes` beside its runs. Any budget up to it projects (no history comes near it).
MAX_BUDGET_BYTES: Final = 2**63 - 1
#: The most pairs one read asks compaction.projection_frame for (its p_pairs is an int),
#: in whole ranges: a budget that would want more wants every pair there is.
_MAX_PAIRS_READ: Final = (2**31 - 1) // PAIRS_PER_RANGE * PAIRS_PER_RANGE

#: First line of every summary message; {from_pair} and {to_pair} are zero-based pair
#: indices. The summary text follows on the next line. The en dash is U+2013.
SUMMARY_MARKER: Final = "[pycompactor summary of assistant replies, pairs {from_pair}–{to_pair}]"

Placement = Literal["raw", "summarized", "omitted"]
RAW: Final = "raw"
SUMMARIZED: Final = "summarized"
OMITTED: Final = "omitted"

Reason = Literal["version_not_projectable", "stale_source", "superseded", "did_not_fit"]
VERSION_NOT_PROJECTABLE: Final = "version_not_projectable"
STALE_SOURCE: Final = "stale_source"
SUPERSEDED: Final = "superseded"
DID_NOT_FIT: Final = "did_not_fit"


class ChatMessage(TypedDict):
    """One chat-API message: {"role": "user" | "assistant", "content": str}."""

    role: str
    content: str


def marker_line(from_pair: int, to_pair: int) -> str:
    """The fixed first line of the assistant message that carries a range's summary."""
    return SUMMARY_MARKER.format(from_pair=from_pair, to_pair=to_pair)


def summary_content(from_pair: int, to_pair: int, summary: str) -> str:
    """Content of a summary message: the marker line, a newline, the summary text."""
    return f"{marker_line(from_pair, to_pair)}\n{summary}"


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def message_cost(content: str) -> int:
    """Cost of one message: UTF-8 bytes of its content + MESSAGE_OVERHEAD_BYTES."""
    return utf8_len(content) + MESSAGE_OVERHEAD_BYTES


#: UTF-8 bytes of the marker line without its two pair numbers (ASCII digits): the walk
#: adds the numbers' digits rather than format the line.
_MARKER_LINE_BYTES: Final = utf8_len(SUMMARY_MARKER.format(from_pair="", to_pair=""))
#: The same size as the engine's walk (compaction.projection_read) is told it; the
#: rendering stays here, only its size travels.
_MARKER_BYTES: Final = _MARKER_LINE_BYTES


# --------------------------------------------------------------------------- inputs


class PairMeta(NamedTuple):
    """An eligible pair without its texts: ids and UTF-8 byte lengths are enough to plan.

    A NamedTuple rather than a frozen dataclass (equally immutable): a projection reads
    one per eligible pair, and building 10,000 of these costs a fifth as much.
    """

    pair_index: int
    user_message_id: str
    assistant_message_id: str
    user_bytes: int
    assistant_bytes: int


@dataclass(frozen=True, slots=True)
class SummaryBinding:
    """A stored completed summary's identity and source binding, without its text."""

    summary_id: int
    from_pair: int
    to_pair: int
    source_message_ids: tuple[str, ...]
    source_hash: str
    prompt_version: str
    projectable: bool
    #: Preference among a range's summaries, higher first (the database's rank of the
    #: prompt version: compaction.projection_summaries).
    version_rank: int
    completed_at: datetime
    #: Then the owner's model preference, higher first (`model_preference` of the
    #: summary's model and compaction.settings.projection_models; 0 when not named).
    #: Keyword-only with a default: a caller without a preference leaves it out.
    model_rank: int = field(default=0, kw_only=True)


@dataclass(frozen=True, slots=True)
class SummaryCandidate(SummaryBinding):
    """A stored completed summary of the conversation and scope, as the plan sees it."""

    summary_bytes: int
    #: The range exists now with exactly the stored 20 ids and source hash.
    source_current: bool


@dataclass(frozen=True, slots=True)
class StoredSummary(SummaryBinding):
    """A stored summary with its text, for the in-memory path (`project_pairs`)."""

    summary: str

    def candidate(self, pairs: Sequence[SourcePair]) -> SummaryCandidate:
        """This summary's metadata, its source judged against `pairs` (all eligible pairs)."""
        return SummaryCandidate(
            self.summary_id, self.from_pair, self.to_pair, tuple(self.source_message_ids),
            self.source_hash, self.prompt_version, self.projectable, self.version_rank,
            self.completed_at, utf8_len(self.summary), source_is_current(self, pairs),
            model_rank=self.model_rank,
        )


class SourcePair(PairLike, Protocol):
    """An eligible pair with its texts (pycompactor.models.Pair has these attributes)."""

    @property
    def pair_index(self) -> int: ...


# --------------------------------------------------------------------------- outputs


@dataclass(frozen=True, slots=True)
class PairPlacement:
    """Manifest entry of one eligible pair; summary_id is set iff placement is summarized."""

    pair_index: int
    placement: Placement
    summary_id: int | None


class _Entries(Sequence[EntryT]):
    """An immutable sequence whose entries are made when read (`Manifest`, `Rejections`):
    indexing, slicing (which gives a tuple), and equality with another of its kind (by
    `_key`) or with a tuple or list of the same entries, like a tuple."""

    __slots__ = ()

    def _entry(self, position: int) -> EntryT:
        raise NotImplementedError

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> EntryT: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[EntryT, ...]: ...

    def __getitem__(self, index: int | slice) -> EntryT | tuple[EntryT, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"{type(self).__name__} index out of range")
        return self._entry(position)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._key() == other._key()
        if isinstance(other, tuple | list):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other,
                                                                          strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())


class Manifest(_Entries[PairPlacement]):
    """`Projection.pairs`: one entry per eligible pair, in order (contract §9).

    The included history is a contiguous newest suffix, so every pair before it is
    `omitted`; those entries are made when read rather than stored, and a projection of a
    long conversation costs what it includes, not one object per pair. The included
    pairs are kept as two columns (placement, summary id) and their entries are made
    when read too: the walk, paid on every call, makes no object per pair. It behaves
    like a tuple of its entries (`_Entries`).
    """

    __slots__ = ("_omitted", "_placements", "_summary_ids")

    _omitted: int
    _placements: tuple[Placement, ...]
    _summary_ids: tuple[int | None, ...]

    def __init__(self, omitted: int, included: Sequence[PairPlacement] = ()) -> None:
        if omitted < 0:
            raise ValueError("omitted must be 0 or more")
        if any(p.placement == OMITTED or p.pair_index != omitted + i
               for i, p in enumerate(included)):
            raise ValueError("included must be the pairs after the omitted ones, in order,"
                             " none of them omitted")
        self._omitted = omitted
        self._placements = tuple(p.placement for p in included)
        self._summary_ids = tuple(p.summary_id for p in included)

    @classmethod
    def _of_columns(cls, omitted: int, placements: Sequence[Placement],
                    summary_ids: Sequence[int | None]) -> Manifest:
        """The manifest of the walk's columns (the pairs after the omitted ones, in
        order), unchecked: the walk makes them so."""
        manifest = cls.__new__(cls)
        manifest._omitted = omitted
        manifest._placements = tuple(placements)
        manifest._summary_ids = tuple(summary_ids)
        return manifest

    @property
    def omitted(self) -> int:
        """How many pairs (the oldest) are omitted."""
        return self._omitted

    def __len__(self) -> int:
        return self._omitted + len(self._placements)

    def _entry(self, position: int) -> PairPlacement:
        if position < self._omitted:
            return PairPlacement(position, OMITTED, None)
        k = position - self._omitted
        return PairPlacement(position, self._placements[k], self._summary_ids[k])

    def _key(self) -> tuple[object, ...]:
        return (self._omitted, self._placements, self._summary_ids)

    def __iter__(self) -> Iterator[PairPlacement]:
        for position in range(self._omitted):
            yield PairPlacement(position, OMITTED, None)
        for position, (placement, summary_id) in enumerate(
                zip(self._placements, self._summary_ids, strict=True), self._omitted):
            yield PairPlacement(position, placement, summary_id)

    def __repr__(self) -> str:
        return f"Manifest(omitted={self._omitted}, included={self[self._omitted:]!r})"


@dataclass(frozen=True, slots=True)
class RejectedSummary:
    """A stored summary that is not in the projection, with the first reason that applies."""

    summary_id: int
    from_pair: int
    reason: Reason


class Rejections(_Entries[RejectedSummary]):
    """`Projection.rejected_summaries`: every stored summary rejected by a rule, and the
    chosen one whose block was tried and dropped, with its reason, ordered by
    (from_pair, summary_id) (contract §9).

    A long conversation may hold many stale or superseded summaries: they are kept as
    three columns and each entry is made when read; it behaves like a tuple of its
    entries (`_Entries`). `reason_counts` counts without making any entry.
    """

    __slots__ = ("_from_pairs", "_reasons", "_summary_ids")

    def __init__(self, summary_ids: Sequence[int] = (), from_pairs: Sequence[int] = (),
                 reasons: Sequence[Reason] = ()) -> None:
        if not len(summary_ids) == len(from_pairs) == len(reasons):
            raise ValueError("summary_ids, from_pairs and reasons must have one entry each")
        self._summary_ids = tuple(summary_ids)
        self._from_pairs = tuple(from_pairs)
        self._reasons = tuple(reasons)

    def __len__(self) -> int:
        return len(self._summary_ids)

    def _entry(self, position: int) -> RejectedSummary:
        return RejectedSummary(self._summary_ids[position], self._from_pairs[position],
                               self._reasons[position])

    def _key(self) -> tuple[object, ...]:
        return (self._summary_ids, self._from_pairs, self._reasons)

    def __iter__(self) -> Iterator[RejectedSummary]:
        for summary_id, from_pair, reason in zip(self._summary_ids, self._from_pairs,
                                                 self._reasons, strict=True):
            yield RejectedSummary(summary_id, from_pair, reason)

    def reason_counts(self) -> dict[Reason, int]:
        """How many entries have each reason (only reasons that occur)."""
        return dict(Counter(self._reasons))

    def __repr__(self) -> str:
        return f"Rejections({list(self)!r})"


@dataclass(frozen=True, slots=True)
class RawItem:
    """Plan item: a pair that travels as its original user and assistant messages."""

    pair_index: int
    user_message_id: str
    assistant_message_id: str


@dataclass(frozen=True, slots=True)
class SummaryItem:
    """Plan item: a range's 10 original user messages, then one summary message."""

    summary_id: int
    from_pair: int
    to_pair: int
    user_message_ids: tuple[str, ...]


PlanItem = RawItem | SummaryItem


@dataclass(frozen=True, slots=True)
class Plan:
    """What to project, decided from metadata; `items` are in chronological order."""

    items: tuple[PlanItem, ...]
    pairs: Manifest
    rejected_summaries: Rejections
    used_bytes: int
    budget_bytes: int

    @property
    def message_ids(self) -> tuple[str, ...]:
        """The source messages whose texts the projection needs, chronologically."""
        ids: list[str] = []
        for item in self.items:
            if isinstance(item, RawItem):
                ids += (item.user_message_id, item.assistant_message_id)
            else:
                ids += item.user_message_ids
        return tuple(ids)

    @property
    def summary_ids(self) -> tuple[int, ...]:
        return tuple(i.summary_id for i in self.items if isinstance(i, SummaryItem))


@dataclass(frozen=True, slots=True)
class Projection:
    """History for the next Run and its manifest (contract §9)."""

    messages: tuple[ChatMessage, ...]
    pairs: Manifest
    rejected_summaries: Rejections
    used_bytes: int
    budget_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """Exactly the five keys of §9, JSON-ready (what `pycompactor project --json` prints)."""
        return {
            "messages": [{"role": m["role"], "content": m["content"]} for m in self.messages],
            "pairs": [
                {"pair_index": p.pair_index, "placement": p.placement, "summary_id": p.summary_id}
                for p in self.pairs
            ],
            "rejected_summaries": [
                {"summary_id": r.summary_id, "from_pair": r.from_pair, "reason": r.reason}
                for r in self.rejected_summaries
            ],
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
        }


class HistoryChanged(PycompactorError):
    """The history changed while it was being projected; project again."""


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


def _binds_range(summary: SummaryBinding, n_pairs: int) -> bool:
    start = summary.from_pair
    return (
        start >= 0
        and start % PAIRS_PER_RANGE == 0
        and summary.to_pair == start + PAIRS_PER_RANGE - 1
        and summary.to_pair < n_pairs
    )


def source_is_current(summary: StoredSummary, pairs: Sequence[SourcePair]) -> bool:
    """Whether the summary's range exists in `pairs` (all eligible pairs, in order) with
    exactly its stored 20 ids and source hash (recomputed with `pycompactor.source_hash`).

    The in-memory twin of `projection_summaries.source_current`.
    """
    if not _binds_range(summary, len(pairs)):
        return False
    block = pairs[summary.from_pair : summary.to_pair + 1]
    ids = tuple(mid for p in block for mid in (p.user_message_id, p.assistant_message_id))
    return ids == tuple(summary.source_message_ids) and source_hash(block) == summary.source_hash


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


# --------------------------------------------------------------------------- database


# The statements are db's (db.projection_*_query); all run in one snapshot (_snapshot).

#: Called with every projection this process makes. pycompactor.metrics registers its
#: counter when it is imported, so the refusals are counted where they happen (the
#: agent's process) while this module knows nothing of metrics.
_observers: list[Callable[[Projection], None]] = []


def observe(callback: Callable[[Projection], None]) -> None:
    """Call `callback` with every projection made in this process from now on."""
    _observers.append(callback)


#: The driver runs each yielded statement and sends back all its rows as tuples.
Steps = Generator[db.Query, list[tuple[Any, ...]], Plan]


def _first_read(budget: int) -> int:
    """How many of the newest pairs the first read asks for: enough for the budget when a
    pair costs about 1 KiB, in whole ranges, at least two ranges. The walk asks for more
    when it gets past them (rarely: summary blocks cost less than their raw pairs)."""
    wanted = max(2 * PAIRS_PER_RANGE, budget // 1024)
    return min(wanted + (-wanted) % PAIRS_PER_RANGE, _MAX_PAIRS_READ)


def _next_read(given: int, spent: int, budget: int) -> int:
    """How many of the newest pairs to ask for when the walk spent `spent` bytes over the
    `given` newest pairs and needs more: as many as the whole budget would take at the
    rate it was spent, a quarter more, and never fewer than twice as many, in whole
    ranges."""
    wanted = max(2 * given, -(-given * budget * 5 // (4 * max(spent, 1))))
    return min(wanted + (-wanted) % PAIRS_PER_RANGE, _MAX_PAIRS_READ)


def _frame_step(frame: Sequence[Any], budget: int) -> Plan | int | None:
    """What projection_frame's row (its first 11 columns) decides: the plan when the walk
    finished within its pairs; else how many of the newest pairs to read next. Judged
    from the views (the derived state out of use: `derived` false) the frame holds every
    pair, so the walk always finishes. None when the engine gave no frame: a schema
    before revision 0041 without its derived state (the caller judges from the views)."""
    (_derived, count, first, users, assistants, user_sizes, assistant_sizes,
     summary_ids, from_pairs, reasons, sizes) = frame[:11]
    if users is None:
        return None
    if not len(users) == len(assistants) == len(user_sizes) == len(assistant_sizes):
        raise PycompactorError("the engine gave a frame whose pair columns differ in length;"
                               " upgrade pycompactor to the version of the migrations")
    chosen = {f: _Chosen(sid, f, f + PAIRS_PER_RANGE - 1, size)
              for sid, f, reason, size in zip(summary_ids, from_pairs, reasons, sizes,
                                              strict=True)
              if reason is None and size is not None}
    walk = _walk(_Columns(users, assistants, user_sizes, assistant_sizes), first, chosen,
                 budget)
    if not walk.finished:
        return _next_read(count - first, budget - walk.remaining, budget)
    verdicts: Iterable[tuple[int, int, Reason | None]] = zip(
        summary_ids, from_pairs, map(_reason, reasons), strict=True)
    keys = list(zip(from_pairs, summary_ids, strict=True))
    if any(a > b for a, b in pairwise(keys)):
        verdicts = sorted(verdicts, key=lambda v: (v[1], v[0]))
    return _plan(walk, verdicts, budget)


def _projection_steps(conversation_id: str, budget: int, scope: str,
                      wanted: int | None = None) -> Steps:
    """The reads of a projection in a snapshot, driver-free: yields each statement,
    receives its rows, and returns the plan. `project_history` (psycopg.Connection) and
    `aproject_history` (psycopg.AsyncConnection) run the same steps, so both give the
    same projection. They run them when the one statement of `_one_read_query` did not
    give all a plan needs.

    One statement (compaction.projection_frame) gives the newest `wanted` pairs'
    metadata and every summary's verdict; if the walk gets past those pairs, it is asked
    again for as many as the rest of the budget may need (judged from the views, the
    frame holds every pair at once). A schema before revision 0041 gives no frame
    without its derived state: then every pair's and every summary's metadata, judged
    from the views (an application upgraded before its database is migrated keeps
    projecting). No text is read here: the texts the plan includes are read by the
    driver (`_texts_query`).
    """
    wanted = _first_read(budget) if wanted is None else wanted
    while True:
        [frame] = yield db.projection_frame_query(conversation_id, scope, wanted)
        step = _frame_step(frame, budget)
        if isinstance(step, Plan):
            return step
        if step is None:
            break
        wanted = step

    # A schema before revision 0041, judged from the views: every pair, every summary.
    # Plain tuples, then PairMeta._make: one per eligible pair, so per-row cost counts.
    all_pairs = list(map(PairMeta._make, (yield db.projection_pairs_query(conversation_id))))
    # Rows of db.projection_summaries_query; version_rank comes last there. A schema this
    # old has no model preference (revision 0048): model_rank stays 0.
    summaries = [SummaryCandidate(r[0], r[1], r[2], tuple(r[3]), r[4], r[5], r[6], r[10], r[7],
                                  r[8], r[9])
                 for r in (yield db.projection_summaries_query(conversation_id, scope))]
    return plan_projection(all_pairs, summaries, budget)


def _one_read_query(conversation_id: str, budget: int, scope: str) -> db.Query:
    """The usual projection's one statement (compaction.projection_read): the frame of
    the newest pairs and the texts of what the engine's walk of it includes."""
    return db.projection_read_query(conversation_id, scope, _first_read(budget), budget,
                                    _MARKER_BYTES)


#: A plan and the texts it names: message texts by id, summary texts by summary id.
_Read = tuple[Plan, dict[str, str], dict[int, str]]


def _one_read(rows: Sequence[Sequence[Any]], budget: int) -> _Read | int:
    """The plan and its texts from `_one_read_query`'s rows, when they hold every text the
    plan includes; else how many of the newest pairs the reads in a snapshot
    (`_projection_steps`) start from. The driver's walk decides: the engine's walk only
    chose which texts to send, so a text it did not send costs a second read, never a
    different projection."""
    step = _frame_step(rows[0], budget)
    if not isinstance(step, Plan):
        return _first_read(budget) if step is None else step
    message_texts, summary_texts = _texts(rows[1:])
    if (all(m in message_texts for m in step.message_ids)
            and all(s in summary_texts for s in step.summary_ids)):
        return step, message_texts, summary_texts
    return _first_read(budget)


_REASONS: Final[dict[str | None, Reason | None]] = {
    None: None, VERSION_NOT_PROJECTABLE: VERSION_NOT_PROJECTABLE, STALE_SOURCE: STALE_SOURCE,
    SUPERSEDED: SUPERSEDED,
}


def _reason(value: str | None) -> Reason | None:
    """A verdict from projection_frame, checked against the reasons this module knows."""
    try:
        return _REASONS[value]
    except KeyError:
        raise PycompactorError(
            f"the engine gave an unknown summary verdict {value!r}; upgrade pycompactor "
            "to the version of the migrations") from None


def _texts_query(conversation_id: str, plan: Plan) -> db.Query | None:
    """The one statement reading the texts a plan includes (None when it includes none)."""
    if not plan.items:
        return None
    return db.projection_texts_query(conversation_id, plan.message_ids, plan.summary_ids)


def _texts(rows: Iterable[Sequence[Any]]) -> tuple[dict[str, str], dict[int, str]]:
    """Message and summary texts from rows ending in (message_id, summary_id, content):
    db.projection_texts_query's, or projection_read's text rows."""
    message_texts: dict[str, str] = {}
    summary_texts: dict[int, str] = {}
    for row in rows:
        message_id, summary_id, content = row[-3], row[-2], row[-1]
        if message_id is not None:
            message_texts[message_id] = content
        elif summary_id is not None:
            summary_texts[summary_id] = content
    return message_texts, summary_texts


def _finish(plan: Plan, message_texts: Mapping[str, str],
            summary_texts: Mapping[int, str]) -> Projection:
    """Render the plan with the texts read and tell the observers (pycompactor.metrics
    counts the refusals)."""
    projection = render_projection(plan, message_texts, summary_texts)
    for observer in _observers:
        observer(projection)
    return projection


_OPEN = (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


@contextmanager
def _snapshot(conn: psycopg.Connection[Any]) -> Iterator[bool]:
    """One read-only repeatable-read transaction, unless the caller already has one.

    The plan is made from metadata and the texts are read afterwards; one snapshot keeps
    them consistent (render_projection still checks). Inside a caller's transaction its
    own isolation level applies. Transaction-scoped only, so PgBouncer pooling is fine.
    Yields True on an autocommit connection: the reads then open the transaction
    themselves (PROJECTION_BEGIN_SQL travels with the first read, PROJECTION_END_SQL with
    the texts) and pay no round trip for it; it is rolled back here if they fail.
    """
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield False
    elif not conn.autocommit:
        with conn.transaction():
            conn.execute(db.PROJECTION_SNAPSHOT_SQL)
            yield False
    else:
        try:
            yield True
        finally:
            if conn.info.transaction_status in _OPEN:
                with suppress(psycopg.Error):
                    conn.execute(db.PROJECTION_ABORT_SQL)


@asynccontextmanager
async def _asnapshot(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[bool]:
    """`_snapshot` on an async connection."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        yield False
    elif not conn.autocommit:
        async with conn.transaction():
            await conn.execute(db.PROJECTION_SNAPSHOT_SQL)
            yield False
    else:
        try:
            yield True
        finally:
            if conn.info.transaction_status in _OPEN:
                with suppress(psycopg.Error):
                    await conn.execute(db.PROJECTION_ABORT_SQL)


def project_history(
    conn: psycopg.Connection[Any],
    conversation_id: str,
    *,
    budget_bytes: int,
    scope: str = "default",
) -> Projection:
    """History for the next Run of a conversation under a UTF-8 byte budget (contract §9).

    Reads the newest pairs' metadata and every summary's verdict (whether a summary's
    source is current comes from the engine's derived state, or is judged from the
    views while that is out of use), plans, and renders only the texts the plan
    includes: usually one statement (compaction.projection_read, one round trip and one
    snapshot; on an autocommit connection no transaction of its own), text read in
    proportion to the budget, whatever the conversation's length. When that statement
    cannot give all the plan needs (a text the engine's walk did not send), the reads
    run again in one read-only snapshot.
    Every summary gets its reason (a stale one is `stale_source` whatever the budget).
    An unknown conversation gives an empty projection; a negative budget raises UsageError.
    """
    budget = check_budget(budget_bytes)
    db.check_client_encoding(conn)
    with wrap_exceptions():
        read = _read_once(conn, conversation_id, budget, scope)
        if isinstance(read, int):
            read = _read_in_snapshot(conn, conversation_id, budget, scope, read)
    return _finish(*read)


def _read_once(conn: psycopg.Connection[Any], conversation_id: str, budget: int,
               scope: str) -> _Read | int:
    """`_one_read_query` as one statement: its own snapshot on an autocommit connection,
    the caller's transaction inside one, else a transaction of ours closed at once."""
    query = _one_read_query(conversation_id, budget, scope)
    with conn.cursor(row_factory=tuple_row) as cur:
        if conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            cur.execute(*query)
            rows = cur.fetchall()
        else:
            with conn.transaction():
                cur.execute(*query)
                rows = cur.fetchall()
    return _one_read(rows, budget)


def _read_in_snapshot(conn: psycopg.Connection[Any], conversation_id: str, budget: int,
                      scope: str, wanted: int) -> _Read:
    """`_projection_steps` from `wanted` pairs, then the texts, in one snapshot: on an
    autocommit connection two round trips (BEGIN with the first read, COMMIT with the
    texts)."""
    steps = _projection_steps(conversation_id, budget, scope, wanted)
    text_rows: list[tuple[Any, ...]] = []
    with _snapshot(conn) as own, conn.cursor(row_factory=tuple_row) as cur:
        begin = own
        try:
            query = next(steps)
            while True:
                if begin:
                    with conn.pipeline():
                        conn.execute(db.PROJECTION_BEGIN_SQL)
                        cur.execute(*query)
                    begin = False
                else:
                    cur.execute(*query)
                query = steps.send(cur.fetchall())
        except StopIteration as done:
            plan: Plan = done.value
        texts = _texts_query(conversation_id, plan)
        if own:
            with conn.pipeline():
                if texts is not None:
                    cur.execute(*texts)
                conn.execute(db.PROJECTION_END_SQL)
        elif texts is not None:
            cur.execute(*texts)
        if texts is not None:
            text_rows = cur.fetchall()
    return (plan, *_texts(text_rows))


async def aproject_history(
    conn: psycopg.AsyncConnection[Any],
    conversation_id: str,
    *,
    budget_bytes: int,
    scope: str = "default",
) -> Projection:
    """`project_history` on a `psycopg.AsyncConnection`: the same statements, in one
    statement or in the same read-only snapshot, the same plan and rendering, so the
    same projection."""
    budget = check_budget(budget_bytes)
    db.check_client_encoding(conn)
    with wrap_exceptions():
        read = await _aread_once(conn, conversation_id, budget, scope)
        if isinstance(read, int):
            read = await _aread_in_snapshot(conn, conversation_id, budget, scope, read)
    return _finish(*read)


async def _aread_once(conn: psycopg.AsyncConnection[Any], conversation_id: str,
                      budget: int, scope: str) -> _Read | int:
    """`_read_once` on an async connection."""
    query = _one_read_query(conversation_id, budget, scope)
    async with conn.cursor(row_factory=tuple_row) as cur:
        if conn.autocommit or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            await cur.execute(*query)
            rows = await cur.fetchall()
        else:
            async with conn.transaction():
                await cur.execute(*query)
                rows = await cur.fetchall()
    return _one_read(rows, budget)


async def _aread_in_snapshot(conn: psycopg.AsyncConnection[Any], conversation_id: str,
                             budget: int, scope: str, wanted: int) -> _Read:
    """`_read_in_snapshot` on an async connection."""
    steps = _projection_steps(conversation_id, budget, scope, wanted)
    text_rows: list[tuple[Any, ...]] = []
    async with _asnapshot(conn) as own, conn.cursor(row_factory=tuple_row) as cur:
        begin = own
        try:
            query = next(steps)
            while True:
                if begin:
                    async with conn.pipeline():
                        await conn.execute(db.PROJECTION_BEGIN_SQL)
                        await cur.execute(*query)
                    begin = False
                else:
                    await cur.execute(*query)
                query = steps.send(await cur.fetchall())
        except StopIteration as done:
            plan: Plan = done.value
        texts = _texts_query(conversation_id, plan)
        if own:
            async with conn.pipeline():
                if texts is not None:
                    await cur.execute(*texts)
                await conn.execute(db.PROJECTION_END_SQL)
        elif texts is not None:
            await cur.execute(*texts)
        if texts is not None:
            text_rows = await cur.fetchall()
    return (plan, *_texts(text_rows))
