"""docs/integrating.md's worked example, run verbatim: a host schema with uuid/bigint ids,
other column names and an int position, mapped by re-pointing the source views."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pycompactor import db, source_hash
from pycompactor.cli.source import check_source

Conn = psycopg.Connection[Any]
DOC = Path(__file__).resolve().parents[2] / "docs" / "integrating.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```sql\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/integrating.md lost its {name} example"
    return match.group(1)


def run_example(conn: Conn, name: str) -> None:
    """A block as psql runs it: one statement at a time, each its own transaction (CREATE
    INDEX CONCURRENTLY refuses a transaction block, and a multi-statement string is one)."""
    text = re.sub(r"^\s*--[^\n]*\n", "", example(name), flags=re.M)
    for statement in re.split(r";\s*\n", text):
        if statement.strip():
            conn.execute(statement.encode())


#: Every block of the worked example, in the order the page gives them.
STEPS = ("host-schema", "grants-and-indexes", "statistics", "repoint", "tracking", "rebuild")


@pytest.fixture
def host(conn: Conn) -> Conn:
    for name in STEPS:
        run_example(conn, name)
    return conn


#: The worked example's indexes as a DBA built them from the old page: no index on the
#: run id the tracking triggers look runs up by, indexes that block writes while they build, and no
#: ANALYZE (so no statistics on the fresh expression indexes).
INDEXES_WITHOUT_RUN_ID_INDEX = """
GRANT USAGE ON SCHEMA agent TO compaction_owner;
GRANT SELECT ON agent.turns, agent.chat_messages TO compaction_owner;
CREATE INDEX turns_thread_text_idx ON agent.turns ((thread_id::text));
CREATE INDEX chat_messages_turn_text_idx ON agent.chat_messages ((turn::text));
CREATE INDEX chat_messages_id_text_idx ON agent.chat_messages ((id::text));
"""


def load_history(conn: Conn, threads: int, turns: int) -> None:
    """A host's existing history, written before pycompactor arrives: 4 messages a turn
    (system, human, tool, ai), bodies of 200 bytes. Autovacuum is off on these tables so
    that no ANALYZE runs behind the test's back: on a live host it comes, but later."""
    for table in ("threads", "turns", "chat_messages"):
        conn.execute(f"ALTER TABLE agent.{table} SET (autovacuum_enabled = off)")
    conn.execute("INSERT INTO agent.threads (id, title)"
                 " SELECT gen_random_uuid(), 'thread ' || g FROM generate_series(1, %s) AS g",
                 (threads,))
    conn.execute("INSERT INTO agent.turns (turn_id, thread_id, state)"
                 " SELECT gen_random_uuid(), t.id, 'done'"
                 " FROM agent.threads AS t, generate_series(1, %s)", (turns,))
    conn.execute("""
        INSERT INTO agent.chat_messages (thread, turn, author, lifecycle, body, position)
        SELECT u.thread_id, u.turn_id, a.author, 'final', repeat(a.author, 40),
               (row_number() OVER (PARTITION BY u.thread_id ORDER BY u.turn_id, a.ord))::int
        FROM agent.turns AS u,
             (VALUES ('system', 1), ('human', 2), ('tool', 3), ('ai', 4)) AS a (author, ord)
    """)


def add_turn(conn: Conn, thread: uuid.UUID, position: int, *, state: str = "done",
             human: str = "question", ai: str = "answer", lifecycle: str = "final",
             ) -> tuple[str, str, str]:
    turn = uuid.uuid4()
    conn.execute("INSERT INTO agent.turns VALUES (%s, %s, %s)", (turn, thread, state))
    ids = []
    for offset, (author, body, life) in enumerate(
        [("system", "be brief", "final"), ("human", human, "final"), ("tool", "{}", "final"),
         ("ai", ai, lifecycle)]
    ):
        row = conn.execute(
            "INSERT INTO agent.chat_messages (thread, turn, author, lifecycle, body, position)"
            " VALUES (%s, %s, %s, %s, %s, %s) RETURNING id",
            (thread, turn, author, life, body, position * 10 + offset),
        ).fetchone()
        assert row is not None
        ids.append(str(row[0]))
    return str(turn), ids[1], ids[3]


def test_repointed_views_keep_the_contract(host: Conn) -> None:
    report = check_source(host)
    assert report.problems == []
    assert report.derived_state == "in_use"


