"""§7 import_summary (shape validation, one summary per identity) and erase_conversation."""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg
import pytest

from pycompactor import db, errors
from pycompactor.models import Target
from tests.history import History
from tests.sql.engine import GOOD, MODEL, T0, V3, claim, scalar, target

Conn = psycopg.Connection[Any]
VERSIONS = ["conversation-compaction@1", "conversation-compaction@2", V3]
SECRET = "SECRET-SUMMARY-TEXT"


def do_import(conn: Conn, conversation_id: str, t: Target, *, version: str = V3,
              summary: str = GOOD, scope: str = "default") -> int:
    return db.import_summary(conn, conversation_id, scope, t.from_pair, t.source_message_ids,
                             t.source_hash, MODEL, version, summary, T0)


@pytest.mark.parametrize("version", VERSIONS)
def test_import_any_known_version(conn: Conn, version: str) -> None:
    t = target(conn, "c1")
    summary_id = do_import(conn, "c1", t, version=version)
    row = conn.execute("SELECT summary_id, job_id, imported, prompt_version, completed_at,"
                       " source_message_ids, from_pair, to_pair FROM compaction.summaries"
                       ).fetchone()
    assert row == (summary_id, None, True, version, T0, t.source_message_ids, 0, 9)
    assert conn.execute("SELECT kind, summary_id, prompt_version FROM compaction.audit_events"
                        ).fetchall() == [("import", summary_id, version)]


def test_import_needs_no_current_source(conn: Conn) -> None:
    ids = [f"m{i}" for i in range(20)]
    t = Target(from_pair=40, to_pair=49, source_message_ids=ids, source_hash="ab" * 32)
    assert do_import(conn, "long-gone", t, version="conversation-compaction@1") > 0


def test_second_summary_per_identity_is_refused(conn: Conn) -> None:
    t = target(conn, "c1")
    do_import(conn, "c1", t)
    with pytest.raises(errors.DuplicateSummary):
        do_import(conn, "c1", t, summary="another text")
    # another scope or version is another identity
    do_import(conn, "c1", t, scope="audience-b")
    do_import(conn, "c1", t, version="conversation-compaction@2")
    # an identity completed by a worker refuses imports too
    t2 = target(conn, "c2")
    c = claim(conn, "c2", t2)
    assert c.job_id is not None
    assert db.complete(conn, c.job_id, 1, GOOD, "stop", 0, now=T0).ok
    with pytest.raises(errors.DuplicateSummary):
        do_import(conn, "c2", t2)
    assert scalar(conn, "SELECT count(*) FROM compaction.summaries") == 4


def test_claim_on_imported_identity_is_already_completed(conn: Conn) -> None:
    t = target(conn, "c1")
    do_import(conn, "c1", t)
    result = claim(conn, "c1", t)
    assert (result.claimed, result.reason) == (False, "already_completed")


@pytest.mark.parametrize(("change", "error"), [
    ({"from_pair": -10}, errors.InvalidRange),
    ({"from_pair": 15}, errors.InvalidRange),
    ({"source_message_ids": [f"m{i}" for i in range(19)]}, errors.InvalidSourceIds),
    ({"source_message_ids": ["m0", *[f"m{i}" for i in range(19)]]}, errors.InvalidSourceIds),
    ({"source_message_ids": [None, *[f"m{i}" for i in range(19)]]}, errors.InvalidSourceIds),
    ({"source_hash": "AB" * 32}, errors.InvalidSourceHash),
    ({"source_hash": "ab" * 31}, errors.InvalidSourceHash),
    ({"source_hash": "zz" * 32}, errors.InvalidSourceHash),
    ({"prompt_version": "conversation-compaction@9"}, errors.UnknownPromptVersion),
    ({"summary": ""}, errors.InvalidSummary),
    ({"summary": " \n\t "}, errors.InvalidSummary),
    ({"summary": "x" * 6001}, errors.InvalidSummary),
])
def test_import_shape_errors(conn: Conn, change: dict[str, Any],
                             error: type[errors.EngineError]) -> None:
    args: dict[str, Any] = {
        "from_pair": 0, "source_message_ids": [f"m{i}" for i in range(20)],
        "source_hash": "ab" * 32, "prompt_version": V3, "summary": GOOD, **change,
    }
    with pytest.raises(error) as info:
        db.import_summary(conn, "c1", "default", args["from_pair"], args["source_message_ids"],
                          args["source_hash"], MODEL, args["prompt_version"], args["summary"],
                          T0)
    assert isinstance(info.value.__cause__, psycopg.Error)
    assert info.value.__cause__.sqlstate == error.sqlstate
    assert scalar(conn, "SELECT count(*) FROM compaction.jobs") == 0


def test_import_accepts_the_limits(conn: Conn) -> None:
    t = target(conn, "c1")
    do_import(conn, "c1", t, summary="😀" * 6000)
    do_import(conn, "c1", dataclasses.replace(t, from_pair=10, to_pair=19), summary="\u3000")


# --- erasure ----------------------------------------------------------------------------

