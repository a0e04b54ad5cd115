"""A job's prompt version is held to the known versions without a lock.

A foreign key to compaction.prompt_versions would lock the version's row FOR KEY SHARE
at every claim: every concurrent claim would lock the same row, each overlap making a
MultiXact. So the CHECK jobs_rules holds the version to the versions job_rules_hold
writes out, and raises the foreign key's error (jobs_prompt_version_fkey) for any other.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from pycompactor import db
from pycompactor.models import ClaimResult
from tests.history import History
from tests.sql.engine import MODEL, V3, scalar

Conn = psycopg.Connection[Any]

JOB = """
INSERT INTO compaction.jobs (conversation_id, scope, from_pair, to_pair, source_message_ids,
                             source_hash, model, prompt_version, created_at)
VALUES ('c1', 'default', 10, 19, %(ids)s, %(hash)s, 'm', %(version)s, now())
"""
IDS = [f"m{i}" for i in range(20)]
RULES = ("SELECT compaction.job_rules_hold(0, 9, %(ids)s, %(hash)s, 'default', 'm',"
         " %(version)s)")


def test_the_rules_accept_exactly_the_table_s_versions(conn: Conn) -> None:
    """A migration that adds a version must add it to job_rules_hold too: every version of
    prompt_versions passes, and a name one character away from each does not."""
    table = [v for (v,) in conn.execute(
        "SELECT prompt_version FROM compaction.prompt_versions ORDER BY 1").fetchall()]
    assert table == ["conversation-compaction@1", "conversation-compaction@2", V3]
    for version in table:
        assert scalar(conn, RULES, {"ids": IDS, "hash": "a" * 64, "version": version}) is True
        for near in (version + "0", version[:-1], version.upper()):
            with pytest.raises(psycopg.errors.ForeignKeyViolation):
                conn.execute(RULES, {"ids": IDS, "hash": "a" * 64, "version": near})
            conn.rollback()


@pytest.mark.parametrize("replication_role", ["origin", "replica"])
def test_a_job_of_an_unknown_version_is_a_foreign_key_violation(
        conn: Conn, replication_role: str) -> None:
    """The error a direct write gets is a foreign key's, name and SQLSTATE; and unlike a
    foreign key, whose triggers a replica session skips, the CHECK holds there too."""
    conn.execute("SELECT pg_catalog.set_config('session_replication_role', %s, false)",
                 (replication_role,))
    with pytest.raises(psycopg.errors.ForeignKeyViolation) as info:
        conn.execute(JOB, {"ids": IDS, "hash": "a" * 64,
                           "version": "conversation-compaction@4"})
    assert info.value.diag.constraint_name == "jobs_prompt_version_fkey"
    assert info.value.diag.table_name == "jobs"
    assert info.value.diag.message_detail == (
        'Key (prompt_version)=(conversation-compaction@4) is not present in table'
        ' "prompt_versions".')
    # The hint says where a version must be added: a job naming a version that was
    # inserted into prompt_versions by hand, against the contract, gets this error too.
    assert info.value.diag.message_hint == (
        "A prompt version is added by a migration, which writes it into"
        " compaction.job_rules_hold too.")
    conn.rollback()
    # A broken rule of the row itself is named first, as the CHECKs ran before the key.
    with pytest.raises(psycopg.errors.CheckViolation) as broken:
        conn.execute(JOB, {"ids": IDS, "hash": "x", "version": "conversation-compaction@4"})
    assert broken.value.diag.constraint_name == "jobs_source_hash_valid"
    conn.rollback()
    for version in ("conversation-compaction@1", "conversation-compaction@2", V3):
        conn.execute(JOB.replace("10, 19", "0, 9"), {"ids": IDS, "hash": version[-1] * 64,
                                                       "version": version})
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 3


def test_concurrent_claims_leave_the_version_row_unlocked(dsn: str) -> None:
    """Eight claims held open at once, each on its own conversation: each is admitted, and
    the version's row carries no locker (under a foreign key its xmax names a MultiXact of them)."""
    n = 8
    with psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute("UPDATE compaction.settings SET max_running = %s", (n,))
        history = History(setup)
        for k in range(n):
            history.pairs(f"c{k}", 30)
        targets = [db.plan_targets(setup, f"c{k}")[0] for k in range(n)]
    claimed = threading.Barrier(n + 1)
    checked = threading.Barrier(n + 1)
    answers: dict[int, ClaimResult] = {}
    errors: list[BaseException] = []

    def hold(k: int) -> None:
        try:
            with psycopg.connect(dsn) as tx:  # the claim's transaction stays open
                t = targets[k]
                answers[k] = db.claim(tx, f"c{k}", "default", t.from_pair,
                                      t.source_message_ids, t.source_hash, MODEL, V3,
                                      f"w{k}")
                claimed.wait(timeout=60)
                checked.wait(timeout=60)
                tx.commit()
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)
            claimed.abort()
            checked.abort()

    threads = [threading.Thread(target=hold, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    try:
        claimed.wait(timeout=60)
        with psycopg.connect(dsn, autocommit=True) as observer:
            open_claims = scalar(observer, "SELECT count(*) FROM pg_catalog.pg_stat_activity"
                                 " WHERE datname = current_database()"
                                 " AND state = 'idle in transaction'")
            xmax = scalar(observer, "SELECT xmax::text FROM compaction.prompt_versions"
                          " WHERE prompt_version = %s", (V3,))
        checked.wait(timeout=60)
    finally:
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    assert open_claims == n
    assert xmax == "0"
    assert [answers[k].reason for k in range(n)] == ["claimed"] * n
    with psycopg.connect(dsn, autocommit=True) as after:
        assert scalar(after, "SELECT count(*) FROM compaction.attempts"
                      " WHERE state = 'running'") == n
        assert scalar(after, "SELECT xmax::text FROM compaction.prompt_versions"
                      " WHERE prompt_version = %s", (V3,)) == "0"
