"""Prometheus metrics of pycompactor, and the HTTP endpoint that serves them.

This module owns every metric's name, help text and labels, the mapping of reasons onto
bounded label values, and `serve` (what `pycompactor worker --metrics-port` starts).

The metrics live in prometheus_client's default registry, process-wide, because they
come from two kinds of process: the worker counts claims, attempts and model latency;
`project_history` runs in the *agent's* process and counts the summaries it refused.
An agent that already exposes Prometheus metrics (its web framework's /metrics, or
`prometheus_client.start_http_server`) therefore shows pycompactor's projection counters
with no extra setup, and the worker's endpoint shows the worker's.

Queue depth: the worker role may only call `compaction.dequeue` (it cannot read
`compaction.queue`, and no counting function exists), so the worker reports what it
observes: how many entries its last dequeue returned (a full batch means more are
waiting; 0 means the queue was empty then), how many it has taken in total, and how long
the oldest entry it last leased had waited (dequeue leases the oldest waiting entries of
its scope first, so this is the age of the head of its scope's queue then; 0 when the
queue was empty). The auditor reads the exact figures per scope from
`compaction.audit_queue` (`pycompactor audit --view queue`, docs/operations.md).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from pycompactor import projection as _projection
from pycompactor.projection import Projection

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from pycompactor.quality.figures import FigureStats

ATTEMPTS: Final = Counter(
    "pycompactor_worker_attempts",
    "Claimed attempts by how they ended: outcome completed | failed | lease_lost | "
    "interrupted | result_lost, reason as recorded (completed, not_stopped, tool_calls, "
    "empty, too_long, refusal, timeout, http_<status>, ...)",
    ["outcome", "reason"],
)
CLAIMS: Final = Counter("pycompactor_worker_claims", "Attempts this worker claimed")
CLAIMS_REFUSED: Final = Counter(
    "pycompactor_worker_claims_refused",
    "Claims the database refused, by reason (already_completed, already_running, "
    "attempts_exhausted, admission_full, not_eligible, source_mismatch, ...)",
    ["reason"],
)
TARGETS_SKIPPED: Final = Counter(
    "pycompactor_worker_targets_skipped",
    "Targets this worker did not claim in a pass, by reason (already_completed: the "
    "identity holds a completed summary; lock_timeout, statement_timeout)",
    ["reason"],
)
MODEL_CALL_SECONDS: Final = Histogram(
    "pycompactor_worker_model_call_seconds",
    "Duration of one model call (the summarizer, transport retry included), by model",
    ["model"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
)
QUEUE_LAST_DEQUEUE: Final = Gauge(
    "pycompactor_worker_queue_last_dequeue",
    "Entries the last compaction.dequeue returned (equal to the batch size: more are "
    "waiting; 0: the queue was empty). The worker role cannot count compaction.queue",
)
QUEUE_OLDEST_AGE: Final = Gauge(
    "pycompactor_worker_queue_oldest_age_seconds",
    "How long the oldest entry the last compaction.dequeue leased had waited in the queue "
    "(server clock; the head of this worker's scope; 0 when the queue was empty)",
)
QUEUE_DEQUEUED: Final = Counter(
    "pycompactor_worker_queue_dequeued",
    "Queue entries (conversation, scope) this worker took with compaction.dequeue",
)
FIGURE_RETENTION: Final = Histogram(
    "pycompactor_worker_figure_retention_ratio",
    "Share of a range's distinct figures (numbers, dates, amounts) that its summary kept "
    "verbatim, one observation per model reply on a range with figures (contract §8)",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
)
FIGURES_LOST: Final = Counter(
    "pycompactor_worker_figures_lost",
    "Attempts failed with reason figures_lost: the summary kept fewer figures than "
    "--min-figure-retention asks",
)
FIGURES_INVENTED: Final = Counter(
    "pycompactor_worker_figures_invented",
    "Attempts failed with reason figures_invented: the summary stated more figures that "
    "none of its ten replies holds than --max-invented-figures allows (default 0)",
)
PROJECTIONS: Final = Counter(
    "pycompactor_projections", "project_history calls that returned a projection")
PROJECTION_REJECTED: Final = Counter(
    "pycompactor_projection_summaries_rejected",
    "Stored summaries a projection left out, by reason (version_not_projectable, "
    "stale_source, superseded, did_not_fit)",
    ["reason"],
)

# Label values must stay few: reasons are short snake_case words (http_503 included);
# anything else (an exception message) is folded into `other`.
_LABEL: Final = re.compile(r"[a-z][a-z0-9_]{0,39}")


def _label(reason: str) -> str:
    return reason if _LABEL.fullmatch(reason) else "other"


def attempt_finished(outcome: str, reason: str) -> None:
    ATTEMPTS.labels(outcome=_label(outcome),
                    reason=outcome if outcome == "result_lost" else _label(reason)).inc()


def claim_refused(reason: str) -> None:
    CLAIMS_REFUSED.labels(reason=_label(reason)).inc()


def target_skipped(reason: str) -> None:
    TARGETS_SKIPPED.labels(reason=_label(reason)).inc()


def claimed() -> None:
    CLAIMS.inc()


@contextmanager
def model_call(model: str) -> Iterator[None]:
    """Time one model call (observed even when the summarizer raises)."""
    with MODEL_CALL_SECONDS.labels(model=model).time():
        yield


def figures_counted(figures: FigureStats) -> None:
    """Observe one reply's retention ratio (ranges without figures have none)."""
    if figures.retention is not None:
        FIGURE_RETENTION.observe(figures.retention)


def figures_lost() -> None:
    FIGURES_LOST.inc()


def figures_invented() -> None:
    FIGURES_INVENTED.inc()


def dequeued(count: int, oldest_age_seconds: float = 0.0) -> None:
    QUEUE_LAST_DEQUEUE.set(count)
    QUEUE_DEQUEUED.inc(count)
    QUEUE_OLDEST_AGE.set(max(0.0, oldest_age_seconds))


def projected(projection: Projection) -> None:
    """Count one projection and the summaries it refused (observing project_history)."""
    PROJECTIONS.inc()
    # One labels() per reason, not per summary: a long conversation has many.
    for reason, count in projection.rejected_summaries.reason_counts().items():
        PROJECTION_REJECTED.labels(reason=reason).inc(count)


_projection.observe(projected)


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running /metrics endpoint; `port` is the bound one (useful with port 0)."""

    address: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(port: int, address: str = "127.0.0.1") -> MetricsServer:
    """Serve the default registry over HTTP (any path) on a daemon thread."""
    server, thread = start_http_server(port, addr=address, registry=REGISTRY)
    return MetricsServer(address, int(server.server_port), server, thread)