def test_check_source_names_the_missing_run_index_and_statistics(conn: Conn) -> None:
    """The worked example as a DBA built it (existing history, the indexes of
    the old page, no ANALYZE), before tracking is attached: check-source names the index
    the tracking triggers need (runs by run id) and the missing statistics, each with the
    statement that fixes it; those statements (`check-source --fix`) make it clean."""
    run_example(conn, "host-schema")
    load_history(conn, threads=200, turns=10)
    conn.execute(INDEXES_WITHOUT_RUN_ID_INDEX)
    run_example(conn, "repoint")
    report = check_source(conn)
    assert report.derived_state == "untracked"
    by_name = {r.lookup: r for r in report.lookups}
    assert list(by_name) == ["runs_by_conversation", "run_by_id", "messages_by_run",
                             "message_by_id"]
    run = by_name["run_by_id"]
    assert not run.uses_index
    assert run.unindexed_table == "agent.turns"
    assert run.fix == "CREATE INDEX CONCURRENTLY ON agent.turns (((turn_id)::text));"
    assert by_name["messages_by_run"].unanalyzed_table == "agent.chat_messages"
    assert by_name["message_by_id"].unanalyzed_table == "agent.chat_messages"
    assert by_name["runs_by_conversation"].problem() is None  # a small table: no matter
    assert len(report.problems) == 3
    assert report.problems[0].startswith(
        "compaction.source_runs: the lookup by run_id (run_by_id) uses no index:"
        " it reads agent.turns whole")
    assert "has no planner statistics" in report.problems[1]
    assert "ANALYZE agent.chat_messages" in report.problems[1]
    assert report.fixes == ["CREATE INDEX CONCURRENTLY ON agent.turns (((turn_id)::text));",
                            "ANALYZE agent.chat_messages;"]
    for statement in report.fixes:
        conn.execute(statement.encode())
    report = check_source(conn)
    assert report.problems == []
    assert all(r.uses_index and r.unanalyzed_table is None for r in report.lookups)


def test_the_worked_example_on_existing_history_checks_clean(conn: Conn) -> None:
    """The page's own steps, on a host with history: nothing for check-source to name."""
    run_example(conn, "host-schema")
    load_history(conn, threads=200, turns=10)
    for name in STEPS[1:4]:
        run_example(conn, name)
    report = check_source(conn)
    assert report.problems == []
    assert len(report.lookups) == 4
    for name in STEPS[4:]:
        run_example(conn, name)
    report = check_source(conn)
    assert report.problems == []
    assert report.derived_state == "in_use"
    thread = report.samples[0].conversation_id
    assert report.samples[0].pairs == 10
    assert conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                        (thread,)).fetchall() == []


def test_writes_between_attaching_and_the_rebuild_are_left_to_it(conn: Conn) -> None:
    """Once the tracking is attached and before the rebuild starts, a write
    derives nothing (a pair derived then would sit ahead of the rebuild in pairs'
    indexes, and every page the rebuild filled before it would split in halves); the
    rebuild derives it with the rest."""
    run_example(conn, "host-schema")
    load_history(conn, threads=20, turns=3)
    for name in STEPS[1:5]:
        run_example(conn, name)
    thread = uuid.UUID(str(conn.execute(
        "SELECT id FROM agent.threads ORDER BY id DESC LIMIT 1").fetchone()[0]))  # type: ignore[index]
    add_turn(conn, thread, 100)
    assert conn.execute("SELECT count(*) FROM compaction.pairs").fetchone() == (0,)
    run_example(conn, "rebuild")
    assert conn.execute("SELECT compaction.derived_state_status()").fetchone() == ("in_use",)
    assert conn.execute("SELECT pair_count FROM compaction.conversation_state"
                        " WHERE conversation_id = %s", (str(thread),)).fetchone() == (4,)
    assert conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                        (str(thread),)).fetchall() == []
    add_turn(conn, thread, 101)  # in use: derived at once
    assert conn.execute("SELECT pair_count FROM compaction.conversation_state"
                        " WHERE conversation_id = %s", (str(thread),)).fetchone() == (5,)


