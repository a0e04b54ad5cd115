"""The Agents SDK recipe's views (pycompactor/recipes/agents_sqlalchemy.sql) on hand-written
SDK rows: how items become runs, roles, statuses and texts; tracking; the window-function
version that check-source must call slow.

Rows are written as SQLAlchemySession writes them (one JSON item per row, ASCII-escaped,
compact separators) into tables shaped as its `create_tables=True` makes them.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.sdk_source import SDK_TABLES_DDL
from pycompactor import db
from pycompactor.cli.source import check_source
from pycompactor.recipes import install_agents_sqlalchemy

Conn = psycopg.Connection[Any]


def user(text: str) -> dict[str, Any]:
    return {"content": text, "role": "user"}


def said(*parts: str, status: str = "completed") -> dict[str, Any]:
    return {"id": "__fake_id__", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": p, "annotations": []} for p in parts]}


CALL = {"type": "function_call", "id": "__fake_id__", "call_id": "c1", "name": "lookup_nav",
        "arguments": "{\"fund\":1}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "净值 12.50"}
REASONING = {"type": "reasoning", "id": "rs_1", "summary": []}


def write(conn: Conn, session: str, *items: dict[str, Any]) -> list[int]:
    conn.execute("INSERT INTO public.agent_sessions (session_id) VALUES (%s)"
                 " ON CONFLICT DO NOTHING", (session,))
    return [int(row[0]) for item in items for row in conn.execute(
        "INSERT INTO public.agent_messages (session_id, message_data) VALUES (%s, %s)"
        " RETURNING id", (session, json.dumps(item, separators=(",", ":"))))]


@pytest.fixture
def sdk(conn: Conn) -> Conn:
    conn.execute(SDK_TABLES_DDL)
    install_agents_sqlalchemy(conn)
    return conn


def messages(conn: Conn, session: str) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT message_id, run_id, role, status, content FROM compaction.source_messages"
        " WHERE conversation_id = %s ORDER BY seq", (session,)).fetchall()


def test_items_become_runs_roles_and_texts(sdk: Conn) -> None:
    ids = write(sdk, "s1",
                {"role": "system", "content": "你是基金助手。"},          # before any user item
                user("基金 F1 的净值？"),
                said("让我查一下。"), CALL, OUTPUT, REASONING,
                said("F1 的净值为 12.50 元。", "（数据截至 3 月）"),
                {"role": "user", "type": "message",
                 "content": [{"type": "input_text", "text": "Und F2?"},
                             {"type": "input_image", "image_url": "x"}]},
                said("I can't say.", status="incomplete"),
                user("F3?"))
    rows = messages(sdk, "s1")
    run1, run2, run3 = str(ids[1]), str(ids[7]), str(ids[9])
    assert [(r[1], r[2], r[3]) for r in rows] == [
        (None, "system", "completed"),
        (run1, "user", "completed"),
        (run1, "assistant_interim", "completed"),
        (run1, "sdk_item", "completed"),
        (run1, "sdk_item", "completed"),
        (run1, "sdk_item", "completed"),
        (run1, "assistant", "completed"),
        (run2, "user", "completed"),
        (run2, "assistant", "incomplete"),
        (run3, "user", "completed"),
    ]
    assert [r[0] for r in rows] == [str(i) for i in ids]
    texts = [r[4] for r in rows]
    # \uXXXX decoded; part lists joined by newlines; non-text parts dropped.
    assert texts[0] == "你是基金助手。"
    assert texts[6] == "F1 的净值为 12.50 元。\n（数据截至 3 月）"
    assert texts[7] == "Und F2?"
    assert json.loads(texts[4]) == OUTPUT  # a non-message item is its JSON, decoded
    assert "净值" in texts[4]
    assert sdk.execute("SELECT run_id, status FROM compaction.source_runs"
                       " WHERE conversation_id = 's1' ORDER BY run_id::bigint").fetchall() == [
        (run1, "completed"), (run2, "completed"), (run3, "in_progress")]
    verdicts = {v.run_id: v.reason for v in db.explain_runs(sdk, "s1")}
    assert verdicts == {run1: None, run2: "assistant_not_completed", run3: "run_status"}
    [pair] = db.eligible_pairs(sdk, "s1")
    assert (pair.user_content, pair.assistant_content) == (
        "基金 F1 的净值？", "F1 的净值为 12.50 元。\n（数据截至 3 月）")


def test_tracking_keeps_the_derived_state_exact(sdk: Conn) -> None:
    for i in range(35):
        write(sdk, "s2", user(f"Q{i} 基金？"), said(f"A{i}: 净值 {i}.5"))
    assert sdk.execute("SELECT compaction.derived_state_status()").fetchone() == ("in_use",)
    [target] = db.plan_targets(sdk, "s2")
    assert target.from_pair == 0
    before = target.source_hash
    first_answer = int(db.eligible_pairs(sdk, "s2")[2].assistant_message_id)
    sdk.execute("UPDATE public.agent_messages SET message_data = %s WHERE id = %s",
                (json.dumps(said("A2: 已更正")), first_answer))
    [target] = db.plan_targets(sdk, "s2")
    assert target.source_hash != before
    # An interim answer appended to an old run, then the session's items deleted.
    write(sdk, "s2", user("Q35"), said("interim"), CALL, said("A35"))
    assert len(db.eligible_pairs(sdk, "s2")) == 36
    for conversation in ("s2",):
        assert sdk.execute("SELECT * FROM compaction.verify_conversation(%s)",
                           (conversation,)).fetchall() == []
    sdk.execute("DELETE FROM public.agent_sessions WHERE session_id = 's2'")  # cascades
    assert db.eligible_pairs(sdk, "s2") == []
    assert sdk.execute("SELECT * FROM compaction.verify_conversation('s2')").fetchall() == []


def test_recipe_is_idempotent_and_takes_other_names(conn: Conn) -> None:
    conn.execute("CREATE SCHEMA app")
    conn.execute(SDK_TABLES_DDL.replace("public.agent_sessions", "app.sess")
                 .replace("public.agent_messages", "app.msgs")
                 .replace("idx_agent_messages_session_time", "idx_msgs_session_time"))
    for _ in range(2):
        result = install_agents_sqlalchemy(conn, schema="app", sessions_table="sess",
                                           messages_table="msgs")
        assert result.messages_table == "app.msgs"
    conn.execute("INSERT INTO app.sess (session_id) VALUES ('x')")
    conn.execute("INSERT INTO app.msgs (session_id, message_data) VALUES"
                 " ('x', %s), ('x', %s)", (json.dumps(user("hi")), json.dumps(said("hello"))))
    assert [(p.user_content, p.assistant_content) for p in db.eligible_pairs(conn, "x")] == [
        ("hi", "hello")]
    report = check_source(conn)
    assert report.ok, report.problems
    assert report.derived_state == "in_use"


# The natural first version: runs derived with a window function over the whole table.
WINDOW_VIEWS = """
CREATE OR REPLACE VIEW compaction.source_messages AS
    SELECT x.id::text AS message_id, x.session_id::text AS conversation_id,
           x.run::text AS run_id,
           CASE WHEN x.role = 'assistant' AND x.id <> x.last_assistant THEN 'assistant_interim'
                ELSE coalesce(x.role, 'sdk_item') END AS role,
           coalesce(x.message_data::jsonb ->> 'status', 'completed') AS status,
           public.pycompactor_agent_messages_content(x.message_data::jsonb) AS content,
           x.id::bigint AS seq
    FROM (SELECT y.*, max(y.id) FILTER (WHERE y.role = 'assistant')
                          OVER (PARTITION BY y.session_id, y.run) AS last_assistant
          FROM (SELECT m.*, public.pycompactor_agent_messages_role(m.message_data) AS role,
                       max(m.id) FILTER (WHERE public.pycompactor_agent_messages_role(
                                             m.message_data) = 'user')
                           OVER (PARTITION BY m.session_id ORDER BY m.id) AS run
                FROM public.agent_messages AS m) AS y) AS x
