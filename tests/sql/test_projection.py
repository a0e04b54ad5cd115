"""project_history against the real engine: Case B, versions, scope, determinism, cost."""

from __future__ import annotations

import json
import random
import string
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, LiteralString

import psycopg
import pytest

from pycompactor import Projection, db, project_history, source_hash
from pycompactor import projection as projection_module
from pycompactor.errors import PycompactorError, UsageError
from pycompactor.hashing import source_message_ids
from pycompactor.projection import marker_line, message_cost
from tests.history import History, SeededPair, raw_cost

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


def test_the_database_ranks_versions(conn: Conn) -> None:
    """The preference among a range's summaries is the database's (projection_summaries'
    version_rank); Python keeps no parser of version names."""
    pairs = History(conn).pairs("r", 40)
    ids = {version: import_summary(conn, "r", pairs, 0, version=version)
           for version in (V1, V2, V3)}
    ranks = dict(conn.execute("SELECT summary_id, version_rank"
                              " FROM compaction.projection_summaries('r', 'default')").fetchall())
    assert ranks == {ids[V1]: 1, ids[V2]: 2, ids[V3]: 3}


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


@pytest.mark.parametrize("judged", [False, True], ids=["one-statement", "from-the-views"])
def test_a_connection_with_autocommit_off_is_left_idle(dsn: str, judged: bool) -> None:
    """Not autocommit and no transaction open: psycopg would leave open the transaction
    its first statement begins; the driver's own is committed before it returns."""
    with psycopg.connect(dsn, autocommit=True) as setup:
        pairs = History(setup).pairs("ac", 30)
        import_summary(setup, "ac", pairs, 0)
        if judged:
            judge_from_the_views(setup)
    with psycopg.connect(dsn) as conn:
        projection = project_history(conn, "ac", budget_bytes=BIG)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert [p.placement for p in projection.pairs] == ["summarized"] * 10 + ["raw"] * 20


def judge_from_the_views(conn: Conn) -> None:
    """Put the derived state out of use (a tracking trigger disabled): every call judges
    from the views, as before the install's rebuild and on Citus."""
    conn.execute("ALTER TABLE compaction_source.runs DISABLE TRIGGER runs_track_insert")
    assert conn.execute("SELECT compaction.derived_state_current()").fetchone() == (False,)


@pytest.mark.parametrize("judged", [False, True], ids=["derived", "from-the-views"])
def test_source_current_equals_the_python_judgement(conn: Conn, judged: bool) -> None:
    """projection_summaries.source_current: the range exists now with exactly the stored
    ids and hash (read from derived state, or judged from the views: one judgement
    for every range), the Python recomputation's verdict."""
    pairs = History(conn).pairs("h", 35, text="ß\u3000净")
    if judged:
        judge_from_the_views(conn)
    current = import_summary(conn, "h", pairs, 0)
    edited = import_summary(conn, "h", pairs, 10)
    moved = import_summary(conn, "h", pairs, 20)
    edit_pair_3(conn, pairs[13])  # same ids, changed text: only the hash can tell
    delete_message_3(conn, pairs[25])  # pairs 25.. renumber: range 20 has other ids
    rows = conn.execute(
        "SELECT summary_id, source_current FROM compaction.projection_summaries('h', 'default')"
        " ORDER BY summary_id").fetchall()
    now = db.eligible_pairs(conn, "h")
    expected = {
        sid: (len(now[start : start + 10]) == 10
              and source_message_ids(now[start : start + 10]) == source_message_ids(
                  pairs[start : start + 10])
              and source_hash(now[start : start + 10]) == source_hash(pairs[start : start + 10]))
        for sid, start in ((current, 0), (edited, 10), (moved, 20))}
    assert rows == [(sid, expected[sid]) for sid in (current, edited, moved)]
    assert rows == [(current, True), (edited, False), (moved, False)]
    # The auditor's view agrees, judged the same way.
    assert conn.execute("SELECT summary_id, staleness FROM compaction.audit_stale_summaries"
                        " WHERE conversation_id = 'h' ORDER BY summary_id").fetchall() == [
        (edited, "source_changed"), (moved, "source_changed")]
    assert conn.execute("SELECT count(*) FROM compaction.projection_summaries('nobody', 'default')"
                        ).fetchone() == (0,)


