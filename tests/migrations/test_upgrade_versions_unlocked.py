"""0046_versions_known_without_lock on a populated database (issue 32): the upgrade and the
downgrade keep every job, every event and every audit answer.

The mixed history of tests/migrations/audit_replay.py is replayed at 0045 and at head.
Upgrading the 0045 database changes no row of any audit view and no job; replayed further,
both databases answer alike; the downgrade puts the foreign key back (valid: every job
names a known version) and changes nothing either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

Conn = psycopg.Connection[Any]

BEFORE = "0045_lighter_claim_cycle"
FOREIGN_KEY = ("SELECT convalidated FROM pg_catalog.pg_constraint"
               " WHERE conname = 'jobs_prompt_version_fkey'"
               "   AND conrelid = 'compaction.jobs'::regclass")


def jobs(conn: Conn) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT * FROM compaction.jobs ORDER BY conversation_id, job_id"
                        ).fetchall()


@pytest.fixture
def databases(new_database: Callable[..., str]) -> tuple[str, str]:
    return pinned_and_head(new_database, BEFORE)


def test_the_upgrade_and_downgrade_keep_every_job_and_event(
        databases: tuple[str, str]) -> None:
    old_dsn, new_dsn = databases
    with psycopg.connect(old_dsn, autocommit=True) as old, \
            psycopg.connect(new_dsn, autocommit=True) as new:
        replay_first(old)
        replay_first(new)
        assert old.execute(FOREIGN_KEY).fetchall() == [(True,)]
        before, before_jobs = views(old, exact=True), jobs(old)
        assert len(before["audit_events"]) == 19
        assert len(before_jobs) == 7  # f's erased

        schema.upgrade(old_dsn)
        assert old.execute(FOREIGN_KEY).fetchall() == []
        assert_same(views(old, exact=True), before)
        assert jobs(old) == before_jobs
        assert_same(views(old, exact=False), views(new, exact=False))

        replay_second(old)
        replay_second(new)
        after = views(old, exact=False)
        assert_same(after, views(new, exact=False))
        assert len(after["audit_events"]) == 19 + 5
        full, full_jobs = views(old, exact=True), jobs(old)

    schema.downgrade(old_dsn, BEFORE)
    with psycopg.connect(old_dsn, autocommit=True) as old:
        assert old.execute(FOREIGN_KEY).fetchall() == [(True,)]
        assert_same(views(old, exact=True), full)
        assert jobs(old) == full_jobs
    schema.upgrade(old_dsn)
    with psycopg.connect(old_dsn, autocommit=True) as old:
        assert_same(views(old, exact=True), full)
        assert jobs(old) == full_jobs