"""


def test_check_source_flags_the_window_function_views_as_slow(sdk: Conn) -> None:
    for session in ("w1", "w2"):
        for i in range(3):
            write(sdk, session, user(f"Q{i}"), said(f"A{i}"))
    report = check_source(sdk)
    assert report.ok, report.problems
    assert all(lookup.uses_index for lookup in report.lookups)

    sdk.execute(WINDOW_VIEWS)
    report = check_source(sdk)
    assert not report.ok
    slow = {r.lookup: r for r in report.lookups if not r.uses_index}
    # the tracking's question of each insert (by message id) sorts the session the window
    # reads whole
    assert sorted(slow) == ["message_before", "message_by_id", "messages_by_run"]
    assert slow.pop("message_before").sorts
    for lookup in slow.values():
        assert lookup.view == "compaction.source_messages"
        assert lookup.unindexed_table == "public.agent_messages"
        assert lookup.advice is not None
        assert "LATERAL" in lookup.advice
    assert len(report.problems) == 3
    assert all(p.startswith("compaction.source_messages: the lookup by ")
               for p in report.problems)
    assert report.samples == []  # not judged through a view that reads the table whole

    install_agents_sqlalchemy(sdk)  # the recipe puts the fast views back
    again = check_source(sdk)
    assert again.ok, (again.problems, again.lookups)


def test_check_source_names_a_seq_no_index_orders(sdk: Conn) -> None:
    """A table tracked by message id asks on every insert for the message just before the
    new ones, newest first by seq. check-source probes that question too (only where such
    a table is tracked), with sorting disabled besides sequential scans: a sort left in
    that plan is one no index can spare, whatever the table's size."""
    write(sdk, "o1", user("Q"), said("A"), user("Q2"), said("A2"))
    report = check_source(sdk)
    assert report.ok, report.problems
    [before] = [r for r in report.lookups if r.lookup == "message_before"]
    assert (before.view, before.column, before.uses_index) == (
        "compaction.source_messages", "seq", True)

    sdk.execute("DROP INDEX public.pycompactor_agent_messages_seq_idx")
    report = check_source(sdk)
    assert not report.ok
    [before] = [r for r in report.lookups if r.lookup == "message_before"]
    assert before.sorts
    assert not before.uses_index
    assert before.unindexed_table == "public.agent_messages"
    [problem] = report.problems
    assert problem.startswith("compaction.source_messages: the lookup by seq (message_before)"
                              " has no index in its order: it sorts a conversation of"
                              " public.agent_messages whole"), problem
    assert "(session_id, (id::bigint))" in problem, problem
    assert "(m.id)::bigint" in problem, problem  # the sort's key, as the plan names it

    # With no table tracked by message id (the recipe's tracking detached), nothing asks
    # it: not probed.
    sdk.execute("SELECT compaction.detach_source_tracking('public.agent_messages')")
    assert "message_before" not in [r.lookup for r in check_source(sdk).lookups]