# ---------------------------------------------------------------------------- cost


def calls_in_this_transaction(conn: Conn, functions: Sequence[str]) -> dict[str, int]:
    """How often each function ran in the current transaction (track_functions = all)."""
    return {f: int(conn.execute("SELECT coalesce(pg_stat_get_xact_function_calls(%s::regprocedure),"
                                " 0)", (f,)).fetchone()[0])  # type: ignore[index]
            for f in functions}


def test_judged_from_the_views_a_projection_judges_the_conversation_once(conn: Conn) -> None:
    """Without the derived state, the summaries' verdicts (and the audit of stale
    summaries, and the targets) judge the conversation once and hash every summarized
    range in one statement, however many ranges are summarized (once per summarized
    range would be quadratic in the history's length: 81 s a projection at 10,000 pairs,
    docs/benchmarks.md); a projection judges once in all.
    Counted, not timed: each function's calls in one transaction."""
    pairs = History(conn).pairs("once", 75)
    for start in range(0, 50, 10):
        import_summary(conn, "once", pairs, start)
    judge_from_the_views(conn)
    counted = ["compaction.judge_runs(text, text[], boolean)",
               "compaction.range_hash(text, text[])",
               "compaction.range_hashes(text, int[], text[])"]
    conn.execute("SET track_functions = 'all'")

    def calls(action: Any) -> dict[str, int]:
        before = calls_in_this_transaction(conn, counted)
        action()
        after = calls_in_this_transaction(conn, counted)
        return {f: after[f] - before[f] for f in counted}

    with conn.transaction():
        current: list[Any] = []
        assert calls(lambda: current.append(conn.execute(
            "SELECT count(*) FROM compaction.projection_summaries('once', 'default')"
            " WHERE source_current").fetchone())) == {counted[0]: 1, counted[1]: 0, counted[2]: 1}
        assert current == [(5,)]
        assert calls(lambda: db.plan_targets(conn, "once")) == {
            counted[0]: 1, counted[1]: 0, counted[2]: 1}
        stale: list[Any] = []
        assert calls(lambda: stale.append(conn.execute(
            "SELECT count(*) FROM compaction.audit_stale_summaries").fetchone())) == {
            counted[0]: 1, counted[1]: 0, counted[2]: 1}
        assert stale == [(0,)]
        assert [t.from_pair for t in db.plan_targets(conn, "once")] == [0, 10, 20, 30, 40]
        # project_history: the pairs and the summaries' verdicts from one judgement
        # (not the pairs' metadata, then the verdicts, which would judge twice)
        projection: list[Projection] = []
        assert calls(lambda: projection.append(
            project_history(conn, "once", budget_bytes=BIG))) == {
            counted[0]: 1, counted[1]: 0, counted[2]: 1}
        assert {p.placement for p in projection[0].pairs[:50]} == {"summarized"}


