"""What the worker is configured with and reports: its failure reasons, the timing of
its loop, `WorkerConfig`, the claimed job and its result, and the totals
(`WorkerReport`). Shared by `pycompactor.worker.process` and
`pycompactor.worker.claim`."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final, ParamSpec, TypeVar

from pycompactor import db
from pycompactor.quality.figures import (
    MAX_INVENTED_FIGURES_BOUND,
    FigureStats,
)
from pycompactor.summarizers.openai_compatible import (
    DEFAULT_TIMEOUT_SECONDS,
)
from pycompactor.worker.eventlog import LogFormat

#: Failure reason when the shutdown drain ran out before the model answered.
INTERRUPTED: Final = "interrupted"
#: Failure reason when the summarizer raised instead of returning an outcome (a bug).
WORKER_ERROR: Final = "worker_error"
#: Failure reason when the claimed range changed before its replies were read: no model
#: call is made (the identity's hash no longer matches the source).
SOURCE_MOVED: Final = "source_moved"
#: Failure reason when the database could not give the claimed range's replies (a
#: timeout, or the connection broke); a later pass retries.
SOURCE_UNREADABLE: Final = "source_unreadable"
#: Failure reason when a summary kept fewer than --min-figure-retention of the figures.
FIGURES_LOST: Final = "figures_lost"
#: Failure reason when a summary states more figures that no reply holds than
#: --max-invented-figures allows (contract §8; the default allows none).
FIGURES_INVENTED: Final = "figures_invented"

# Claim refusals after which the conversation may become claimable later: put it back.
# Not already_running: that attempt's worker completes it, or the reaper expires it and
# re-queues the conversation.
_RETRY_LATER: Final = frozenset({"admission_full", "not_eligible", "source_mismatch"})
# Granularity of the main thread's waits: how fast it notices a signal or a free slot.
_TICK: Final = 0.05
_IDLE_START_SECONDS: Final = 0.05
# How many conversations (the first, in id order) the idle hint looks at: a bounded look,
# once per run, so an idle worker never scans the source.
_HINT_PROBE_CONVERSATIONS: Final = 20
_DB_BACKOFF_START: Final = 0.5
_DB_BACKOFF_MAX: Final = 30.0

Params = ParamSpec("Params")
Result = TypeVar("Result")


def default_worker_id() -> str:
    """host:pid:uuid, unique per process, readable in the attempt log."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything `pycompactor worker` was told; the model string is the job's `model`."""

    model: str
    dsn: str | None = None
    scope: str = "default"
    once: bool = False
    conversation: str | None = None
    sweep: bool = False
    concurrency: int = 4
    lease: timedelta = db.DEFAULT_LEASE
    poll_seconds: float = 5.0
    drain_seconds: float = 30.0
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    log_format: LogFormat = "text"
    #: Conversations taken from the queue (or a sweep page) per statement.
    batch_size: int = 100
    worker_id: str = field(default_factory=default_worker_id)
    #: lock_timeout / statement_timeout of every database call (a hung session's lock
    #: costs one timeout and that target is left for a later pass).
    timeouts: db.Timeouts = db.DEFAULT_TIMEOUTS
    #: --min-figure-retention: a summary keeping fewer than this share of its range's
    #: figures fails with `figures_lost` (0, the default, turns the gate off).
    min_figure_retention: float = 0.0
    #: --max-invented-figures: a summary stating more than this many distinct figures
    #: that none of its ten replies holds fails with `figures_invented` (default 0).
    max_invented_figures: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a worker needs a model")
        if not 0.0 <= self.min_figure_retention <= 1.0:
            raise ValueError("min_figure_retention must lie between 0 and 1")
        if isinstance(self.max_invented_figures, bool) \
                or not isinstance(self.max_invented_figures, int) \
                or not 0 <= self.max_invented_figures <= MAX_INVENTED_FIGURES_BOUND:
            raise ValueError("max_invented_figures must be a whole number from 0 to "
                             f"{MAX_INVENTED_FIGURES_BOUND}")
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("concurrency and batch_size must be at least 1")
        if self.concurrency > 10_000:
            # compaction.settings.max_running admits at most 10,000 across all workers.
            raise ValueError("concurrency must be at most 10000")
        low, high = db.LEASE_BOUNDS
        if not low <= self.lease <= high:
            raise ValueError("the lease must lie between 1 second and 1 day")
        if self.conversation is not None and self.sweep:
            raise ValueError("--conversation and --sweep exclude each other")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A target not yet summarized under this worker's identity; the claim binds these."""

    conversation_id: str
    from_pair: int
    source_message_ids: list[str]
    source_hash: str


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """One claimed attempt; (job_id, attempt) is the fencing token, source_hash what the
    claim bound (the replies are read only while the range still has it)."""

    conversation_id: str
    scope: str
    from_pair: int
    job_id: int
    attempt: int
    source_hash: str


@dataclass(frozen=True, slots=True)
class JobResult:
    """How one claimed attempt ended, as far as this worker knows.

    outcome: `completed`; `failed` (reason from the database or the summarizer);
    `lease_lost` (the fence refused us: reaped, or recorded by someone else);
    `interrupted` (shutdown drain ran out); `result_lost` (the database stayed
    unreachable: the reaper will expire the attempt).
    """

    job: ClaimedJob
    outcome: str
    reason: str
    summary_id: int | None
    latency_ms: int


@dataclass(frozen=True, slots=True)
class Figures:
    """A reply's figures (contract §8): kept of the replies' (stats), and how many
    distinct figures it states that no reply holds (invented)."""

    stats: FigureStats
    invented: int


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """Totals of a worker run (what `stopped` logs)."""

    passes: int
    claimed: int
    refused: dict[str, int]
    outcomes: dict[str, int]
