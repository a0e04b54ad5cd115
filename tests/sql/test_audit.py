"""§10 audit views and `pycompactor audit`: jobs with attempts and durations, stale
summaries by recomputed hash, exhausted identities, the event log."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pycompactor import cli, db
from tests.history import History
from tests.sql.conftest import LoginRole
from tests.sql.engine import GOOD, LEASE, MODEL, T0, V3, claim, target

Conn = psycopg.Connection[Any]


def scenario(conn: Conn) -> dict[str, int]:
    """done (completed, later edited), gone (range lost pairs), tired (exhausted),
    busy (running), imp (imported, current)."""
    history = History(conn)
    ids: dict[str, int] = {}
    seeded = history.pairs("done", 30)
    t = db.plan_targets(conn, "done")[0]
    c = claim(conn, "done", t)
    assert c.job_id is not None
    done = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0 + timedelta(seconds=42))
    assert done.summary_id is not None
    ids["done"] = done.summary_id
    conn.execute("UPDATE compaction_source.messages SET content = 'edited' WHERE message_id = %s",
                 (seeded[4].assistant_message_id,))

    gone = history.pairs("gone", 30)
    t = db.plan_targets(conn, "gone")[0]
    c = claim(conn, "gone", t)
    assert c.job_id is not None
    result = db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0)
    assert result.summary_id is not None
    ids["gone"] = result.summary_id
    conn.execute("DELETE FROM compaction_source.messages WHERE run_id = ANY(%s)",
                 ([p.run_id for p in gone[:25]],))

    t = target(conn, "tired")
    c = claim(conn, "tired", t)
    assert c.job_id is not None
    ids["tired"] = c.job_id
    assert db.fail(conn, c.job_id, 1, "http_error", now=T0).ok
    assert claim(conn, "tired", t, now=T0).claimed
    assert db.reap(conn, now=T0 + LEASE) == 1

    t = target(conn, "busy")
    assert claim(conn, "busy", t, now=T0 + LEASE).claimed

    t = target(conn, "imp")
    ids["imp"] = db.import_summary(conn, "imp", "default", 0, t.source_message_ids,
                                   t.source_hash, MODEL, "conversation-compaction@2",
                                   "imported summary", T0)
    return ids


def test_audit_views(conn: Conn) -> None:
    ids = scenario(conn)
    jobs = conn.execute(
        "SELECT conversation_id, attempt, state, reason, duration, imported"
        " FROM compaction.audit_jobs ORDER BY conversation_id, attempt").fetchall()
    assert jobs == [
        ("busy", 1, "running", None, None, False),
        ("done", 1, "completed", "completed", timedelta(seconds=42), False),
        ("gone", 1, "completed", "completed", timedelta(0), False),
        ("imp", None, "imported", None, None, True),
        ("tired", 1, "failed", "http_error", timedelta(0), False),
        ("tired", 2, "failed", "lease_expired", LEASE, False),
    ]
    stale = conn.execute(
        "SELECT summary_id, conversation_id, staleness, current_hash IS NULL"
        " FROM compaction.audit_stale_summaries ORDER BY summary_id").fetchall()
    assert stale == [(ids["done"], "done", "source_changed", False),
                     (ids["gone"], "gone", "range_incomplete", True)]
    exhausted = conn.execute(
        "SELECT conversation_id, job_id, first_reason, second_reason, exhausted_at"
        " FROM compaction.audit_exhausted").fetchall()
    assert exhausted == [("tired", ids["tired"], "http_error", "lease_expired", T0 + LEASE)]
    events = conn.execute(
        "SELECT conversation_id, kind, attempt, reason FROM compaction.audit_events"
        " ORDER BY recorded_at, event_id").fetchall()
    assert events == [
        ("done", "claim", 1, None), ("done", "completion", 1, "completed"),
        ("gone", "claim", 1, None), ("gone", "completion", 1, "completed"),
        ("tired", "claim", 1, None), ("tired", "failure", 1, "http_error"),
        ("tired", "claim", 2, None), ("tired", "lease_expiry", 2, "lease_expired"),
        ("busy", "claim", 1, None),
        ("imp", "import", None, None),
    ]


def test_every_event_carries_its_job_attempt_and_summary(conn: Conn) -> None:
    """Each writer of an attempt's change records its event from the rows it holds:
    claim, complete (a summary, and a refused reply), fail, a fenced
    call that finds the lease expired, claim reaping the identity it touches, and reap.
    Every event carries its job's identity, its attempt's worker, reason and time, and a
    completion its summary; each is checked against the jobs, attempts and summaries."""
    t1, t2 = T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)
    # refused reply, then a summary
    ta = target(conn, "ev-a")
    a1 = claim(conn, "ev-a", ta, worker="wa1")
    assert a1.job_id is not None
    assert db.complete(conn, a1.job_id, 1, GOOD, "length", 0, now=t1).reason == "not_stopped"
    assert claim(conn, "ev-a", ta, worker="wa2", now=t1).attempt == 2
    done = db.complete(conn, a1.job_id, 2, GOOD, "stop", 0, now=t2)
    assert done.ok
    assert done.summary_id is not None
    # the fenced call finds the lease expired; then a retry that fails
    tb = target(conn, "ev-b")
    b1 = claim(conn, "ev-b", tb, worker="wb1")
    assert b1.job_id is not None
    assert db.complete(conn, b1.job_id, 1, GOOD, "stop", 0, now=T0 + LEASE).reason == "lease_lost"
    assert claim(conn, "ev-b", tb, worker="wb2", now=T0 + LEASE).attempt == 2
    assert db.fail(conn, b1.job_id, 2, "http_error", now=T0 + LEASE + timedelta(seconds=3)).ok
    # claim reaps the identity it touches before claiming it again
    tc = target(conn, "ev-c")
    assert claim(conn, "ev-c", tc, worker="wc1").claimed
    assert claim(conn, "ev-c", tc, worker="wc2", now=T0 + LEASE).attempt == 2
    # reap
    td = target(conn, "ev-d")
    assert claim(conn, "ev-d", td, worker="wd1").claimed
    assert db.reap(conn, now=T0 + LEASE + timedelta(seconds=9)) == 1

    events = conn.execute(
        "SELECT conversation_id, kind, attempt, worker, reason, occurred_at,"
        "       summary_id, summary_chars"
        " FROM compaction.audit_events ORDER BY recorded_at, event_id").fetchall()
    expire, reaped = T0 + LEASE, T0 + LEASE + timedelta(seconds=9)
    chars = len(GOOD)
    assert events == [
        ("ev-a", "claim", 1, "wa1", None, T0, None, None),
        ("ev-a", "failure", 1, "wa1", "not_stopped", t1, None, chars),
        ("ev-a", "claim", 2, "wa2", None, t1, None, None),
        ("ev-a", "completion", 2, "wa2", "completed", t2, done.summary_id, chars),
        ("ev-b", "claim", 1, "wb1", None, T0, None, None),
        ("ev-b", "lease_expiry", 1, "wb1", "lease_expired", expire, None, None),
        ("ev-b", "claim", 2, "wb2", None, expire, None, None),
        ("ev-b", "failure", 2, "wb2", "http_error", expire + timedelta(seconds=3), None, None),
        ("ev-c", "claim", 1, "wc1", None, T0, None, None),
        ("ev-c", "lease_expiry", 1, "wc1", "lease_expired", expire, None, None),
        ("ev-c", "claim", 2, "wc2", None, expire, None, None),
        ("ev-d", "claim", 1, "wd1", None, T0, None, None),
        ("ev-d", "lease_expiry", 1, "wd1", "lease_expired", reaped, None, None),
    ]
    # The identity in every event is its job's, and every attempt's state is in the log.
    mismatched = conn.execute(
        "SELECT e.event_id FROM compaction.audit_events AS e"
        " JOIN compaction.jobs AS j USING (conversation_id, job_id)"
        " WHERE (e.scope, e.from_pair, e.to_pair, e.model, e.prompt_version, e.source_hash)"
        "       IS DISTINCT FROM"
        "       (j.scope, j.from_pair, j.to_pair, j.model, j.prompt_version, j.source_hash)"
        " UNION ALL"
        " SELECT -1 FROM compaction.audit_events AS e"
        " WHERE NOT EXISTS (SELECT 1 FROM compaction.jobs AS j"
        "                   WHERE j.conversation_id = e.conversation_id AND j.job_id = e.job_id)"
    ).fetchall()
    assert mismatched == []
    # Every ended attempt gave its slot back; the one still running holds one.
    slots = conn.execute("SELECT holder_conversation_id, holder_attempt FROM compaction.admission"
                         " WHERE holder_conversation_id IS NOT NULL").fetchall()
    assert slots == [("ev-c", 2)]


def test_audit_cli(conn: Conn, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    scenario(conn)
    assert cli.main(["audit", "--dsn", dsn]) == 0
    out = capsys.readouterr().out
    assert "lease_expired" in out
    assert "http_error" in out
    assert GOOD not in out
    assert cli.main(["audit", "--dsn", dsn, "--view", "stale", "--json"]) == 0
    stale = json.loads(capsys.readouterr().out)
    assert sorted(r["staleness"] for r in stale) == ["range_incomplete", "source_changed"]
    assert cli.main(["audit", "--dsn", dsn, "--view", "exhausted"]) == 0
    assert "tired" in capsys.readouterr().out
    assert cli.main(["audit", "--dsn", dsn, "--view", "events", "--limit", "2", "--json",
                     "--conversation", "tired"]) == 0
    events = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in events] == ["lease_expiry", "claim"]
    assert cli.main(["audit", "--dsn", dsn, "--view", "events", "--conversation", "none"]) == 0
    assert "no rows" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["audit", "--dsn", dsn, "--view", "secrets"])
    assert info.value.code == 2


def test_audit_cli_runs_as_auditor(conn: Conn, login_role: LoginRole,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    scenario(conn)
    auditor = login_role("compaction_auditor")
    for view in ("jobs", "stale", "exhausted", "events"):
        assert cli.main(["audit", "--dsn", auditor, "--view", view, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)
    worker = login_role("compaction_worker")
    assert cli.main(["audit", "--dsn", worker]) == 1
    assert "permission denied" in capsys.readouterr().err


def test_prompt_versions_seeded(conn: Conn) -> None:
    assert conn.execute("SELECT * FROM compaction.prompt_versions ORDER BY 1").fetchall() == [
        ("conversation-compaction@1", "mixed", False, False),
        ("conversation-compaction@2", "assistant_only", True, False),
        (V3, "assistant_only", True, True),
    ]
    assert conn.execute("SELECT max_running FROM compaction.settings").fetchall() == [(8,)]
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO compaction.settings (singleton) VALUES (true)")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("INSERT INTO compaction.settings (singleton) VALUES (false)")


def test_docs_audit_queries_run(conn: Conn, login_role: LoginRole) -> None:
    """Every psql recipe of docs/audit.md runs (as the auditor, unless it needs settings)."""
    scenario(conn)
    text = (Path(__file__).parents[2] / "docs" / "audit.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 10
    with psycopg.connect(login_role("compaction_auditor"), autocommit=True) as auditor:
        for block in blocks:
            if block.startswith("CREATE ROLE"):
                continue
            runner = conn if "compaction.settings" in block else auditor
            runner.execute(block).fetchall()
