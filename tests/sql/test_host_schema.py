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
from pycompactor.source import check_source

Conn = psycopg.Connection[Any]
DOC = Path(__file__).resolve().parents[2] / "docs" / "integrating.md"


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```sql\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/integrating.md lost its {name} example"
    return match.group(1)


@pytest.fixture
def host(conn: Conn) -> Conn:
    for name in ("host-schema", "grants-and-indexes", "repoint", "tracking", "rebuild"):
        conn.execute(example(name).encode())
    return conn


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


def test_views_without_tracking_are_named_and_still_exact(conn: Conn) -> None:
    for name in ("host-schema", "grants-and-indexes", "repoint"):
        conn.execute(example(name).encode())
    assert check_source(conn).derived_state == "untracked"
    thread = uuid.uuid4()
    conn.execute("INSERT INTO agent.threads VALUES (%s, 'fees')", (thread,))
    for position in range(31):
        add_turn(conn, thread, position, human=f"q{position}", ai=f"a{position}")
    assert len(db.eligible_pairs(conn, str(thread))) == 31
    assert [t.from_pair for t in db.plan_targets(conn, str(thread))] == [0]
    # Attached afterwards: not used until the rebuild derives the existing history.
    conn.execute(example("tracking").encode())
    assert check_source(conn).derived_state == "not_rebuilt"
    conn.execute(example("rebuild").encode())
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
    conn.execute(example("rebuild").encode())
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
    conn.execute(example("host-schema").encode())
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
