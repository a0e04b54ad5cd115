"""project_history against the real engine: Case B, versions, scope, determinism, cost."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, LiteralString

import psycopg
import pytest

from pycompactor import db, project_history, source_hash
from pycompactor.errors import PycompactorError, UsageError
from pycompactor.hashing import source_message_ids
from pycompactor.projection import marker_line, message_cost
from tests.history import History, SeededPair

Conn = psycopg.Connection[Any]
V1, V2, V3 = (f"conversation-compaction@{n}" for n in (1, 2, 3))
T0 = datetime(2026, 11, 1, tzinfo=UTC)
BIG = 10_000_000


def import_summary(conn: Conn, conversation_id: str, pairs: Sequence[SeededPair],
                   from_pair: int, *, version: str = V3, text: str | None = None,
                   completed_at: datetime = T0, scope: str = "default",
                   model: str = "test-model") -> int:
    block = pairs[from_pair : from_pair + 10]
    row = conn.execute(
        "SELECT compaction.import_summary(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (conversation_id, scope, from_pair, source_message_ids(block), source_hash(block),
         model, version, text or f"summary of {from_pair} ({version}, {model})",
         completed_at),
    ).fetchone()
    assert row is not None
    summary_id: int = row[0]
    return summary_id


def complete_summary(conn: Conn, conversation_id: str, from_pair: int, text: str) -> int:
    """A @3 summary through the worker path: claim the current target, complete it."""
    target = next(t for t in db.plan_targets(conn, conversation_id) if t.from_pair == from_pair)
    claim = conn.execute(
        "SELECT claimed, reason, job_id, attempt FROM compaction.claim("
        "%s, 'default', %s, %s, %s, 'pycompactor/extractive-1', %s, 'test-worker')",
        (conversation_id, from_pair, target.source_message_ids, target.source_hash, V3),
    ).fetchone()
    assert claim is not None
    assert claim[0], claim
    done = conn.execute(
        "SELECT ok, reason, summary_id FROM compaction.complete(%s, %s, %s, 'stop', 0)",
        (claim[2], claim[3], text),
    ).fetchone()
    assert done is not None
    assert done[0], done
    summary_id: int = done[2]
    return summary_id


def stored_summaries(conn: Conn, conversation_id: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT summary_id, scope, from_pair, to_pair, source_message_ids, source_hash, model,"
        " prompt_version, summary, completed_at FROM compaction.summaries"
        " WHERE conversation_id = %s ORDER BY summary_id", (conversation_id,),
    ).fetchall()


def placements(conn: Conn, conversation_id: str, budget: int = BIG,
               scope: str = "default") -> list[tuple[str, int | None]]:
    projection = project_history(conn, conversation_id, budget_bytes=budget, scope=scope)
    return [(p.placement, p.summary_id) for p in projection.pairs]


# ------------------------------------------------------------------------- Case B


def edit_pair_3(conn: Conn, pair: SeededPair) -> None:
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE message_id = %s", (pair.assistant_message_id,))


def fail_run_3(conn: Conn, pair: SeededPair) -> None:
    conn.execute("UPDATE compaction_source.runs SET status = 'failed' WHERE run_id = %s",
                 (pair.run_id,))


def delete_message_3(conn: Conn, pair: SeededPair) -> None:
    conn.execute("DELETE FROM compaction_source.messages WHERE message_id = %s",
                 (pair.user_message_id,))


@pytest.mark.parametrize("change", [edit_pair_3, fail_run_3, delete_message_3])
def test_case_b_changed_source_makes_the_summary_stale(conn: Conn, change: Any) -> None:
    pairs = History(conn).pairs("b", 30)
    summary_id = complete_summary(conn, "b", 0, "Funds compared with last week's NAV.")
    before = project_history(conn, "b", budget_bytes=BIG)
    assert [(p.placement, p.summary_id) for p in before.pairs[:10]] == [
        ("summarized", summary_id)] * 10
    assert before.rejected_summaries == ()
    stored = stored_summaries(conn, "b")

    change(conn, pairs[3])

    after = project_history(conn, "b", budget_bytes=BIG)
    assert [(r.summary_id, r.from_pair, r.reason) for r in after.rejected_summaries] == [
        (summary_id, 0, "stale_source")]
    assert [(p.placement, p.summary_id) for p in after.pairs[:10]] == [("raw", None)] * 10
    current = db.eligible_pairs(conn, "b")
    assert [(m["role"], m["content"]) for m in after.messages[:20]] == [
        (role, text) for p in current[:10]
        for role, text in (("user", p.user_content), ("assistant", p.assistant_content))]
    assert not any("last week's NAV" in m["content"] for m in after.messages)
    assert stored_summaries(conn, "b") == stored


# ----------------------------------------------------------------------- versions


def test_versions_one_never_two_used_three_wins(conn: Conn) -> None:
    pairs = History(conn).pairs("v", 40)
    v1 = import_summary(conn, "v", pairs, 0, version=V1)
    v2_alone = import_summary(conn, "v", pairs, 10, version=V2)
    v2_newer = import_summary(conn, "v", pairs, 20, version=V2,
                              completed_at=T0 + timedelta(days=30))
    v3 = import_summary(conn, "v", pairs, 20, version=V3)

    projection = project_history(conn, "v", budget_bytes=BIG)
    assert [(p.placement, p.summary_id) for p in projection.pairs] == (
        [("raw", None)] * 10 + [("summarized", v2_alone)] * 10
        + [("summarized", v3)] * 10 + [("raw", None)] * 10)
    assert [(r.summary_id, r.from_pair, r.reason) for r in projection.rejected_summaries] == [
        (v1, 0, "version_not_projectable"), (v2_newer, 20, "superseded")]
    contents = [m["content"] for m in projection.messages]
    assert f"{marker_line(10, 19)}\nsummary of 10 ({V2}, test-model)" in contents
    assert f"{marker_line(20, 29)}\nsummary of 20 ({V3}, test-model)" in contents
    assert not any(f"({V1}" in c for c in contents)


def test_same_version_latest_completed_wins(conn: Conn) -> None:
    pairs = History(conn).pairs("w", 10)
    older = import_summary(conn, "w", pairs, 0, model="m1")
    newer = import_summary(conn, "w", pairs, 0, model="m2", completed_at=T0 + timedelta(1))
    projection = project_history(conn, "w", budget_bytes=BIG)
    assert projection.pairs[0].summary_id == newer
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (older, "superseded")]


def test_stale_import_is_reported_and_never_used(conn: Conn) -> None:
    history = History(conn)
    pairs = history.pairs("s", 10)
    wrong = [*pairs[:9], SeededPair("x", "xu", "xa", "q", "a")]
    block_ids = source_message_ids(wrong)
    row = conn.execute(
        "SELECT compaction.import_summary('s', 'default', 0, %s, %s, 'm', %s, 'old', %s)",
        (block_ids, source_hash(wrong), V3, T0),
    ).fetchone()
    assert row is not None
    assert placements(conn, "s") == [("raw", None)] * 10
    projection = project_history(conn, "s", budget_bytes=BIG)
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (row[0], "stale_source")]


# ------------------------------------------------------------------ budget and scope


def test_block_that_does_not_fit_falls_back_to_raw(conn: Conn) -> None:
    pairs = History(conn).pairs("f", 10)
    summary_id = import_summary(conn, "f", pairs, 0, text="净值" * 1000)
    newest = pairs[-1]
    budget = message_cost(newest.user_content) + message_cost(newest.assistant_content)
    projection = project_history(conn, "f", budget_bytes=budget)
    assert [(p.placement, p.summary_id) for p in projection.pairs] == (
        [("omitted", None)] * 9 + [("raw", None)])
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (summary_id, "did_not_fit")]
    assert projection.used_bytes == budget
    assert projection.messages == (
        {"role": "user", "content": newest.user_content},
        {"role": "assistant", "content": newest.assistant_content})


def test_only_summaries_of_the_scope_are_used(conn: Conn) -> None:
    pairs = History(conn).pairs("sc", 10)
    other = import_summary(conn, "sc", pairs, 0, scope="support")
    assert placements(conn, "sc") == [("raw", None)] * 10
    assert project_history(conn, "sc", budget_bytes=BIG).rejected_summaries == ()
    assert placements(conn, "sc", scope="support") == [("summarized", other)] * 10


def test_unknown_conversation_is_empty(conn: Conn) -> None:
    projection = project_history(conn, "nobody", budget_bytes=1000)
    assert projection.to_dict() == {"messages": [], "pairs": [], "rejected_summaries": [],
                                    "used_bytes": 0, "budget_bytes": 1000}


def test_negative_budget_is_refused_before_any_query(conn: Conn) -> None:
    conn.close()  # proves no statement is needed to refuse it
    with pytest.raises(UsageError):
        project_history(conn, "x", budget_bytes=-1)


def test_same_state_same_json_and_no_transaction_left_open(conn: Conn) -> None:
    history = History(conn)
    pairs = history.pairs("d", 35, text="基金 NAV 🙂")
    import_summary(conn, "d", pairs, 0, version=V2)
    import_summary(conn, "d", pairs, 0, version=V3)
    import_summary(conn, "d", pairs, 10, version=V1)
    for budget in (0, 500, 2000, BIG):
        first = json.dumps(project_history(conn, "d", budget_bytes=budget).to_dict(),
                           ensure_ascii=False)
        second = json.dumps(project_history(conn, "d", budget_bytes=budget).to_dict(),
                            ensure_ascii=False)
        assert first == second
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_works_inside_the_callers_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as setup:
        History(setup).pairs("t", 3)
    with psycopg.connect(dsn) as conn:  # not autocommit: the caller's transaction
        conn.execute("SELECT 1")
        projection = project_history(conn, "t", budget_bytes=BIG)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert [p.placement for p in projection.pairs] == ["raw"] * 3


def test_range_hashes_equal_the_python_hash(conn: Conn) -> None:
    pairs = History(conn).pairs("h", 25, text="ß\u3000净")
    import_summary(conn, "h", pairs, 10)
    rows = conn.execute(
        "SELECT pair_index, range_hash FROM compaction.projection_pairs('h', 'default')"
        " WHERE range_hash IS NOT NULL").fetchall()
    assert rows == [(10, source_hash(pairs[10:20]))]


# ---------------------------------------------------------------------------- cost


class RecordingCursor(psycopg.Cursor[Any]):
    """Records each statement with the rows and the bytes of the result it received."""

    log: ClassVar[list[tuple[str, int, int]]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        result = super().execute(query, params, **kwargs)
        res = self.pgresult
        rows = res.ntuples if res is not None else 0
        size = 0
        for r in range(rows):
            for c in range(res.nfields if res is not None else 0):
                value = res.get_value(r, c) if res is not None else None
                size += len(value) if value is not None else 0
        RecordingCursor.log.append((str(query), rows, size))
        return result


def rows_read(conn: Conn, table: LiteralString) -> tuple[int, int]:
    row = conn.execute(
        "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)"
        " FROM pg_stat_xact_user_tables WHERE relid = %s::regclass", (table,)).fetchone()
    assert row is not None
    return row[0], row[1]


@pytest.mark.slow
def test_ten_thousand_pairs_read_only_the_texts_that_fit(conn: Conn) -> None:
    filler = "净值 NAV comparison " * 12  # about 250 bytes per message
    pairs = History(conn).pairs("big", 10_000, text=filler)
    for from_pair in range(9_900, 9_980, 10):
        import_summary(conn, "big", pairs, from_pair)
    budget = 64 * 1024
    total_text = sum(len(p.user_content.encode()) + len(p.assistant_content.encode())
                     for p in pairs)
    assert total_text > 5_000_000

    RecordingCursor.log = []
    conn.cursor_factory = RecordingCursor
    started = time.perf_counter()
    projection = project_history(conn, "big", budget_bytes=budget)
    elapsed = time.perf_counter() - started
    conn.cursor_factory = psycopg.Cursor
    log = RecordingCursor.log

    included = [p for p in projection.pairs if p.placement != "omitted"]
    assert len(projection.pairs) == 10_000
    assert 0 < len(included) < 400
    assert projection.used_bytes <= budget
    # A few statements, whatever the length: SET TRANSACTION, pairs, summaries, texts.
    assert len(log) == 4
    (_, _, _), (pairs_sql, n_pair_rows, pair_bytes), (_, n_summaries, _), \
        (texts_sql, n_texts, text_bytes) = log
    assert "projection_pairs" in pairs_sql
    assert "projection_texts" in texts_sql
    assert n_summaries == 8
    # Metadata for every pair (the manifest lists every pair), but no text: far less
    # than the conversation's text.
    assert n_pair_rows == 10_000
    assert pair_bytes < total_text / 5
    # Text: exactly one row per message the projection carries (a summary's text is its
    # assistant message), and no more bytes than the projection uses.
    assert n_texts == len(projection.messages)
    assert text_bytes <= projection.used_bytes <= budget
    assert elapsed < 10

    # On the server, the text read fetches exactly the rows it names, by primary key.
    with conn.transaction():
        seq_before, idx_before = rows_read(conn, "compaction_source.messages")
        conn.execute("SELECT * FROM compaction.projection_texts('big', %s, '{}')",
                     ([pairs[-1].user_message_id, pairs[-1].assistant_message_id],))
        seq_after, idx_after = rows_read(conn, "compaction_source.messages")
    assert (seq_after - seq_before, idx_after - idx_before) == (0, 2)


def test_reader_role_can_project_and_auditor_cannot(conn: Conn) -> None:
    pairs = History(conn).pairs("r", 12)
    summary_id = import_summary(conn, "r", pairs, 0)
    conn.execute("SET ROLE compaction_reader")
    projection = project_history(conn, "r", budget_bytes=BIG)
    assert projection.pairs[0].summary_id == summary_id
    assert len(projection.messages) == 11 + 4
    conn.execute("SET ROLE compaction_auditor")
    with pytest.raises(PycompactorError, match="permission denied"):
        project_history(conn, "r", budget_bytes=BIG)
