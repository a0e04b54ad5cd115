"""§10 roles: worker drives claims through functions only, auditor sees metadata only,
and the engine's functions ignore objects planted on the caller's search_path."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db, errors
from tests.history import History
from tests.sql.conftest import LoginRole, connect_as
from tests.sql.engine import GOOD, LEASE, MODEL, T0, V3, claim, scalar, target

Conn = psycopg.Connection[Any]
ENGINE_TABLES = ["jobs", "attempts", "job_summaries", "event_log", "admission", "queue",
                 "settings", "prompt_versions", "conversation_locks"]
MARKER = "ZQXJ-TEXT-MARKER"


def test_worker_claims_and_completes_but_writes_nothing_directly(
        conn: Conn, login_role: LoginRole) -> None:
    t = target(conn, "c1")
    with connect_as(login_role("compaction_worker")) as worker:
        # plan, claim, heartbeat, complete, fail, reap, enqueue, dequeue: all through functions
        plan = db.plan_targets(worker, "c1")
        assert plan == [t]
        # the worker role leaves time to the server (p_now is the owner's, CP025)
        c = claim(worker, "c1", t, now=None)
        assert c.job_id is not None
        assert db.heartbeat(worker, c.job_id, 1, conversation_id="c1").ok
        assert db.complete(worker, c.job_id, 1, GOOD, "stop", 0, conversation_id="c1").ok
        t2 = target(conn, "c2")
        c2 = claim(worker, "c2", t2, now=None)
        assert c2.job_id is not None
        assert db.fail(worker, c2.job_id, 1, "timeout", conversation_id="c2").ok
        assert db.reap(worker) == 0
        db.enqueue(worker, "c3")
        assert "c3" in {q.conversation_id for q in db.dequeue(worker, 100)}
        for table in ENGINE_TABLES:
            for statement in (f"INSERT INTO compaction.{table} DEFAULT VALUES",
                              f"UPDATE compaction.{table} SET holder_conversation_id = 'x'"
                              if table == "admission"
                              else f"UPDATE compaction.{table} SET conversation_id = 'x'"
                              if table not in ("settings", "prompt_versions")
                              else f"UPDATE compaction.{table} SET input_kind = 'x'"
                              if table == "prompt_versions"
                              else f"UPDATE compaction.{table} SET max_running = 100",
                              f"DELETE FROM compaction.{table}",
                              f"TRUNCATE compaction.{table}"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    worker.execute(statement)
        for call in ("SELECT compaction.erase_conversation('c1', 'nope')",
                     "SELECT compaction.import_summary('c1', 'default', 0, ARRAY[]::text[],"
                     " '', '', '', '', now())",
                     "SELECT compaction.fence(1, 1, now(), 'c1')",
                     "SELECT compaction.lock_conversation('c1')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                worker.execute(call)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            worker.execute("SELECT * FROM compaction.job_summaries")
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 1


def test_reader_reads_summaries_and_versions_only(conn: Conn, login_role: LoginRole) -> None:
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
    with connect_as(login_role("compaction_reader")) as reader:
        assert reader.execute("SELECT summary FROM compaction.summaries").fetchall() == [(GOOD,)]
        assert reader.execute("SELECT prompt_version, input_kind, projectable, accepts_new_jobs"
                              " FROM compaction.prompt_versions ORDER BY 1").fetchall() == [
            ("conversation-compaction@1", "mixed", False, False),
            ("conversation-compaction@2", "assistant_only", True, False),
            ("conversation-compaction@3", "assistant_only", True, True),
        ]
        assert len(db.eligible_pairs(reader, "c1")) == 30
        with pytest.raises(errors.PermissionDenied, match="permission denied"):
            claim(reader, "c1", t)


def test_reader_and_worker_read_their_views(conn: Conn, login_role: LoginRole) -> None:
    """The reader reads compaction.summaries and the source views, the worker the source
    views, filtered by conversation as they are read; on Citus through SELECT on what the
    views read (Citus runs a view's shard queries with the caller's
    rights), on one node through the views alone."""
    t = target(conn, "c1")
    c = claim(conn, "c1", t)
    assert c.job_id is not None
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
    target(conn, "c2")
    distributed = scalar(conn, "SELECT compaction.engine_distributed()")
    reader_dsn, worker_dsn = login_role("compaction_reader"), login_role("compaction_worker")
    with connect_as(reader_dsn) as reader, connect_as(worker_dsn) as worker:
        assert reader.execute("SELECT from_pair, summary FROM compaction.summaries"
                              " WHERE conversation_id = 'c1'").fetchall() == [(0, GOOD)]
        for who in (reader, worker):
            assert who.execute("SELECT count(*) FROM compaction.source_runs"
                               " WHERE conversation_id = 'c2'").fetchone() == (30,)
            assert who.execute("SELECT count(*) FROM compaction.source_messages"
                               " WHERE conversation_id = 'c2'").fetchone() == (60,)
    reader_role = psycopg.conninfo.conninfo_to_dict(reader_dsn)["user"]
    assert conn.execute("SELECT has_table_privilege(%s, 'compaction.jobs', 'SELECT')",
                        (reader_role,)).fetchone() == (distributed,)


def seed_everything(conn: Conn) -> None:
    """Every kind of engine row, with a marker in every message and summary text."""
    history = History(conn)
    seeded = history.pairs("c1", 60, text=MARKER)
    targets = db.plan_targets(conn, "c1")
    done = claim(conn, "c1", targets[0])
    assert done.job_id is not None
    assert db.complete(conn, done.job_id, 1, f"{MARKER} summary", "stop", 0, now=T0).ok
    db.import_summary(conn, "c1", "default", 10, targets[1].source_message_ids,
                      targets[1].source_hash, MODEL, V3, f"{MARKER} imported", T0)
    for attempt in (1, 2):
        c = claim(conn, "c1", targets[2])
        assert c.job_id is not None
        db.complete(conn, c.job_id, attempt, f"{MARKER} too long " * 1000, "stop", 0, now=T0)
    assert claim(conn, "c1", targets[3]).claimed
    # make the first summary stale
    conn.execute("UPDATE compaction_source.messages SET content = content || %s"
                 " WHERE message_id = %s", (MARKER, seeded[0].user_message_id))
    db.erase_conversation(conn, "gone", "request")


def test_auditor_sees_metadata_only(conn: Conn, login_role: LoginRole) -> None:
    seed_everything(conn)
    auditor_dsn = login_role("compaction_auditor")
    role = psycopg.conninfo.conninfo_to_dict(auditor_dsn)["user"]
    readable = {
        r[0] for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c"
            " WHERE c.relnamespace IN ('compaction'::regnamespace,"
            "                          'compaction_source'::regnamespace)"
            "   AND c.relkind IN ('r', 'v', 'm', 'p')"
            "   AND (has_table_privilege(%(role)s, c.oid, 'SELECT')"
            "        OR has_any_column_privilege(%(role)s, c.oid, 'SELECT'))",
            {"role": role}).fetchall()
    }
    assert readable == {"compaction.audit_jobs", "compaction.audit_stale_summaries",
                        "compaction.audit_exhausted", "compaction.audit_events",
                        "compaction.audit_queue"}
    with connect_as(auditor_dsn) as auditor:
        for relation in sorted(readable):
            rows = auditor.execute(f"SELECT * FROM {relation}").fetchall()
            assert rows, f"{relation} should have rows for this check to mean anything"
            for row in rows:
                assert MARKER not in repr(row), relation
        for view in ("jobs", "exhausted", "queue"):
            with auditor.transaction():  # one now() for the queue's ages
                through = auditor.execute(
                    f"SELECT * FROM compaction.read_audit_{view}()").fetchall()
                assert sorted(through, key=repr) == sorted(auditor.execute(
                    f"SELECT * FROM compaction.audit_{view}").fetchall(), key=repr)
        for forbidden in ("SELECT * FROM compaction.summaries",
                          "SELECT * FROM compaction.source_messages",
                          "SELECT * FROM compaction.eligible_pairs('c1')",
                          "SELECT * FROM compaction.plan_targets('c1')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                auditor.execute(forbidden)
    # and no function it may call returns text of messages or summaries
    callable_functions = {
        r[0] for r in conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc AS p"
            " WHERE p.pronamespace = 'compaction'::regnamespace"
            "   AND has_function_privilege(%s, p.oid, 'EXECUTE')", (role,)).fetchall()
    }
    # contract §2: the auditor may prove the derived state (ids, counts, hashes only);
    # stale_summaries is what audit_stale_summaries reads (ids and hashes), read_audit_*
    # what the other views read on Citus (their rows, no more).
    assert callable_functions == {"compaction.source_hash(text,integer)",
                                  "compaction.stale_summaries()",
                                  "compaction.read_audit_jobs()",
                                  "compaction.read_audit_exhausted()",
                                  "compaction.read_audit_queue()",
                                  "compaction.read_audit_events()",
                                  "compaction.explain_runs(text)",
                                  "compaction.verify_conversation(text)",
                                  "compaction.derived_state_status()",
                                  # model names only
                                  "compaction.projection_models()"}


def test_no_function_is_executable_by_public_and_writers_are_definers(conn: Conn) -> None:
    public = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc AS p"
        " WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
        "   AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) AS a"
        "                                    WHERE a.grantee = 0))").fetchall()
    assert public == []
    writers = ["claim", "claim_targets", "complete", "fail", "heartbeat", "reap", "enqueue",
               "dequeue", "ack", "release", "import_summary", "erase_conversation"]
    rows = conn.execute(
        "SELECT p.proname, p.prosecdef, p.proconfig, pg_get_userbyid(p.proowner)"
        " FROM pg_proc AS p WHERE p.pronamespace = 'compaction'::regnamespace"
        "   AND p.proname = ANY(%s)", (writers,)).fetchall()
    assert sorted(r[0] for r in rows) == sorted(writers)
    for name, definer, config, owner in rows:
        assert definer, name
        # A fixed search_path; besides it only the planner settings of the worker's write
        # calls (index plans whatever the tables' size when first planned).
        assert config[0] == "search_path=pg_catalog, pg_temp", name
        assert set(config[1:]) <= {"jit=off", "enable_seqscan=off"}, name
        assert owner == "compaction_owner", name


def test_search_path_hijack_is_ignored(conn: Conn, login_role: LoginRole) -> None:
    """Functions planted in public under names the engine calls are never picked up."""
    t = target(conn, "c1")
    for ddl in [
        "CREATE FUNCTION public.plan_targets(p text) RETURNS TABLE (from_pair int, to_pair int,"
        " source_message_ids text[], source_hash text) LANGUAGE sql AS"
        " $$ SELECT 0, 9, ARRAY(SELECT 'x' || g FROM generate_series(1, 20) g), repeat('a', 64) $$",
        "CREATE FUNCTION public.has_content(text) RETURNS boolean LANGUAGE sql"
        " AS $$ SELECT true $$",
        "CREATE FUNCTION public.char_length(text) RETURNS int LANGUAGE sql AS $$ SELECT 1 $$",
        "CREATE FUNCTION public.btrim(text, text) RETURNS text LANGUAGE sql AS $$ SELECT 'x' $$",
        "CREATE FUNCTION public.hashtext(text) RETURNS int LANGUAGE sql AS $$ SELECT 7 $$",
        "CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql"
        " AS $$ SELECT '2000-01-01'::timestamptz $$",
        "CREATE FUNCTION public.summary_problem(text) RETURNS text LANGUAGE sql"
        " AS $$ SELECT NULL::text $$",
        "CREATE FUNCTION public.textne(text, text) RETURNS boolean LANGUAGE sql"
        " AS $$ SELECT false $$",
        "CREATE OPERATOR public.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = public.textne)",
        # The small rules are inlined into the caller's statement, parsed under
        # the caller's search_path: only their qualified names keep these out.
        "CREATE FUNCTION public.texteq(text, text) RETURNS boolean LANGUAGE sql"
        " AS $$ SELECT true $$",
        "CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.texteq)",
        "CREATE FUNCTION public.int4eq(int, int) RETURNS boolean LANGUAGE sql"
        " AS $$ SELECT true $$",
        "CREATE OPERATOR public.= (LEFTARG = int, RIGHTARG = int, FUNCTION = public.int4eq)",
        "CREATE FUNCTION public.int4gt(int, int) RETURNS boolean LANGUAGE sql"
        " AS $$ SELECT false $$",
        "CREATE OPERATOR public.> (LEFTARG = int, RIGHTARG = int, FUNCTION = public.int4gt)",
        "CREATE TABLE public.jobs (LIKE compaction.jobs)",
        "GRANT ALL ON ALL FUNCTIONS IN SCHEMA public TO PUBLIC",
    ]:
        conn.execute(ddl)
    fake = t.__class__(0, 9, [f"x{g}" for g in range(1, 21)], "a" * 64)
    with connect_as(login_role("compaction_worker")) as worker:
        worker.execute("SET search_path = public, pg_catalog")
        assert claim(worker, "ghost", fake, now=None).reason == "not_eligible"
        before = scalar(conn, "SELECT pg_catalog.now()")
        c = claim(worker, "c1", t, now=None)
        # the server's clock, not the hijacked public.now() of 2000
        assert c.claimed
        assert c.lease_expires_at is not None
        assert c.lease_expires_at >= before + LEASE
        assert c.job_id is not None
        assert db.complete(worker, c.job_id, 1, " \t\n", "stop", 0).reason == "empty"
        c2 = claim(worker, "c1", t, now=None)
        assert (c2.claimed, c2.attempt) == (True, 2)
        assert c2.job_id is not None
        assert db.complete(worker, c2.job_id, 2, "x" * 6001, "stop", 0).reason == "too_long"
        assert claim(worker, "c1", t, now=None).reason == "attempts_exhausted"
        # The worker asks reply_problem itself, under its own search_path.
        assert db.reply_problem(worker, "fine", "length", 0) == "not_stopped"
        assert db.reply_problem(worker, "fine", "stop", 2) == "tool_calls"
        assert db.reply_problem(worker, "x" * 6001, "stop", 0) == "too_long"
        assert db.reply_problem(worker, " \t", "stop", 0) == "empty"
        assert db.reply_problem(worker, "fine", "stop", 0) is None
    assert scalar(conn, "SELECT count(*) FROM public.jobs") == 0
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 1


def test_every_engine_object_is_commented(conn: Conn) -> None:
    missing = conn.execute(
        "SELECT c.oid::regclass::text FROM pg_class AS c"
        " WHERE c.relnamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
        "   AND c.relkind IN ('r', 'v', 'p') AND c.relname <> 'alembic_version'"
        "   AND obj_description(c.oid, 'pg_class') IS NULL"
        " UNION ALL"
        " SELECT p.oid::regprocedure::text FROM pg_proc AS p"
        " WHERE p.pronamespace IN ('compaction'::regnamespace, 'compaction_source'::regnamespace)"
        "   AND obj_description(p.oid, 'pg_proc') IS NULL").fetchall()
    assert missing == []