def test_check_source_names_the_missing_index(sdk: Conn) -> None:
    write(sdk, "i1", user("Q"), said("A"))
    sdk.execute("DROP INDEX public.pycompactor_agent_messages_id_text_idx")
    report = check_source(sdk)
    [slow] = [r for r in report.lookups if not r.uses_index]
    assert slow.lookup == "message_by_id"
    assert slow.advice is not None
    assert "an index on public.agent_messages (((id)::text))" in slow.advice, slow.advice


# --- tracking by message id: random writes stay exact -----------------------------------

ITEMS = {"user": user("Q 基金？"), "said": said("A: 净值 1.5"), "call": CALL,
         "output": OUTPUT, "reasoning": REASONING, "interim": said("working on it")}
KIND = st.sampled_from(sorted(ITEMS))
WRITES = st.lists(st.one_of(
    st.tuples(st.just("append"), st.lists(KIND, min_size=1, max_size=3)),
    st.tuples(st.just("insert_between"), st.integers(0, 99), KIND),
    st.tuples(st.just("update"), st.integers(0, 99), KIND),
    st.tuples(st.just("delete"), st.integers(0, 99)),
), min_size=1, max_size=14)
_SESSIONS = iter(range(10**6))


@settings(deadline=None, database=None, max_examples=40,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.lists(KIND, min_size=0, max_size=40), writes=WRITES)
def test_tracking_by_message_id_stays_exact_under_any_write(
        sdk: Conn, start: list[str], writes: list[Any]) -> None:
    """Appends re-derive only their runs (and the run before them); inserts between old
    items, role-changing updates and deletes must leave the derived state equal to the
    views' judgement (verify_conversation) after every statement."""
    session = f"p{next(_SESSIONS)}"
    ids: list[int] = []

    def insert(pairs: list[tuple[int, str]]) -> None:
        sdk.execute("INSERT INTO public.agent_sessions (session_id) VALUES (%s)"
                    " ON CONFLICT DO NOTHING", (session,))
        with sdk.cursor() as cur:
            cur.execute(
                "INSERT INTO public.agent_messages (id, session_id, message_data)"
                " SELECT i, %s, d FROM unnest(%s::int[], %s::text[]) AS x (i, d)",
                (session, [i for i, _ in pairs], [json.dumps(ITEMS[k]) for _, k in pairs]))
        ids.extend(i for i, _ in pairs)
        ids.sort()

    def check() -> None:
        assert sdk.execute("SELECT * FROM compaction.verify_conversation(%s)",
                           (session,)).fetchall() == []

    base = 10**6 * (next(_SESSIONS) + 1)  # explicit ids, far apart per example
    insert([(base + 1000 * n, kind) for n, kind in enumerate(start)] if start else [])
    check()
    for write in writes:
        if write[0] == "append":
            top = ids[-1] if ids else base
            insert([(top + 1000 * (n + 1), kind) for n, kind in enumerate(write[1])])
        elif write[0] == "insert_between" and len(ids) >= 2:
            k = write[1] % (len(ids) - 1)
            if ids[k + 1] - ids[k] > 1:
                insert([((ids[k] + ids[k + 1]) // 2, write[2])])
        elif write[0] == "update" and ids:
            sdk.execute("UPDATE public.agent_messages SET message_data = %s WHERE id = %s",
                        (json.dumps(ITEMS[write[2]]), ids[write[1] % len(ids)]))
        elif write[0] == "delete" and ids:
            gone = ids.pop(write[1] % len(ids))
            sdk.execute("DELETE FROM public.agent_messages WHERE id = %s", (gone,))
        check()


def test_an_item_inserted_inside_a_run_rederives_the_run_it_cut(sdk: Conn) -> None:
    """A user item inserted between a run's question and its answer starts a new run
    that takes the answer: the run it cut (the run before the new item) loses its pair."""
    sdk.execute("INSERT INTO public.agent_sessions (session_id) VALUES ('cut')")
    for item_id, item in ((1000, user("Q1")), (3000, said("A1"))):
        sdk.execute("INSERT INTO public.agent_messages (id, session_id, message_data)"
                    " VALUES (%s, 'cut', %s)", (item_id, json.dumps(item)))
    assert [p.user_message_id for p in db.eligible_pairs(sdk, "cut")] == ["1000"]
    sdk.execute("INSERT INTO public.agent_messages (id, session_id, message_data)"
                " VALUES (2000, 'cut', %s)", (json.dumps(user("Q2")),))
    assert [p.user_message_id for p in db.eligible_pairs(sdk, "cut")] == ["2000"]
    assert sdk.execute("SELECT * FROM compaction.verify_conversation('cut')").fetchall() == []
    assert sdk.execute("SELECT compaction.derived_state_status()").fetchone() == ("in_use",)


# --- installing onto a live table -------------------------------------------------------


def test_install_lets_the_applications_writes_through(dsn: str, conn: Conn) -> None:
    """The recipe builds its indexes CONCURRENTLY and attaches the tracking waiting at
    most 50 ms at a time: while it waits for a transaction that is writing the table,
    another write goes through at once (a plain CREATE INDEX would queue it behind)."""
    conn.execute(SDK_TABLES_DDL)
    for i in range(3):
        write(conn, "live", user(f"Q{i}"), said(f"A{i}"))
    failure: list[BaseException] = []
    with psycopg.connect(dsn) as open_writer, \
            psycopg.connect(dsn, autocommit=True) as installer, \
            psycopg.connect(dsn, autocommit=True) as next_writer:
        write(open_writer, "live", user("Q3"))  # its transaction stays open
        pid = installer.info.backend_pid

        def install() -> None:
            try:
                install_agents_sqlalchemy(installer)
            except BaseException as exc:  # handed to the test's thread
                failure.append(exc)

        thread = threading.Thread(target=install)
        thread.start()
        # The barrier: the installation waits for the open writer.
        while pid not in [int(p) for (p,) in conn.execute(
                "SELECT pid FROM pg_catalog.pg_locks WHERE NOT granted")]:
            assert thread.is_alive(), failure
        next_writer.execute("SET lock_timeout = '1s'")
        write(next_writer, "live", user("Q-other"), said("A-other"))
        open_writer.commit()
        thread.join()
    assert failure == []
    assert check_source(conn).ok
    assert [p.user_content for p in db.eligible_pairs(conn, "live")] == [
        "Q0", "Q1", "Q2", "Q-other"]


def test_indexes_build_without_parallel_workers_and_the_setting_comes_back(conn: Conn) -> None:
    """Parallel workers would take the application's cores during the builds; the
    connection is the caller's, so its own setting is back afterwards. An event trigger
    records the setting each CREATE INDEX ran under (CONCURRENTLY ones included)."""
    conn.execute(SDK_TABLES_DDL)
    conn.execute("CREATE TABLE public.build_settings (workers text NOT NULL)")
    conn.execute("""
        CREATE FUNCTION public.note_build_setting() RETURNS event_trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO public.build_settings
            VALUES (pg_catalog.current_setting('max_parallel_maintenance_workers'));
        END $$""")
    conn.execute("CREATE EVENT TRIGGER note_build_setting ON ddl_command_end"
                 " WHEN TAG IN ('CREATE INDEX') EXECUTE FUNCTION public.note_build_setting()")
    conn.execute("SET max_parallel_maintenance_workers = 3")
    try:
        install_agents_sqlalchemy(conn)
    finally:
        conn.execute("DROP EVENT TRIGGER note_build_setting")
    assert conn.execute("SELECT workers FROM public.build_settings").fetchall() == [("0",)] * 4
    assert conn.execute("SHOW max_parallel_maintenance_workers").fetchone() == ("3",)



def messages_read(reader: Conn, rebuilder: Conn) -> int:
    """Rows of public.agent_messages read so far (sequential and by index), the
    rebuilder's included: its counters are flushed before its next ReadyForQuery."""
    rebuilder.execute("SELECT pg_stat_force_next_flush()")
    reader.execute("SELECT pg_stat_clear_snapshot()")
    row = reader.execute(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)"
        " FROM pg_stat_user_tables WHERE relid = 'public.agent_messages'::regclass").fetchone()
    assert row is not None
    return int(row[0])


def seed_sessions(conn: Conn, first: int, count: int) -> None:
    """count sessions of three turns each (a user message and a reply), written with COPY."""
    with conn.cursor() as cur:
        with cur.copy("COPY public.agent_sessions (session_id) FROM STDIN") as copy:
            for s in range(first, first + count):
                copy.write_row((f"s{s:05d}",))
        with cur.copy("COPY public.agent_messages (session_id, message_data) FROM STDIN") as copy:
            for s in range(first, first + count):
                for t in range(3):
                    for item in (user(f"Q{s}.{t}"), said(f"A{s}.{t}")):
                        copy.write_row((f"s{s:05d}", json.dumps(item, separators=(",", ":"))))


def test_the_rebuild_reads_the_messages_linearly(conn: Conn, dsn: str) -> None:
    """The rebuild steps to the next conversation by an ordered read of one
    row. Over this recipe's views (a run is its user message, among all messages) a
    min() would read every message after the resume point at each step: twice the
    sessions, four times the reads. Counted in rows read, not timed."""
    conn.execute(SDK_TABLES_DDL)
    seed_sessions(conn, 0, 150)
    install_agents_sqlalchemy(conn, rebuild=False)
    with psycopg.connect(dsn, autocommit=True) as reader:
        reads = []
        for first in (150, 300):  # 150 sessions, then 300 sessions in all
            before = messages_read(reader, conn)
            conn.execute("CALL compaction.rebuild_derived_state(p_restart => true)")
            reads.append(messages_read(reader, conn) - before)
            if first == 150:
                seed_sessions(conn, first, 150)
    assert conn.execute("SELECT count(*) FROM compaction.conversation_state").fetchone() \
        == (300,)
    # linear: twice the sessions, about twice the rows read (quadratic gave four times)
    assert reads[1] <= 2.5 * reads[0], reads


# --- runs, roles and texts by the recipe's rules; a projection's texts read ----------

REFUSED = {"id": "__fake_id__", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
IMAGE_ONLY = {"role": "user", "type": "message",
              "content": [{"type": "input_image", "image_url": "x"}]}
NO_PARTS = {"role": "assistant", "type": "message", "content": []}
MIXED = {"role": "assistant", "type": "message",
         "content": [{"type": "output_text", "text": "First."},
                     {"type": "refusal", "refusal": "Not that."},
                     {"type": "output_text", "text": "Last."}]}
SPEC_ITEMS = {**ITEMS, "two_parts": said("净值 12.50", "（数据截至 3 月）"), "refused": REFUSED,
              "image_only": IMAGE_ONLY, "no_parts": NO_PARTS, "mixed": MIXED,
              "bare_part": {"role": "assistant", "type": "message", "content": ["not a part"]},
              "system": {"role": "system", "content": "你是基金助手。"}}


def expected_rows(items: list[tuple[int, dict[str, Any]]]) -> list[tuple[Any, ...]]:
    """The recipe's rules in plain Python: a run is a user item and every item after it up
    to the next user item; a run's last assistant message is its answer, earlier ones are
    interim; an item of no run keeps its role; a message's text is its string content or
    its text and refusal parts joined by newlines."""
    rows: list[tuple[Any, ...]] = []
    run: str | None = None
    for position, (item_id, item) in enumerate(items):
        is_message = item.get("type", "message") == "message"
        role = item.get("role") if is_message else None
        if role == "user":
            run = str(item_id)
        if role == "assistant" and run is not None:
            rest = [i for _, i in items[position + 1:]]
            ends = next((k for k, i in enumerate(rest)
                         if i.get("type", "message") == "message" and i.get("role") == "user"),
                        len(rest))
            if any(i.get("type", "message") == "message" and i.get("role") == "assistant"
                   for i in rest[:ends]):
                role = "assistant_interim"
        content = item.get("content")
        if not is_message or role is None:
            text = None  # an item's JSON: compared as JSON below
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict)]
            text = "\n".join(p["text"] if isinstance(p.get("text"), str) else p["refusal"]
                             for p in parts
                             if isinstance(p.get("text"), str) or isinstance(p.get("refusal"), str))
        else:
            text = ""
        rows.append((str(item_id), run, role or "sdk_item", text))
    return rows


@settings(deadline=None, database=None, max_examples=40,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(sorted(SPEC_ITEMS)), min_size=1, max_size=25))
def test_the_views_follow_the_recipes_rules(sdk: Conn, kinds: list[str]) -> None:
    """Runs, roles and texts, by the rules the recipe states, on any sequence of items:
    interim answers, items before the first user item, part lists of every shape (one
    part is read in place, several are joined by a function: both must agree)."""
    session = f"v{next(_SESSIONS)}"
    items = list(zip(write(sdk, session, *(SPEC_ITEMS[k] for k in kinds)),
                     (SPEC_ITEMS[k] for k in kinds), strict=True))
    rows = [(m, r, role, text) for m, r, role, _, text in messages(sdk, session)]
    want = expected_rows(items)
    assert [row[:3] for row in rows] == [row[:3] for row in want]
    for (_, _, _, text), (_, _, _, wanted), (_, item) in zip(rows, want, items, strict=True):
        assert (json.loads(text) == item) if wanted is None else (text == wanted)