@pytest.mark.parametrize("scope", ["default", "other"])
def test_judged_from_the_views_the_projection_is_the_derived_states(conn: Conn,
                                                                     scope: str) -> None:
    """Judged from the views, projection_frame gives every pair and every
    summary's verdict from one judgement (judged_frame), and a projection is the one
    statement it is with the derived state. Same state, same projection, at every
    budget: current, superseded (by version and by completed_at), not projectable, stale
    by an edited text (same ids: only the hash tells), by renumbered pairs (a deleted
    message, a failed run), a block that does not fit, summaries of another scope."""
    pairs = History(conn).pairs("eq", 95)
    import_summary(conn, "eq", pairs, 0)
    import_summary(conn, "eq", pairs, 0, version=V2)
    import_summary(conn, "eq", pairs, 0, version=V1)
    import_summary(conn, "eq", pairs, 10)
    import_summary(conn, "eq", pairs, 20)
    import_summary(conn, "eq", pairs, 30, completed_at=T0)
    import_summary(conn, "eq", pairs, 30, completed_at=T0 + timedelta(hours=1),
                   model="other-model")
    import_summary(conn, "eq", pairs, 40, text="x" * 5_000)
    import_summary(conn, "eq", pairs, 50)
    import_summary(conn, "eq", pairs, 50, scope="other")
    import_summary(conn, "eq", pairs, 60, scope="other", version=V2)
    import_summary(conn, "eq", pairs, 60)
    import_summary(conn, "eq", pairs, 70)
    import_summary(conn, "eq", pairs, 80)
    edit_pair_3(conn, pairs[13])  # range 10: same ids, another hash
    fail_run_3(conn, pairs[88])  # range 80 and after: renumbered
    delete_message_3(conn, pairs[75])  # range 70 and after: renumbered again
    # Every 1,500 bytes up to the whole history's cost: the walk stops in every range.
    whole = project_history(conn, "eq", budget_bytes=BIG, scope=scope).used_bytes
    budgets = [*range(0, whole + 1_500, 1_500), BIG]
    derived = {b: project_history(conn, "eq", budget_bytes=b, scope=scope).to_dict()
               for b in budgets}
    reasons = {r["reason"] for r in derived[BIG]["rejected_summaries"]}
    if scope == "default":
        assert reasons == {"superseded", "version_not_projectable", "stale_source"}, reasons
        assert any(r["reason"] == "did_not_fit"
                   for b in budgets for r in derived[b]["rejected_summaries"])
    judge_from_the_views(conn)
    counted = ["compaction.judged_frame(text, text)",
               "compaction.judge_runs(text, text[], boolean)",
               "compaction.indexed_pairs(text)"]
    conn.execute("SET track_functions = 'all'")
    with conn.transaction():
        for budget in budgets:
            before = calls_in_this_transaction(conn, counted)
            judged = project_history(conn, "eq", budget_bytes=budget, scope=scope).to_dict()
            after = calls_in_this_transaction(conn, counted)
            assert judged == derived[budget], budget
            assert {f: after[f] - before[f] for f in counted} == {
                counted[0]: 1, counted[1]: 1, counted[2]: 0}, budget


def test_range_hashes_is_range_hash_for_each_range(conn: Conn) -> None:
    """range_hashes gives each range what range_hash gives it: the hash when its 20 ids
    are found, else NULL (an id missing, or of another conversation), and nothing for a
    range none of whose ids is found; a wrong count of ids is refused."""
    pairs = History(conn).pairs("rh", 40)
    other = History(conn).pairs("rh-other", 1)
    ranges = [source_message_ids(pairs[s : s + 10]) for s in (0, 10, 20, 30)]
    ranges[1] = [*ranges[1][:19], "no-such-message"]
    ranges[2] = [*ranges[2][:19], other[0].assistant_message_id]
    ranges.append(["nowhere"] * 20)
    froms = [0, 10, 20, 30, 40]
    flat = [i for r in ranges for i in r]
    got = dict(conn.execute("SELECT from_pair, source_hash FROM compaction.range_hashes("
                            "'rh', %s, %s)", (froms, flat)).fetchall())
    single = {f: conn.execute("SELECT compaction.range_hash('rh', %s)", (r,)).fetchone()[0]  # type: ignore[index]
              for f, r in zip(froms, ranges, strict=True)}
    assert got == {f: h for f, h in single.items() if f != 40}
    assert got[0] == source_hash(pairs[0:10])
    assert got[30] == source_hash(pairs[30:40])
    assert got[10] is None
    assert got[20] is None
    with pytest.raises(psycopg.Error, match="20 ids per range: 2 ranges, 20 ids") as raised:
        conn.execute("SELECT * FROM compaction.range_hashes('rh', '{0,10}', %s)", (ranges[0],))
    assert raised.value.sqlstate == "CP020"


Logged = tuple[str, Any, int, int, list[Any]]


