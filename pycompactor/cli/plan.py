"""Where each compaction target stands, for `pycompactor plan`.

A target's state comes from read-only SQL: its summaries from
`compaction.projection_summaries` (which compaction_reader may run), its attempts from
`compaction.audit_jobs` when the role may read that view (the auditor, the owner, a
superuser). A reader cannot see attempts, so what it cannot tell apart is
`not_summarized` rather than a guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pycompactor import db
from pycompactor.models import Target

#: A completed summary of the range's current source, projectable: nothing left to do.
SUMMARIZED: Final = "summarized"
#: An attempt on the current source holds a lease now.
RUNNING: Final = "running"
#: An attempt on the current source failed; a later pass retries it once.
FAILED: Final = "failed"
#: Two attempts on the current source failed: claims refuse it (`attempts_exhausted`).
EXHAUSTED: Final = "exhausted"
#: Summaries of the range exist, but its source changed since: a worker summarizes it anew.
STALE: Final = "stale"
#: Nothing yet: no summary, no attempt.
PENDING: Final = "pending"
#: No summary, and this role may not read attempts (running, failed, exhausted, pending).
NOT_SUMMARIZED: Final = "not_summarized"


@dataclass(frozen=True, slots=True)
class PlannedTarget:
    target: Target
    state: str


def target_states(conn: db.Connection, conversation_id: str, scope: str,
                  targets: Sequence[Target]) -> tuple[list[PlannedTarget], bool]:
    """Each target with its state, and whether attempts were readable (without them the
    states are summarized, stale or not_summarized only)."""
    if not targets:
        return [], True
    current: set[int] = set()
    summarized: set[int] = set()
    for from_pair, source_current, projectable in db.summary_bindings(
            conn, conversation_id, scope):
        summarized.add(from_pair)
        if source_current and projectable:
            current.add(from_pair)
    attempts_visible = db.may_read_attempts(conn)
    attempts: dict[tuple[int, str], list[tuple[int, str]]] = {}
    if attempts_visible:
        for from_pair, source_hash, attempt, state in db.range_attempts(
                conn, conversation_id, scope):
            attempts.setdefault((from_pair, source_hash), []).append((attempt, state))
    planned = []
    for target in targets:
        tried = attempts.get((target.from_pair, target.source_hash), [])
        states = {state for _, state in tried}
        if target.from_pair in current:
            state = SUMMARIZED
        elif "running" in states:
            state = RUNNING
        elif (2, "failed") in tried:
            state = EXHAUSTED
        elif "failed" in states:
            state = FAILED
        elif target.from_pair in summarized:
            state = STALE
        else:
            state = PENDING if attempts_visible else NOT_SUMMARIZED
        planned.append(PlannedTarget(target, state))
    return planned, attempts_visible