def test_a_text_is_read_in_place_not_by_a_function_call(sdk: Conn) -> None:
    """What a projection asks of the view for each message it includes: its text, by id.
    The text comes from an expression the planner inlines into the plan; an SQL function
    that the plan had to call once per message cost about as much as the rest of the read
    (docs/benchmarks.md, the Agents SDK recipe's projection). Only a content of several
    parts is joined by a function, which must aggregate."""
    write(sdk, "t1", user("Q"), said("A"))
    row = sdk.execute(
        "EXPLAIN (VERBOSE, FORMAT JSON) SELECT sm.message_id, sm.content"
        " FROM compaction.source_messages AS sm"
        " WHERE sm.conversation_id = %s AND sm.message_id = %s", ("t1", "2")).fetchone()
    assert row is not None
    plan = json.dumps(row[0])
    assert "pycompactor_agent_messages_content" not in plan
    assert "pycompactor_agent_messages_parts" in plan  # the several-part case, not inlined
    assert [r[4] for r in messages(sdk, "t1")] == ["Q", "A"]


# --- an append to a short and to a long session: what the tracking reads ------------


def role_index_scans(reader: Conn) -> int:
    """Scans of the recipe's role index so far (each probe for an item's run or role is
    one)."""
    row = reader.execute(
        "SELECT idx_scan FROM pg_stat_user_indexes"
        " WHERE indexrelid = 'public.pycompactor_agent_messages_role_idx'::regclass").fetchone()
    assert row is not None
    return int(row[0])


