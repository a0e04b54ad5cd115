"""§7/§11 immutability: completed summaries, identities, terminal attempts and the event
log refuse UPDATE, DELETE and TRUNCATE for the owner, a superuser and under replica."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.sql.engine import GOOD, T0, claim, target

Conn = psycopg.Connection[Any]

ENGINE_TABLES = ["jobs", "attempts", "job_summaries", "event_log", "admission", "queue",
                 "settings", "prompt_versions"]
# The event log is a view over the attempts and event_log.
LOG_VIEW = "audit_events"
# The derived state (a cache of the source) is guarded against TRUNCATE as well.
DERIVED_TABLES = ["conversation_state", "pairs", "ranges", "summary_verdicts", "source_tracking",
                  "foreign_messages"]
# And the conversations' lock rows: emptied, reap would pass them over.
LOCK_TABLES = ["conversation_locks"]


def snapshot(conn: Conn) -> dict[str, list[Any]]:
    return {
        table: conn.execute(f"SELECT * FROM compaction.{table} ORDER BY 1, 2").fetchall()
        for table in [*ENGINE_TABLES, LOG_VIEW]
    }


@pytest.fixture
def engine_state(conn: Conn) -> Conn:
    """c1: a completed summary; c2: a failed attempt; c3: a running attempt."""
    for conversation_id in ("c1", "c2", "c3"):
        t = target(conn, conversation_id)
        c = claim(conn, conversation_id, t)
        assert c.job_id is not None
        if conversation_id == "c1":
            assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
        elif conversation_id == "c2":
            assert db.fail(conn, c.job_id, 1, "http_error", now=T0).ok
    return conn


@pytest.fixture(params=["owner", "superuser", "replica"])
def actor(request: pytest.FixtureRequest, engine_state: Conn) -> Iterator[Conn]:
    conn = engine_state
    if request.param == "owner":
        conn.execute("SET ROLE compaction_owner")
    elif request.param == "replica":
        conn.execute("SET session_replication_role = replica")
    yield conn
    conn.execute("RESET ROLE")
    conn.execute("RESET session_replication_role")


def refused(conn: Conn, statement: str, sqlstates: tuple[str, ...]) -> None:
    with pytest.raises(psycopg.Error) as info:
        conn.execute(statement)
    assert info.value.sqlstate in sqlstates, (statement, info.value.sqlstate, str(info.value))


IMMUTABLE = ("CP010",)
APPEND_ONLY = ("CP011",)
#: A view over a UNION is not updatable, in every session (replica included).
NOT_UPDATABLE = ("55000",)


def test_completed_summary_and_identity_never_change(actor: Conn) -> None:
    conn = actor
    role = conn.execute("SELECT current_user, current_setting('session_replication_role')"
                        ).fetchone()
    before = snapshot(conn)
    for statement in [
        "UPDATE compaction.job_summaries SET summary = 'rewritten'",
        "UPDATE compaction.job_summaries SET completed_at = completed_at + interval '1 day'",
        "DELETE FROM compaction.job_summaries",
        "UPDATE compaction.jobs SET model = 'other' WHERE conversation_id = 'c1'",
        "UPDATE compaction.jobs SET source_hash = repeat('0', 64) WHERE conversation_id = 'c1'",
        "UPDATE compaction.jobs SET source_message_ids[1] = 'x' WHERE conversation_id = 'c1'",
        "DELETE FROM compaction.jobs WHERE conversation_id = 'c1'",
    ]:
        refused(conn, statement, IMMUTABLE)
    # identities without a summary never change either (the guard reads only
    # its own row, so it does not tell the two apart)
    refused(conn, "UPDATE compaction.jobs SET model = 'other' WHERE conversation_id = 'c2'",
            IMMUTABLE)
    refused(conn, "DELETE FROM compaction.jobs WHERE conversation_id = 'c3'", IMMUTABLE)
    # the owner lacks the TRUNCATE privilege; everyone else meets the trigger
    truncate_states = ("CP012", "42501") if role == ("compaction_owner", "origin") \
        else ("CP012",)
    for table in ENGINE_TABLES:
        refused(conn, f"TRUNCATE compaction.{table} CASCADE", truncate_states)
    refused(conn, f"TRUNCATE compaction.{LOG_VIEW}", ("42809",))  # not a table
    assert snapshot(conn) == before


def test_attempt_log_is_append_only(actor: Conn) -> None:
    conn = actor
    before = snapshot(conn)
    for statement in [
        # terminal attempts are frozen
        "UPDATE compaction.attempts SET reason = 'other' WHERE conversation_id = 'c2'",
        "UPDATE compaction.attempts SET state = 'running', finished_at = NULL, reason = NULL"
        " WHERE conversation_id = 'c2'",
        "UPDATE compaction.attempts SET state = 'failed', reason = 'x'"
        " WHERE conversation_id = 'c1'",
        "UPDATE compaction.attempts SET lease_expires_at = now() WHERE conversation_id = 'c1'",
        "DELETE FROM compaction.attempts WHERE conversation_id = 'c2'",
        # a running attempt can only finish (or renew its lease), nothing else
        "UPDATE compaction.attempts SET worker = 'intruder' WHERE conversation_id = 'c3'",
        # the login that claimed it is not handed to another
        "UPDATE compaction.attempts SET claimed_by = 'intruder' WHERE conversation_id = 'c3'",
        "UPDATE compaction.attempts SET attempt = 2 WHERE conversation_id = 'c3'",
        "DELETE FROM compaction.attempts WHERE conversation_id = 'c3'",
    ]:
        refused(conn, statement, APPEND_ONLY)
    assert snapshot(conn) == before


def test_event_log_rows_never_change(actor: Conn) -> None:
    conn = actor
    # event_log holds what no attempt row records (and every event recorded before
    # attempt rows held their own); two rows written directly stand for those
    conn.execute("INSERT INTO compaction.event_log (conversation_id, kind, occurred_at)"
                 " VALUES ('c9', 'claim', now()), ('c9', 'failure', now())")
    before = snapshot(conn)
    # 3 claims, 1 completion, 1 failure recorded by the attempts; 2 from event_log
    assert len(before["audit_events"]) == 7
    assert len(before["event_log"]) == 2
    for statement in [
        "UPDATE compaction.audit_events SET reason = 'forged'",
        "UPDATE compaction.audit_events SET kind = 'claim' WHERE kind = 'failure'",
        "DELETE FROM compaction.audit_events",
        "DELETE FROM compaction.audit_events WHERE kind = 'claim'",
    ]:
        refused(conn, statement, NOT_UPDATABLE)
        # the table behind it, with what the view's rows are made of: its guard
        refused(conn, statement.replace("audit_events", "event_log"), APPEND_ONLY)
    # the events an attempt row records are set once (the claim's with the
    # row, the end's by the guard): the attempt log's own rules refuse changing them
    for statement in [
        "UPDATE compaction.attempts SET claim_recorded_at = now() WHERE conversation_id = 'c3'",
        "UPDATE compaction.attempts SET claim_event_id = 1 WHERE conversation_id = 'c3'",
        "UPDATE compaction.attempts SET finish_event_id = 1 WHERE conversation_id = 'c3'",
        "UPDATE compaction.attempts SET finish_recorded_at = now() WHERE conversation_id = 'c1'",
    ]:
        refused(conn, statement, APPEND_ONLY)
    assert snapshot(conn) == before


def test_guards_are_enabled_always(conn: Conn) -> None:
    rows = conn.execute(
        "SELECT t.tgrelid::regclass::text, t.tgname, t.tgenabled FROM pg_trigger AS t"
        " WHERE t.tgrelid::regclass::text LIKE 'compaction.%' AND NOT t.tgisinternal"
    ).fetchall()
    assert rows
    assert {enabled for _, _, enabled in rows} == {"A"}
    truncate_guarded = {rel for rel, name, _ in rows if name.endswith("_truncate_guard")}
    assert truncate_guarded == {f"compaction.{t}"
                                for t in ENGINE_TABLES + DERIVED_TABLES + LOCK_TABLES}
    # nobody, the owner included, holds TRUNCATE on an engine table
    for table in ENGINE_TABLES + LOCK_TABLES:
        for role in ("compaction_owner", "compaction_worker", "compaction_reader",
                     "compaction_auditor"):
            assert conn.execute("SELECT has_table_privilege(%s, %s, 'TRUNCATE')",
                                (role, f"compaction.{table}")).fetchone() == (False,)


def test_running_attempt_may_finish_directly_only_forward(engine_state: Conn) -> None:
    """The one allowed transition also holds for direct writes (the owner's)."""
    conn = engine_state
    conn.execute("UPDATE compaction.attempts SET state = 'failed', reason = 'manual',"
                 " finished_at = started_at + interval '1 minute' WHERE conversation_id = 'c3'")
    refused(conn, "UPDATE compaction.attempts SET state = 'running', finished_at = NULL,"
                  " reason = NULL WHERE conversation_id = 'c3'", APPEND_ONLY)
