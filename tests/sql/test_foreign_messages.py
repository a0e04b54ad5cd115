"""The revised contract §3 (docs/contract.md): a message belongs to its own conversation's
run of its run id; a user or assistant message whose own conversation has no run of that
id is *foreign*, and breaks the run of that id in every conversation that has one. A run id
repeated across conversations, each with its own run, is a pair in each.

Each case is checked against tests/recompute.py's recomputation with the derived state in
use (the reference tables, tracked) and judged from the views (tracking disabled), and
verify_conversation is clean wherever the derived state is kept.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.history import History
from tests.recompute import assert_matches, derived_state_in_use, read_reference

Conn = psycopg.Connection[Any]
RUN = "R-r"
ALL = ["C", "D", "E"]
TRACKING = ["runs_track_insert", "runs_track_update", "runs_track_delete",
            "messages_track_insert", "messages_track_update", "messages_track_delete"]


@pytest.fixture(params=["derived", "views"])
def mode(request: pytest.FixtureRequest, conn: Conn) -> str:
    """derived: the tracked reference tables; views: every read judged from the views."""
    if request.param == "views":
        for trigger in TRACKING:
            table = trigger.split("_", 1)[0]
            conn.execute(f"ALTER TABLE compaction_source.{table} DISABLE TRIGGER {trigger}")
    assert derived_state_in_use(conn) == (request.param == "derived")
    return str(request.param)


def pair_runs(conn: Conn, conversation_id: str) -> list[str]:
    return [p.run_id for p in db.eligible_pairs(conn, conversation_id)]


def paired_in(conn: Conn, *conversations: str) -> list[bool]:
    """Whether R-r is a pair in each conversation."""
    return [RUN in pair_runs(conn, c) for c in conversations]


def reasons(conn: Conn, conversation_id: str) -> dict[str, str | None]:
    return {v.run_id: v.reason for v in db.explain_runs(conn, conversation_id)}


def check(conn: Conn, mode: str) -> None:
    """Every read function equals the recomputation; verify is clean (derived state)."""
    assert_matches(conn, read_reference(conn, ALL), ALL, verified=mode == "derived")


def two_runs_of_one_id(conn: Conn) -> History:
    """C and D each hold a run R-r with its user and assistant message; E holds a pair of
    its own (so it has runs, but none of that id)."""
    h = History(conn)
    for cid in ("C", "D"):
        h.pair(cid)
        h.run(cid, run_id=RUN)
        h.message(cid, RUN, "user", f"question in {cid}", message_id=f"{cid}-u")
        h.message(cid, RUN, "assistant", f"answer in {cid}", message_id=f"{cid}-a")
    h.pair("E")
    return h


def test_a_run_id_in_two_conversations_is_a_pair_in_each_until_a_foreign_message_names_it(
        conn: Conn, mode: str) -> None:
    h = two_runs_of_one_id(conn)
    assert paired_in(conn, "C", "D") == [True, True]
    check(conn, mode)
    stray = h.message("E", RUN, "user", "a question filed under E, which has no run R-r")
    assert paired_in(conn, "C", "D") == [False, False]
    assert reasons(conn, "C")[RUN] == reasons(conn, "D")[RUN] == "foreign_message"
    assert len(pair_runs(conn, "E")) == 1  # E's own pair is untouched
    check(conn, mode)
    conn.execute("DELETE FROM compaction_source.messages WHERE message_id = %s", (stray,))
    assert paired_in(conn, "C", "D") == [True, True]
    check(conn, mode)


def test_a_run_created_after_its_foreign_message_takes_it_over(conn: Conn, mode: str) -> None:
    h = two_runs_of_one_id(conn)
    h.message("E", RUN, "assistant", "a reply waiting for its run")
    assert paired_in(conn, "C", "D") == [False, False]
    check(conn, mode)
    h.run("E", run_id=RUN)  # the message now belongs to (E, R-r)
    assert paired_in(conn, "C", "D") == [True, True]
    assert reasons(conn, "E")[RUN] == "no_user_message"
    check(conn, mode)


def test_a_run_deleted_under_its_messages_makes_them_foreign(conn: Conn, mode: str) -> None:
    two_runs_of_one_id(conn)
    conn.execute("DELETE FROM compaction_source.runs WHERE conversation_id = 'D'"
                 " AND run_id = %s", (RUN,))
    assert RUN not in pair_runs(conn, "C")
    assert reasons(conn, "C")[RUN] == "foreign_message"
    check(conn, mode)
    History(conn).run("D", run_id=RUN)
    assert paired_in(conn, "C", "D") == [True, True]
    check(conn, mode)


def test_a_message_moved_between_conversations_belongs_where_it_lands(
        conn: Conn, mode: str) -> None:
    h = two_runs_of_one_id(conn)
    stray = h.message("E", RUN, "user", "filed under E first")
    check(conn, mode)
    # Into C, which has a run R-r: it belongs there (a second user message), and no
    # longer breaks D's run.
    conn.execute("UPDATE compaction_source.messages SET conversation_id = 'C'"
                 " WHERE message_id = %s", (stray,))
    assert reasons(conn, "C")[RUN] == "multiple_user_messages"
    assert RUN in pair_runs(conn, "D")
    check(conn, mode)
    # C's own user message moved to E: foreign there, it breaks both runs again.
    conn.execute("UPDATE compaction_source.messages SET conversation_id = 'E'"
                 " WHERE message_id = 'C-u'")
    assert reasons(conn, "C")[RUN] == reasons(conn, "D")[RUN] == "foreign_message"
    check(conn, mode)
    # Back home: C has two user messages of R-r, D its pair.
    conn.execute("UPDATE compaction_source.messages SET conversation_id = 'C'"
                 " WHERE message_id = 'C-u'")
    assert reasons(conn, "C")[RUN] == "multiple_user_messages"
    assert RUN in pair_runs(conn, "D")
    check(conn, mode)


def test_one_statement_across_conversations(conn: Conn, mode: str) -> None:
    """A bulk insert naming R-r under C, D and E at once, then one delete of them all."""
    two_runs_of_one_id(conn)
    conn.execute(
        "INSERT INTO compaction_source.messages"
        " (message_id, conversation_id, run_id, role, status, content, seq)"
        " VALUES ('x1', 'C', %s, 'tool', 'completed', 'tool output', 100),"
        "        ('x2', 'E', %s, 'assistant', 'completed', 'stray', 100),"
        "        ('x3', 'D', %s, 'system', 'completed', 'note', 100)", (RUN, RUN, RUN))
    assert paired_in(conn, "C", "D") == [False, False]
    check(conn, mode)
    conn.execute("DELETE FROM compaction_source.messages WHERE message_id IN ('x1', 'x2', 'x3')")
    assert paired_in(conn, "C", "D") == [True, True]
    check(conn, mode)


def test_reads_judge_only_a_conversation_a_foreign_message_names_from_the_views(
        conn: Conn) -> None:
    two_runs_of_one_id(conn)
    serves = "SELECT compaction.derived_state_serves(%s)"
    assert all(conn.execute(serves, (c,)).fetchone() == (True,) for c in ALL)
    History(conn).message("E", RUN, "user", "stray")
    assert [conn.execute(serves, (c,)).fetchone() for c in ALL] == [(False,), (False,), (True,)]
    assert conn.execute("SELECT conversation_id, run_id FROM compaction.foreign_messages"
                        ).fetchall() == [("E", RUN)]


def test_verify_names_a_foreign_message_the_record_lacks_and_a_repair_restores_it(
        conn: Conn) -> None:
    h = two_runs_of_one_id(conn)
    h.message("E", RUN, "user", "stray")
    conn.execute("DELETE FROM compaction.foreign_messages")  # as a superuser may
    problems = conn.execute("SELECT problem FROM compaction.verify_conversation('E')").fetchall()
    assert problems == [("foreign_missing",)]
    conn.execute("SELECT compaction.rederive_conversation('E')")
    assert conn.execute("SELECT * FROM compaction.verify_conversation('E')").fetchall() == []
    conn.execute("INSERT INTO compaction.foreign_messages VALUES ('C', 'nothing')")
    problems = conn.execute("SELECT problem FROM compaction.verify_conversation('C')").fetchall()
    assert problems == [("foreign_extra",)]