class RecordingCursor(psycopg.Cursor[Any]):
    """Records each statement whose rows are read, its parameters, the number of rows and
    bytes of its result, and the rows (at fetch time: in a pipeline the result arrives
    after execute)."""

    log: ClassVar[list[Logged]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self._recorded = (str(query), params)
        return super().execute(query, params, **kwargs)

    def fetchall(self) -> list[Any]:
        rows = super().fetchall()
        res = self.pgresult
        size = 0
        for r in range(res.ntuples if res is not None else 0):
            for c in range(res.nfields if res is not None else 0):
                value = res.get_value(r, c) if res is not None else None
                size += len(value) if value is not None else 0
        RecordingCursor.log.append((*self._recorded, len(rows), size, rows))
        return rows


def recorded(conn: Conn, conversation_id: str, budget: int
             ) -> tuple[Projection, list[Logged]]:
    RecordingCursor.log = []
    conn.cursor_factory = RecordingCursor
    try:
        projection = project_history(conn, conversation_id, budget_bytes=budget)
    finally:
        conn.cursor_factory = psycopg.Cursor
    return projection, RecordingCursor.log


def statement(log: list[Logged], function: str) -> Logged | None:
    found = [entry for entry in log if f"compaction.{function}(" in entry[0]]
    assert len(found) <= 1
    return found[0] if found else None


def required(log: list[Logged], function: str) -> Logged:
    found = statement(log, function)
    assert found is not None, function
    return found


def text_message_ids(read: Logged) -> list[str]:
    """The message ids whose texts a projection_read statement sent (its rows after the
    frame's)."""
    return [row[-3] for row in read[4][1:] if row[-3] is not None]


def text_summary_ids(read: Logged) -> list[int]:
    return [row[-2] for row in read[4][1:] if row[-2] is not None]


def sent_message_ids(log: list[Logged]) -> list[str]:
    """The message ids whose texts a projection read: from projection_read's rows (the
    one statement), or named to projection_texts (the reads in a snapshot, when the
    derived state is not in use, as on Citus)."""
    texts = statement(log, "projection_texts")
    if texts is not None:
        return list(texts[1]["message_ids"])
    return text_message_ids(required(log, "projection_read"))


def test_the_summary_a_range_beyond_reach_would_use_is_not_listed(conn: Conn) -> None:
    pairs = History(conn).pairs("reach", 40)
    preferred = import_summary(conn, "reach", pairs, 0, text="x" * 5_000)
    other = import_summary(conn, "reach", pairs, 0, version=V2)

    # Two pairs' worth of budget: range 0 is out of reach. The preferred summary was not
    # tried, so it is not listed (contract §9: did_not_fit is a block tried and dropped);
    # the other is superseded whatever the budget.
    newest = raw_cost(pairs[38:])
    projection, _ = recorded(conn, "reach", newest)
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (other, "superseded")]
    assert [p.placement for p in projection.pairs] == ["omitted"] * 38 + ["raw"] * 2

    # Enough to pass pairs 10-39 raw: the walk reaches range 0 and tries the block, which
    # does not fit (5,000 bytes of summary): did_not_fit, then pairs 9, 8, ... raw.
    within = raw_cost(pairs[9:])
    projection, _ = recorded(conn, "reach", within)
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (preferred, "did_not_fit"), (other, "superseded")]
    assert [p.placement for p in projection.pairs] == ["omitted"] * 9 + ["raw"] * 31


def test_stale_summary_beyond_reach_is_stale_source(conn: Conn) -> None:
    pairs = History(conn).pairs("far", 40)
    preferred = import_summary(conn, "far", pairs, 0)
    other = import_summary(conn, "far", pairs, 0, version=V2)
    edit_pair_3(conn, pairs[3])  # same ids, changed text: only the hash can tell

    # Two pairs' worth of budget: the walk cannot reach pairs 0-9, yet both summaries are
    # named stale_source (contract §9: only did_not_fit depends on the budget), and no text
    # of their range is read.
    newest = raw_cost(pairs[38:])
    projection, log = recorded(conn, "far", newest)
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (preferred, "stale_source"), (other, "stale_source")]
    assert [p.placement for p in projection.pairs] == ["omitted"] * 38 + ["raw"] * 2
    assert sorted(sent_message_ids(log)) == sorted(
        m for p in pairs[38:] for m in (p.user_message_id, p.assistant_message_id))

    # Enough to pass pairs 10-39 raw: the walk reaches range 0; the same reasons.
    within = raw_cost(pairs[10:])
    projection, log = recorded(conn, "far", within)
    assert [(r.summary_id, r.reason) for r in projection.rejected_summaries] == [
        (preferred, "stale_source"), (other, "stale_source")]
    assert [p.placement for p in projection.pairs] == ["omitted"] * 10 + ["raw"] * 30