def index_entries_read(reader: Conn) -> int:
    """Index entries of public.agent_messages read so far, by every index of it."""
    row = reader.execute(
        "SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes"
        " WHERE relid = 'public.agent_messages'::regclass").fetchone()
    assert row is not None
    return int(row[0])


def per_append(conn: Conn, dsn: str, counter: Callable[[Conn], int]) -> dict[str, int]:
    """`counter`'s growth over one append (a turn, in one statement) to a session of 60
    items and to one of 600, among a thousand sessions of six items (on a table of two
    sessions the planner reads a session whole for any question, which costs nothing
    there). Each is appended to twice; the second append is counted (first plans made)."""
    conn.execute(SDK_TABLES_DDL)
    seed_sessions(conn, 0, 1000)
    install_agents_sqlalchemy(conn)
    for session, turns in (("short", 30), ("long", 300)):
        write(conn, session, *[item for t in range(turns)
                               for item in (user(f"Q{t}"), said(f"A{t}"))])
    conn.execute("ANALYZE public.agent_messages")
    grown: dict[str, int] = {}
    with psycopg.connect(dsn, autocommit=True) as reader, \
            psycopg.connect(dsn, autocommit=True) as writer:
        def count() -> int:
            writer.execute("SELECT pg_stat_force_next_flush()")  # the writer's counters too
            reader.execute("SELECT pg_stat_clear_snapshot()")
            return counter(reader)

        for session in ("short", "long", "short", "long"):
            before = count()
            with writer.transaction():
                writer.execute(
                    "INSERT INTO public.agent_messages (session_id, message_data)"
                    " VALUES (%(s)s, %(q)s), (%(s)s, %(a)s)",
                    {"s": session, "q": json.dumps(user("Q+")), "a": json.dumps(said("A+"))})
            grown[session] = count() - before
    assert conn.execute("SELECT * FROM compaction.verify_conversation('long')").fetchall() == []
    return grown


def test_an_append_works_out_the_runs_of_a_few_items_however_long_the_session(
        conn: Conn, dsn: str) -> None:
    """The tracking asks which item comes just before an append's first new item, newest
    first by the views' seq (the run it may have cut short). Ordered by the view's
    expression, that question sorted the session whole, each item's run and role worked
    out (probes of the role index) first, on every append: a session ten times longer
    probed ten times as often (12 ms an append at 740 items). The recipe's index on
    (session_id, id::bigint) answers it from the session's end. Counted, not timed."""
    probes = per_append(conn, dsn, role_index_scans)
    assert probes["long"] <= probes["short"] + 5, probes
    assert probes["long"] < 100, probes


def test_an_append_reads_as_many_index_entries_however_long_the_session(
        conn: Conn, dsn: str) -> None:
    """The tracking looks each new item up by its id on its own. Asked as
    "these ids of this session" under its generic plan, it would read the session's prefix
    of an index (every item of the session, twice an insert) wherever sessions are short on
    average. Counted, not timed."""
    entries = per_append(conn, dsn, index_entries_read)
    assert entries["long"] <= entries["short"] + 10, entries
