"""Typed results of the engine's read functions (frozen dataclasses, never raw tuples)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pair:
    """One eligible pair: the user message and completed assistant message of one Run."""

    pair_index: int
    run_id: str
    user_message_id: str
    user_content: str
    assistant_message_id: str
    assistant_content: str


@dataclass(frozen=True, slots=True)
class Target:
    """A range of 10 pairs the window policy makes a compaction target now."""

    from_pair: int
    to_pair: int
    source_message_ids: list[str]
    source_hash: str


@dataclass(frozen=True, slots=True)
class RunVerdict:
    """Whether one run forms a pair and, if not, the first eligibility rule it breaks."""

    run_id: str
    run_status: str | None
    eligible: bool
    reason: str | None