def included_texts(projection: Projection, pairs: Sequence[SeededPair]
                   ) -> tuple[list[str], list[int]]:
    """The message ids and summary ids whose texts a projection renders, from its
    manifest: both messages of a raw pair, the user message of a summarized one."""
    message_ids: list[str] = []
    summary_ids: set[int] = set()
    for placement in projection.pairs:
        pair = pairs[placement.pair_index]
        if placement.placement == "raw":
            message_ids += [pair.user_message_id, pair.assistant_message_id]
        elif placement.summary_id is not None:
            message_ids.append(pair.user_message_id)
            summary_ids.add(placement.summary_id)
    return sorted(message_ids), sorted(summary_ids)


def walk_edges(projection: Projection) -> list[int]:
    """The byte totals of a projection's newest items, newest first (a raw pair: its two
    messages; a summary block: its summary message and the 10 user messages before it)."""
    costs: list[int] = []
    messages = list(projection.messages)
    while messages:
        if messages[-1]["content"].startswith("[pycompactor summary"):
            item, messages = messages[-11:], messages[:-11]
        else:
            item, messages = messages[-2:], messages[:-2]
        costs.append(sum(message_cost(m["content"]) for m in item))
    edges, spent = [], 0
    for cost in costs:
        spent += cost
        edges.append(spent)
    return edges


@pytest.mark.parametrize("seed", range(8))
def test_the_engine_walk_sends_exactly_the_texts_the_driver_includes(conn: Conn,
                                                                    seed: int) -> None:
    """compaction.projection_read walks the frame as the driver does (its twin in
    PL/pgSQL): over random sizes, summaries (big ones whose blocks are dropped, rejected
    and stale ones) and budgets, one statement serves every projection and sends exactly
    the texts it renders, no more."""
    rng = random.Random(seed)
    conversation = f"walk{seed}"
    history = History(conn)
    history.conversation(conversation)
    pairs = [history.pair(conversation, user="q" * rng.randrange(1, 400),
                          assistant="净值" * rng.randrange(1, 900))
             for _ in range(rng.randrange(30, 90))]
    for start in range(0, len(pairs) - 29, 10):
        if rng.random() < 0.8:
            import_summary(conn, conversation, pairs, start,
                           text="摘要 " * rng.randrange(1, 1500))
        if rng.random() < 0.3:
            import_summary(conn, conversation, pairs, start, version=V2)
    if rng.random() < 0.5:
        edit_pair_3(conn, pairs[rng.randrange(len(pairs) - 20)])
    total = raw_cost(pairs)
    # Where the walk is decided: each budget that the newest items fit exactly, and one
    # byte less (so a block of the next range just fits, or is dropped for its raw pairs).
    budgets = {0, 100, total, BIG} | {rng.randrange(total) for _ in range(5)}
    for edge in walk_edges(project_history(conn, conversation, budget_bytes=BIG)):
        budgets |= {edge, edge - 1}
    for budget in sorted(budgets):
        projection, log = recorded(conn, conversation, budget)
        [read] = log
        assert "compaction.projection_read(" in read[0]
        expected_messages, expected_summaries = included_texts(projection, pairs)
        assert sorted(text_message_ids(read)) == expected_messages, budget
        assert sorted(text_summary_ids(read)) == expected_summaries, budget


