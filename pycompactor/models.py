"""Typed results of the engine's functions (frozen dataclasses, never raw tuples)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID


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
class WorkerTarget:
    """A target of plan_targets, and whether its identity (scope, model, prompt version)
    already holds a completed summary (compaction.worker_targets)."""

    from_pair: int
    to_pair: int
    source_message_ids: list[str]
    source_hash: str
    completed: bool


@dataclass(frozen=True, slots=True)
class RangeReply:
    """One assistant reply of a claimed range (compaction.range_replies): what the model
    summarizes, labelled with its message id."""

    pair_index: int
    assistant_message_id: str
    assistant_content: str


@dataclass(frozen=True, slots=True)
class RunVerdict:
    """Whether one run forms a pair and, if not, the first eligibility rule it breaks."""

    run_id: str
    run_status: str | None
    eligible: bool
    reason: str | None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """Answer of compaction.claim: claimed with a lease, or the first refusal reason.

    job_id is set for refusals about an existing identity (already_completed,
    already_running, attempts_exhausted); attempt and lease_expires_at only when claimed.
    """

    claimed: bool
    reason: str
    job_id: int | None
    attempt: int | None
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class RangeClaim:
    """One range's answer from compaction.claim_targets: what compaction.claim would have
    answered for that range (see ClaimResult), with the range it answers."""

    from_pair: int
    claimed: bool
    reason: str
    job_id: int | None
    attempt: int | None
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class NextTarget:
    """One target from compaction.claim_next_targets: the range (as worker_targets gives
    it) and, for a range the call tried to claim, what compaction.claim would have
    answered (claimed None: not tried, left for claim_targets)."""

    from_pair: int
    to_pair: int
    source_message_ids: list[str]
    source_hash: str
    completed: bool
    claimed: bool | None
    reason: str | None
    job_id: int | None
    attempt: int | None
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class CompleteResult:
    """Answer of compaction.complete: 'completed' with the summary id, or why not."""

    ok: bool
    reason: str
    summary_id: int | None


@dataclass(frozen=True, slots=True)
class FailResult:
    """Answer of compaction.fail: 'failed', or 'lease_lost' when fenced off."""

    ok: bool
    reason: str


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    """Answer of compaction.heartbeat: the renewed lease, or ok=False (lease lost)."""

    ok: bool
    lease_expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class QueuedConversation:
    """One queue entry (conversation, scope) leased by compaction.dequeue.

    The entry stays in the queue, hidden until `lease_expires_at`; `lease_token` names
    this lease for compaction.ack (examined) or compaction.release (not examined).
    """

    conversation_id: str
    scope: str
    enqueued_at: datetime
    lease_token: UUID
    lease_expires_at: datetime


@dataclass(frozen=True, slots=True)
class AckResult:
    """Answer of compaction.ack / compaction.release.

    ack: 'acknowledged' (removed), 'requeued' (an enqueue landed during the lease: the
    entry waits again); release: 'released'; either: ok=False 'lease_lost' (the lease
    expired and another worker took the entry, or the entry is gone).
    """

    ok: bool
    reason: str


@dataclass(frozen=True, slots=True)
class AuditReport:
    """Rows of one audit view (metadata only), newest first, as column -> value mappings."""

    view: str
    columns: list[str]
    rows: list[dict[str, Any]]


class AssistantReply(Protocol):
    """What the request reads from a pair (pycompactor.models.Pair has it).

    Only these two attributes are read: user text cannot reach the model through here.
    """

    @property
    def assistant_message_id(self) -> str: ...
    @property
    def assistant_content(self) -> str: ...
