"""contract §3: which runs form pairs. One test per rule and exclusion."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db
from tests.history import History

Conn = psycopg.Connection[Any]


def run_ids(conn: Conn, conversation_id: str = "c") -> list[str]:
    return [p.run_id for p in db.eligible_pairs(conn, conversation_id)]


def reasons(conn: Conn, conversation_id: str = "c") -> dict[str, str | None]:
    return {v.run_id: v.reason for v in db.explain_runs(conn, conversation_id)}


@pytest.mark.parametrize("status", ["completed", "partial", "clarify_pending"])
def test_allowed_run_statuses_form_pairs(conn: Conn, status: str) -> None:
    pair = History(conn).pair("c", run_status=status)
    assert run_ids(conn) == [pair.run_id]


@pytest.mark.parametrize(
    "status", ["failed", "running", "cancelled", "Completed", "COMPLETED", " completed", ""]
)
def test_other_run_statuses_are_excluded_case_sensitively(conn: Conn, status: str) -> None:
    pair = History(conn).pair("c", run_status=status)
    assert run_ids(conn) == []
    assert reasons(conn) == {pair.run_id: "run_status"}


@pytest.mark.parametrize("status", ["streaming", "failed", "cancelled", "Completed"])
def test_assistant_must_be_completed(conn: Conn, status: str) -> None:
    pair = History(conn).pair("c", assistant_status=status)
    assert run_ids(conn) == []
    assert reasons(conn) == {pair.run_id: "assistant_not_completed"}


def test_user_message_status_is_not_considered(conn: Conn) -> None:
    h = History(conn)
    run = h.run("c")
    h.message("c", run, "user", "hello", status="whatever")
    h.message("c", run, "assistant", "hi")
    assert run_ids(conn) == [run]


@pytest.mark.parametrize(("messages", "reason"), [
    pytest.param([("user", "q", "completed"), ("assistant", "done", "completed"),
                  ("assistant", "still typ", "streaming")], "multiple_assistant_messages",
                 id="completed_plus_streaming_assistant_is_ambiguous"),
    pytest.param([("user", "q", "completed"), ("assistant", "a1", "completed"),
                  ("assistant", "a2", "completed")], "multiple_assistant_messages",
                 id="two_completed_assistant_messages"),
    pytest.param([("user", "q1", "completed"), ("user", "q2", "completed"),
                  ("assistant", "a", "completed")], "multiple_user_messages",
                 id="two_user_messages"),
])
def test_a_run_with_these_messages_is_excluded(conn: Conn, messages: list[tuple[str, str, str]],
                                               reason: str) -> None:
    h = History(conn)
    run = h.run("c")
    for role, content, status in messages:
        h.message("c", run, role, content, status=status)
    assert run_ids(conn) == []
    assert reasons(conn) == {run: reason}


def test_run_without_user_or_assistant(conn: Conn) -> None:
    h = History(conn)
    only_user = h.run("c")
    h.message("c", only_user, "user", "q")
    only_assistant = h.run("c")
    h.message("c", only_assistant, "assistant", "a")
    empty = h.run("c")
    assert reasons(conn) == {
        only_user: "no_assistant_message",
        only_assistant: "no_user_message",
        empty: "no_user_message",
    }


def test_message_with_null_run_never_pairs(conn: Conn) -> None:
    h = History(conn)
    h.conversation("c")
    h.message("c", None, "user", "orphan question")
    h.message("c", None, "assistant", "orphan answer")
    good = h.pair("c")
    assert run_ids(conn) == [good.run_id]


def test_message_filed_under_another_conversation_breaks_the_run(conn: Conn) -> None:
    h = History(conn)
    h.conversation("other")
    run = h.run("c")
    h.message("c", run, "user", "q")
    h.message("other", run, "assistant", "a")
    assert run_ids(conn) == []
    assert run_ids(conn, "other") == []
    assert reasons(conn) == {run: "foreign_message"}


def test_user_message_filed_elsewhere_also_breaks_the_run(conn: Conn) -> None:
    h = History(conn)
    h.conversation("other")
    run = h.run("c")
    h.message("other", run, "user", "q")
    h.message("c", run, "assistant", "a")
    assert reasons(conn) == {run: "foreign_message"}


@pytest.mark.parametrize("runs", [256, 257])
def test_a_reply_filed_elsewhere_is_found_in_a_conversation_of_any_size(
        conn: Conn, runs: int) -> None:
    """judge_runs asks the question across conversations with a whole conversation's runs
    as a value up to 256 runs, and by subquery above: both forms."""
    h = History(conn)
    pairs = h.pairs("c", runs)
    h.conversation("other")
    stray = pairs[runs // 2].run_id
    h.message("other", stray, "assistant", "a reply filed under another conversation")
    judged = conn.execute("SELECT run_id, reason FROM compaction.judge_runs('c')"
                          " WHERE reason IS NOT NULL").fetchall()
    assert judged == [(stray, "foreign_message")]
    assert len(run_ids(conn)) == runs - 1


@pytest.mark.parametrize("runs", [256, 257])
def test_a_message_of_another_conversations_own_run_of_that_id_breaks_nothing(
        conn: Conn, runs: int) -> None:
    """Contract §3: a message whose own conversation has a run of that id
    belongs to that run; only a foreign one (its conversation has no such run) breaks the
    run elsewhere. Both forms of judge_runs' question (a value, a subquery)."""
    h = History(conn)
    pairs = h.pairs("c", runs)
    shared = pairs[runs // 2].run_id
    h.run("other", run_id=shared)
    h.message("other", shared, "assistant", "a reply of other's own run of that id")
    judge = ("SELECT run_id, reason FROM compaction.judge_runs('c')"
             " WHERE reason IS NOT NULL")
    assert conn.execute(judge).fetchall() == []
    assert len(run_ids(conn)) == runs
    assert reasons(conn, "other") == {shared: "no_user_message"}
    h.message("third", shared, "user", "filed where no run of that id is")
    assert conn.execute(judge).fetchall() == [(shared, "foreign_message")]
    assert reasons(conn, "other") == {shared: "foreign_message"}


@pytest.mark.parametrize("blank", ["", " ", "\t", "\n", "\r\n", "\f", "\v", " \t\n\r\f\v "])
def test_ascii_whitespace_only_content_is_empty(conn: Conn, blank: str) -> None:
    h = History(conn)
    user_blank = h.pair("c", user=blank)
    assistant_blank = h.pair("c", assistant=blank)
    assert run_ids(conn) == []
    assert reasons(conn) == {
        user_blank.run_id: "empty_user_content",
        assistant_blank.run_id: "empty_assistant_content",
    }


@pytest.mark.parametrize("text", ["\u00a0", "\u3000", "\u200b", "\ufeff", " \u00a0 ", "\x1c"])
def test_other_whitespace_counts_as_content(conn: Conn, text: str) -> None:
    pair = History(conn).pair("c", user=text, assistant=text)
    assert run_ids(conn) == [pair.run_id]


def test_tool_system_and_other_roles_are_ignored(conn: Conn) -> None:
    h = History(conn)
    run = h.run("c")
    h.message("c", run, "system", "you are helpful")
    h.message("c", run, "user", "q")
    h.message("c", run, "tool", "tool output")
    h.message("c", run, "trace", "debug")
    h.message("c", run, "developer", "note")
    h.message("c", run, "assistant", "a")
    h.message("c", run, "Assistant", "not the assistant role")
    pairs = db.eligible_pairs(conn, "c")
    assert [(p.user_content, p.assistant_content) for p in pairs] == [("q", "a")]


def test_runs_of_other_conversations_do_not_leak(conn: Conn) -> None:
    h = History(conn)
    mine = h.pair("c")
    h.pair("d")
    assert run_ids(conn) == [mine.run_id]


def test_unknown_conversation_has_no_pairs(conn: Conn) -> None:
    assert db.eligible_pairs(conn, "nope") == []
    assert db.explain_runs(conn, "nope") == []


def test_pairs_are_ordered_by_user_seq_then_message_id(conn: Conn) -> None:
    h = History(conn)
    # seq decides first, whatever the insertion order or the assistant's seq
    late = h.run("c")
    h.message("c", late, "user", "late", seq=50, message_id="m-a")
    h.message("c", late, "assistant", "x", seq=1)
    early = h.run("c")
    h.message("c", early, "user", "early", seq=10, message_id="m-z")
    h.message("c", early, "assistant", "y", seq=99)
    # equal seq: message_id breaks the tie
    tie_b = h.run("c")
    h.message("c", tie_b, "user", "tie b", seq=20, message_id="m-b")
    h.message("c", tie_b, "assistant", "z", seq=21)
    tie_a = h.run("c")
    h.message("c", tie_a, "user", "tie a", seq=20, message_id="m-a2")
    h.message("c", tie_a, "assistant", "w", seq=22)
    pairs = db.eligible_pairs(conn, "c")
    assert [p.user_content for p in pairs] == ["early", "tie a", "tie b", "late"]
    assert [p.pair_index for p in pairs] == [0, 1, 2, 3]


def test_excluded_runs_do_not_consume_pair_indices(conn: Conn) -> None:
    h = History(conn)
    first = h.pair("c")
    h.pair("c", run_status="failed")
    third = h.pair("c")
    pairs = db.eligible_pairs(conn, "c")
    assert [(p.pair_index, p.run_id) for p in pairs] == [(0, first.run_id), (1, third.run_id)]


def test_pair_carries_exact_ids_and_texts(conn: Conn) -> None:
    pair = History(conn).pair("c", user="Grüße 你好 🎉", assistant="e\u0301 vs \u00e9")
    (got,) = db.eligible_pairs(conn, "c")
    assert (got.user_message_id, got.user_content, got.assistant_message_id,
            got.assistant_content) == (pair.user_message_id, "Grüße 你好 🎉",
                                       pair.assistant_message_id, "e\u0301 vs \u00e9")