def test_the_statement_reads_back_to_the_first_pair_under_the_largest_budget(
        conn: Conn) -> None:
    """projection_read asked for the 10 newest pairs under the largest budget reads the
    frame again, back to pair 0, within the statement (its step back is computed in
    numeric: in bigint it overflowed)."""
    pairs = History(conn).pairs("huge", 40)
    summary_id = import_summary(conn, "huge", pairs, 0)
    rows = conn.execute(
        "SELECT first_pair, message_id, summary_id"
        " FROM compaction.projection_read('huge', 'default', 10, %s, %s)",
        (projection_module.MAX_BUDGET_BYTES, projection_module._MARKER_BYTES)).fetchall()
    assert rows[0][0] == 0
    texts = rows[1:]
    assert [t[2] for t in texts if t[2] is not None] == [summary_id]
    assert sorted(t[1] for t in texts if t[1] is not None) == sorted(
        [p.user_message_id for p in pairs[:10]]
        + [m for p in pairs[10:] for m in (p.user_message_id, p.assistant_message_id)])
    # The largest marker size a caller can give: the block's cost passes an int and still
    # fits the budget (no sum overflows); under a smaller budget it is dropped, and every
    # pair is sent raw.
    for budget, summaries, texts_sent in ((projection_module.MAX_BUDGET_BYTES, [summary_id],
                                           10 + 1 + 60),
                                          (2**31, [], 80)):
        rows = conn.execute(
            "SELECT summary_id FROM compaction.projection_read('huge', 'default', 10, %s,"
            " %s)", (budget, 2**31 - 1)).fetchall()
        assert len(rows) == 1 + texts_sent
        assert [r[0] for r in rows[1:] if r[0] is not None] == summaries


def test_the_statement_reads_its_texts_itself(conn: Conn) -> None:
    """projection_read reads the texts its walk includes in its own statement, calling no
    function for them (through projection_texts' statement each text row would be stored twice
    more). Counted with track_functions = 'all', which counts the calls of
    SQL and PL/pgSQL functions alike."""
    pairs = History(conn).pairs("inline", 40)
    summary_id = import_summary(conn, "inline", pairs, 0)
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        rows = conn.execute(
            "SELECT message_id, summary_id"
            " FROM compaction.projection_read('inline', 'default', 40, %s, %s)",
            (BIG, projection_module._MARKER_BYTES)).fetchall()
        called = dict(conn.execute(
            "SELECT funcname, calls FROM pg_catalog.pg_stat_xact_user_functions"
            " WHERE schemaname = 'compaction'").fetchall())
    assert [r[1] for r in rows[1:] if r[1] is not None] == [summary_id]
    assert len([r for r in rows[1:] if r[0] is not None]) == 10 + 2 * 30
    assert called.get("projection_read") == 1, called
    assert "projection_texts" not in called, called


def test_the_statement_asked_for_no_pairs_steps_back_all_the_same(conn: Conn) -> None:
    """p_pairs 0 on a conversation of whole ranges gives a frame of no pairs; the step
    back takes at least 10 more (twice nothing is nothing: the statement looped until
    its timeout)."""
    pairs = History(conn).pairs("none", 30)
    conn.execute("SET statement_timeout = '10s'")
    rows = conn.execute(
        "SELECT first_pair, message_id FROM compaction.projection_read('none', 'default',"
        " 0, %s, %s)", (raw_cost(pairs[-3:]), projection_module._MARKER_BYTES)).fetchall()
    conn.execute("RESET statement_timeout")
    assert rows[0][0] == 20
    assert sorted(r[1] for r in rows[1:]) == sorted(
        m for p in pairs[-3:] for m in (p.user_message_id, p.assistant_message_id))


