"""The vocabulary of a projection (contract §9): its constants and marker line, the
inputs the core plans from (`PairMeta`, summary bindings and candidates), and the
outputs (`Manifest`, `Rejections`, `Plan`, `Projection`), shared by the planning in
`pycompactor.projection_plan` and the reading in `pycompactor.projection`."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import (
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, NamedTuple, Protocol, TypedDict, TypeVar, overload

from pycompactor.errors import PycompactorError
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