def populate(conn: Conn, conversation_id: str) -> None:
    """A completed, an imported, a failed and a running identity, plus a queue row."""
    t = target(conn, conversation_id, n_pairs=60)
    targets = db.plan_targets(conn, conversation_id)
    done = claim(conn, conversation_id, targets[0])
    assert done.job_id is not None
    assert db.complete(conn, done.job_id, 1, SECRET + " worker", "stop", 0, now=T0).ok
    do_import(conn, conversation_id, targets[1], summary=SECRET + " imported")
    failed = claim(conn, conversation_id, targets[2])
    assert failed.job_id is not None
    assert db.fail(conn, failed.job_id, 1, "timeout", now=T0).ok
    assert claim(conn, conversation_id, targets[3]).claimed
    assert t == targets[0]


def test_erase_conversation(conn: Conn) -> None:
    populate(conn, "c1")
    populate(conn, "c2")
    tables = ["jobs", "attempts", "job_summaries", "admission", "queue"]

    def counts(conversation_id: str) -> list[int]:
        # admission is global: its slots name their holder
        return [scalar(conn, f"SELECT count(*) FROM compaction.{t} WHERE "
                             f"{'holder_' if t == 'admission' else ''}conversation_id = %s",
                       (conversation_id,)) for t in tables]

    c2_before = conn.execute("SELECT * FROM compaction.summaries WHERE conversation_id = 'c2'"
                             " ORDER BY summary_id").fetchall()
    assert counts("c1") == [4, 3, 2, 1, 1]
    events_before = scalar(conn, "SELECT count(*) FROM compaction.audit_events")
    source_before = scalar(conn, "SELECT count(*) FROM compaction_source.messages")

    assert db.erase_conversation(conn, "c1", "gdpr_request") == 2

    assert counts("c1") == [0, 0, 0, 0, 0]
    assert counts("c2") == [4, 3, 2, 1, 1]
    assert conn.execute("SELECT * FROM compaction.summaries WHERE conversation_id = 'c2'"
                        " ORDER BY summary_id").fetchall() == c2_before
    assert scalar(conn, "SELECT count(*) FROM compaction_source.messages") == source_before
    # the log keeps every earlier event and gains one content-free tombstone
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events") == events_before + 1
    tombstone = conn.execute(
        "SELECT kind, reason, erased_jobs, erased_attempts, erased_summaries, summary_id"
        " FROM compaction.audit_events WHERE kind = 'erasure'").fetchall()
    assert tombstone == [("erasure", "gdpr_request", 4, 3, 2, None)]
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events AS e"
                        " WHERE e::text LIKE %s", (f"%{SECRET}%",)) == 0
    # an erased conversation can be compacted afresh
    t = db.plan_targets(conn, "c1")[0]
    again = claim(conn, "c1", t)
    assert (again.claimed, again.attempt) == (True, 1)


def test_erasure_exempts_only_its_own_conversation_and_transaction(conn: Conn,
                                                                   dsn: str) -> None:
    populate(conn, "c1")
    populate(conn, "c2")
    with psycopg.connect(dsn) as tx:
        assert db.erase_conversation(tx, "c1", "user_request") == 2
        with pytest.raises(psycopg.Error) as refused:
            tx.execute("DELETE FROM compaction.job_summaries WHERE conversation_id = 'c2'")
        assert refused.value.sqlstate == "CP010"
        tx.rollback()
    # rolled back: everything is still there
    assert scalar(conn, "SELECT count(*) FROM compaction.job_summaries") == 4
    assert db.erase_conversation(conn, "c1", "user_request") == 2
    # the next transaction gets no exemption for c1 either (nothing left) nor for c2
    with pytest.raises(psycopg.Error) as info:
        conn.execute("DELETE FROM compaction.job_summaries WHERE conversation_id = 'c2'")
    assert info.value.sqlstate == "CP010"


def test_erase_needs_a_reason_code(conn: Conn) -> None:
    populate(conn, "c1")
    events = scalar(conn, "SELECT count(*) FROM compaction.audit_events")
    # the tombstone outlives the erased rows and the auditor reads it: a code, not text
    for reason in (" ", "", "GDPR request 1234", "user said: my SSN is 078-05-1120",
                   "x" * 65, "Request", "1st"):
        with pytest.raises(errors.ReasonNotACode) as refused:
            db.erase_conversation(conn, "c1", reason)
        assert "078" not in str(refused.value)
    with pytest.raises(psycopg.Error) as null_reason:
        conn.execute("SELECT compaction.erase_conversation('c1', NULL)")
    assert null_reason.value.sqlstate == "CP024"
    assert scalar(conn, "SELECT count(*) FROM compaction.audit_events") == events
    assert scalar(conn, "SELECT count(*) FROM compaction.job_summaries") == 2
    assert db.erase_conversation(conn, "c1", "x" * 64) == 2


def test_source_rows_of_erased_conversation_untouched(conn: Conn) -> None:
    History(conn).pairs("c1", 30)
    before = conn.execute("SELECT * FROM compaction_source.messages ORDER BY 1").fetchall()
    assert db.erase_conversation(conn, "c1", "user_request") == 0
    assert conn.execute("SELECT * FROM compaction_source.messages ORDER BY 1").fetchall() \
        == before