def test_a_text_the_engine_did_not_send_is_read_again_in_a_snapshot(
        conn: Conn, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's walk decides. Told a wrong marker size, the engine's walk drops every
    summary block the driver takes; the driver then reads frame and texts again in one
    snapshot and gives the same projection."""
    pairs = History(conn).pairs("fb", 50)
    import_summary(conn, "fb", pairs, 0)
    import_summary(conn, "fb", pairs, 10)
    expected = project_history(conn, "fb", budget_bytes=BIG)
    assert [p.placement for p in expected.pairs].count("summarized") == 20
    monkeypatch.setattr(projection_module, "_MARKER_BYTES", BIG)
    projection, log = recorded(conn, "fb", BIG)
    assert projection == expected
    assert [entry[0].split("compaction.")[1].split("(")[0] for entry in log] == [
        "projection_read", "projection_frame", "projection_texts"]
    assert text_summary_ids(log[0]) == []


def seed_long_replies(conn: Conn, conversation_id: str, n: int, reply: str) -> list[SeededPair]:
    """n pairs by COPY: short questions, each reply `reply` after its own prefix."""
    History(conn).conversation(conversation_id)
    seeded = [SeededPair(f"{conversation_id}:r{k}", f"{conversation_id}:u{k}",
                         f"{conversation_id}:a{k}", f"question {k}?", f"answer {k}: {reply}")
              for k in range(n)]
    with conn.cursor() as cur:
        with cur.copy("COPY compaction_source.runs (run_id, conversation_id, status)"
                      " FROM STDIN") as copy:
            for p in seeded:
                copy.write_row((p.run_id, conversation_id, "completed"))
        with cur.copy("COPY compaction_source.messages (message_id, conversation_id, run_id,"
                      " role, status, content, seq) FROM STDIN") as copy:
            for k, p in enumerate(seeded):
                copy.write_row((p.user_message_id, conversation_id, p.run_id, "user",
                                "completed", p.user_content, 2 * k))
                copy.write_row((p.assistant_message_id, conversation_id, p.run_id,
                                "assistant", "completed", p.assistant_content, 2 * k + 1))
    return seeded


def toast_blocks(conn: Conn) -> int:
    """Block accesses (read + hit) of compaction_source.messages' TOAST table so far."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # the counters include our last call
    row = conn.execute(
        "SELECT coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)"
        " FROM pg_statio_user_tables WHERE relid = 'compaction_source.messages'::regclass"
    ).fetchone()
    assert row is not None
    blocks: int = row[0]
    return blocks


def toast_blocks_of(conn: Conn, query: LiteralString, params: Any = None) -> int:
    before = toast_blocks(conn)
    conn.execute(query, params).fetchall()
    return toast_blocks(conn) - before


def messages_fetched(conn: Conn, query: LiteralString, params: Any = None) -> tuple[int, int]:
    """(rows read by sequential scans, rows fetched by index) of source messages for one query."""
    with conn.transaction():
        row = conn.execute(
            "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_xact_user_tables WHERE relid = 'compaction_source.messages'::regclass"
        ).fetchone()
        conn.execute(query, params).fetchall()
        after = conn.execute(
            "SELECT coalesce(seq_tup_read, 0), coalesce(idx_tup_fetch, 0)"
            " FROM pg_stat_xact_user_tables WHERE relid = 'compaction_source.messages'::regclass"
        ).fetchone()
    assert row is not None
    assert after is not None
    return after[0] - row[0], after[1] - row[1]


@pytest.mark.slow
def test_ten_thousand_summarized_pairs_read_only_what_the_budget_reaches(conn: Conn) -> None:
    # No autovacuum/analyze on the source while the TOAST counters are read.
    conn.execute("ALTER TABLE compaction_source.messages"
                 " SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)")
    n = 10_000
    # Random letters do not compress, so each ~2 KB reply is stored out of line (TOAST).
    reply = "".join(random.Random(5).choices(string.ascii_letters + string.digits, k=2_000))
    pairs = seed_long_replies(conn, "big", n, reply)
    with conn.cursor() as cur:  # every range summarized, the steady state
        cur.executemany(
            "SELECT compaction.import_summary('big', 'default', %s, %s, %s, 'test-model',"
            " %s, %s, %s)",
            [(start, source_message_ids(pairs[start : start + 10]),
              source_hash(pairs[start : start + 10]), V3,
              f"summary of {start}: " + "净值 " * 100, T0)
             for start in range(0, n, 10)])
    toast_table = conn.execute(
        "SELECT reltoastrelid::regclass::text FROM pg_class"
        " WHERE oid = 'compaction_source.messages'::regclass").fetchone()
    assert toast_table is not None
    toasted = conn.execute(psycopg.sql.SQL(
        "SELECT count(DISTINCT chunk_id), pg_relation_size({0}::regclass)"
        " / current_setting('block_size')::int FROM {1}").format(
            psycopg.sql.Literal(toast_table[0]),
            psycopg.sql.SQL(".").join(psycopg.sql.Identifier(part)
                                      for part in toast_table[0].split(".")))).fetchone()
    assert toasted is not None
    toast_values, toast_pages = toasted
    assert toast_values == n  # every reply, uncompressed, out of line; no question
    budget = 64 * 1024

    started = time.perf_counter()
    before = toast_blocks(conn)
    projection, log = recorded(conn, "big", budget)
    call_blocks = toast_blocks(conn) - before
    elapsed = time.perf_counter() - started

    summarized = {p.summary_id for p in projection.pairs if p.summary_id is not None}
    raw = [p for p in projection.pairs if p.placement == "raw"]
    assert len(projection.pairs) == n
    assert projection.used_bytes <= budget
    assert 10 < len(summarized) < 100
    # One statement, whatever n: projection_read reads the frame (again, further back,
    # while its walk gets past the pairs it gave), then the texts the walk includes. The
    # frame gives pair metadata only for the newest pairs and a verdict for every
    # summary, but no text.
    [read] = log
    assert "compaction.projection_read(" in read[0]
    frame_row = read[4][0]
    frame_pairs = frame_row[1] - frame_row[2]  # pair_count - first_pair
    reached = n - projection.pairs.omitted
    assert reached <= frame_pairs < 2 * reached + 20
    total_text = sum(len(p.user_content.encode()) + len(p.assistant_content.encode())
                     for p in pairs)
    assert read[3] < total_text / 100
    # Every summary's source was judged when it was written (all current here: none is
    # stale_source). The frame names the chosen summaries of the pairs it gave only; the
    # walk tried one block it could not fit (did_not_fit, contract §9) and never reached
    # the 900-odd ranges older than it, whose summaries are not listed.
    oldest_used = min(p.pair_index for p in projection.pairs if p.placement == "summarized")
    assert [(r.from_pair, r.reason) for r in projection.rejected_summaries] == [
        (oldest_used - 10, "did_not_fit")]
    # The frame names the verdicts of the ranges its pairs cover and the rejected ones
    # (none here), not one per summary.
    assert frame_row[2] == n - frame_pairs
    assert len(frame_row[7]) == frame_pairs // 10
    # Texts: one row per projected message (a summary's text is its assistant message).
    assert read[2] == 1 + len(projection.messages)

    # On the server, the statement fetches exactly the rows of the texts it sends, by key.
    assert messages_fetched(
        conn, "SELECT * FROM compaction.projection_read('big', 'default', %s, %s, %s)",
        (read[1]["pairs"], budget, read[1]["marker_bytes"])) == (
        0, len(text_message_ids(read)))

    # TOAST: what the call read is the included raw replies (a summary block carries user
    # texts, short here, never its replies); the pair metadata and judging every
    # summary's source read none.
    assert call_blocks <= len(raw) + 10
    eligibility = toast_blocks_of(conn, "SELECT count(*) FROM compaction.indexed_pairs('big')")
    # Pair metadata comes from derived state (or, judged from the views, the first TOAST
    # chunk of each message at most): at most one block per reply.
    assert eligibility <= n
    print(f"\n10,000 pairs, 64 KiB: {elapsed:.3f}s; TOAST blocks: call {call_blocks},"
          f" of which eligibility {eligibility};"
          f" toast pages {toast_pages}; {len(summarized)} summaries used,"
          f" {len(raw)} raw pairs, {len(projection.messages)} messages")
    assert elapsed < 10


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
    # The snapshot the refused read had opened is rolled back: the connection goes on.
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    conn.execute("RESET ROLE")
    assert len(project_history(conn, "r", budget_bytes=BIG).messages) == 11 + 4