def test_views_without_tracking_are_named_and_still_exact(conn: Conn) -> None:
    for name in ("host-schema", "grants-and-indexes", "statistics", "repoint"):
        run_example(conn, name)
    assert check_source(conn).derived_state == "untracked"
    thread = uuid.uuid4()
    conn.execute("INSERT INTO agent.threads VALUES (%s, 'fees')", (thread,))
    for position in range(31):
        add_turn(conn, thread, position, human=f"q{position}", ai=f"a{position}")
    assert len(db.eligible_pairs(conn, str(thread))) == 31
    assert [t.from_pair for t in db.plan_targets(conn, str(thread))] == [0]
    # Attached afterwards: not used until the rebuild derives the existing history.
    run_example(conn, "tracking")
    assert check_source(conn).derived_state == "not_rebuilt"
    run_example(conn, "rebuild")
    assert check_source(conn).derived_state == "in_use"
    assert conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                        (str(thread),)).fetchall() == []
    # Disabling a trigger (a bulk load without tracking) takes it out of use at once.
    conn.execute("ALTER TABLE agent.chat_messages DISABLE TRIGGER compaction_track_insert")
    assert check_source(conn).derived_state == "untracked"
    add_turn(conn, thread, 31, human="q31", ai="a31")
    assert len(db.eligible_pairs(conn, str(thread))) == 32
    conn.execute("ALTER TABLE agent.chat_messages ENABLE ALWAYS TRIGGER compaction_track_insert")
    assert check_source(conn).derived_state == "not_rebuilt"
    assert conn.execute("SELECT count(*) FROM compaction.verify_conversation(%s)",
                        (str(thread),)).fetchone() != (0,)
    run_example(conn, "rebuild")
    assert check_source(conn).derived_state == "in_use"
    assert len(db.eligible_pairs(conn, str(thread))) == 32
    assert conn.execute("SELECT * FROM compaction.verify_conversation(%s)",
                        (str(thread),)).fetchall() == []


def test_pairs_and_targets_from_the_host_tables(host: Conn) -> None:
    thread = uuid.uuid4()
    host.execute("INSERT INTO agent.threads VALUES (%s, 'fees')", (thread,))
    expected = []
    for i in range(33):
        turn, u, a = add_turn(host, thread, i, human=f"q{i} 你好", ai=f"a{i} NAV")
        expected.append((turn, u, a))
    # exclusions in the host's own vocabulary
    add_turn(host, thread, 100, state="error")
    add_turn(host, thread, 101, lifecycle="streaming")
    add_turn(host, thread, 102, state="needs_clarification", human="which fund?", ai="Cedar?")

    pairs = db.eligible_pairs(host, str(thread))
    assert len(pairs) == 34
    assert [(p.run_id, p.user_message_id, p.assistant_message_id) for p in pairs[:33]] == expected
    assert pairs[33].assistant_content == "Cedar?"
    assert pairs[5].user_content == "q5 你好"

    targets = db.plan_targets(host, str(thread))
    assert [(t.from_pair, t.to_pair) for t in targets] == [(0, 9)]
    assert targets[0].source_message_ids == [i for _, u, a in expected[:10] for i in (u, a)]
    assert targets[0].source_hash == source_hash(pairs[:10])
    assert db.source_hash(host, str(thread), 0) == targets[0].source_hash

    reasons = sorted(v.reason for v in db.explain_runs(host, str(thread)) if v.reason)
    assert reasons == ["assistant_not_completed", "run_status"]


def test_position_orders_pairs_not_insertion(host: Conn) -> None:
    thread = uuid.uuid4()
    host.execute("INSERT INTO agent.threads VALUES (%s, 'order')", (thread,))
    add_turn(host, thread, 7, human="later")
    add_turn(host, thread, 3, human="earlier")
    assert [p.user_content for p in db.eligible_pairs(host, str(thread))] == ["earlier", "later"]


def test_check_source_names_a_mistyped_column(conn: Conn) -> None:
    run_example(conn, "host-schema")
    # The classic mistake: forgetting the casts. PostgreSQL refuses to change the type...
    with pytest.raises(psycopg.errors.InvalidTableDefinition):
        conn.execute(
            "CREATE OR REPLACE VIEW compaction.source_runs AS"
            " SELECT turn_id AS run_id, thread_id::text AS conversation_id, state AS status"
            " FROM agent.turns"
        )
    # ...so a DBA who drops and recreates the view gets caught by check-source instead.
    conn.execute("DROP VIEW compaction.source_runs CASCADE")
    conn.execute(
        "CREATE VIEW compaction.source_runs AS"
        " SELECT turn_id AS run_id, thread_id::text AS conversation_id FROM agent.turns"
    )
    problems = check_source(conn).problems
    assert problems == [
        "compaction.source_runs.run_id is uuid, expected text (cast it in the view: run_id::text)",
        "compaction.source_runs.status is missing (expected text)",
    ]
