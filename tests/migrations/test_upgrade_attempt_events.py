"""The event log derived from the attempts' rows (0027_attempt_events, issue 32) answers
every audit view with the same rows as the table it replaces.

One mixed history (completions, failures, an exhausted identity, lease expiries found by
reap and by a late completion, a refused reply, a renewal, an import, an erasure, an
attempt left running, a stale summary) is replayed on two databases: `old` at 0026,
where every event was a row of compaction.audit_events, and `new` at head.

* Upgrading `old` in place changes no row of any audit view, to the microsecond and the
  transaction id: every event written before stays as it was.
* Replayed on both, the same history reads the same in every audit view. Two columns of
  the log differ between two databases by nature, the clock when an event was written
  (recorded_at) and the writing transaction (xact_id); for them the test compares the
  log's order, (recorded_at, event_id), event for event.
* Downgrading keeps every event, those the attempts recorded included.
"""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from pycompactor import schema
from tests.migrations.audit_replay import (
    assert_same,
    pinned_and_head,
    replay_first,
    replay_second,
    views,
)

BEFORE = "0026_hot_admission"


@pytest.fixture
def databases(new_database: Callable[..., str]) -> tuple[str, str]:
    return pinned_and_head(new_database, BEFORE)


def test_the_views_answer_the_same_rows_before_and_after(databases: tuple[str, str]) -> None:
    old_dsn, new_dsn = databases
    with psycopg.connect(old_dsn, autocommit=True) as old, \
            psycopg.connect(new_dsn, autocommit=True) as new:
        replay_first(old)
        replay_first(new)
        before = views(old, exact=True)
        events = before["audit_events"]
        assert {e["kind"] for e in events} == {"claim", "completion", "failure",
                                               "lease_expiry", "import", "erasure"}
        assert len(events) == 19
        assert_same(views(new, exact=False), views(old, exact=False))
        # the new database writes no event row for an attempt (f's, erased, aside)
        assert new.execute("SELECT count(*) FROM compaction.event_log"
                           " WHERE kind NOT IN ('import', 'erasure')"
                           "   AND conversation_id <> 'f'").fetchone() == (0,)

        schema.upgrade(old_dsn)
        assert_same(views(old, exact=True), before)

        replay_second(old)
        replay_second(new)
        after = views(old, exact=False)
        assert_same(after, views(new, exact=False))
        # g's completion, h's second claim, a's second range claimed and completed, a's
        # tombstone
        assert len(after["audit_events"]) == 19 + 5
        # the attempts of old that ran across the upgrade: g's claim is in event_log, its
        # completion is recorded by its row
        assert old.execute("SELECT count(*) FROM compaction.event_log"
                           " WHERE conversation_id = 'g'").fetchone() == (1,)
        full = views(old, exact=True)

    schema.downgrade(old_dsn, BEFORE)
    with psycopg.connect(old_dsn, autocommit=True) as old:
        assert_same(views(old, exact=True), full)
    schema.upgrade(old_dsn)
    with psycopg.connect(old_dsn, autocommit=True) as old:
        assert_same(views(old, exact=True), full)
