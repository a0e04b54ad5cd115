"""`pycompactor import`: one's own export into the reference tables, in batches, idempotent
by ids, analyzed, queued; a malformed line stops it before anything is written; then the
worker summarizes what was imported."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from pycompactor import db
from pycompactor.summarizers.extractive2 import EXTRACTIVE2_MODEL
from tests.e2e.cli import run_cli

Conn = psycopg.Connection[Any]


def export(path: Path, conversations: int = 20, pairs: int = 50) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for c in range(conversations):
            out.write(json.dumps({
                "conversation_id": f"conv-{c:02d}", "language": "en",
                "pairs": [{"user": f"How is fund F{p} doing?",
                           "assistant": f"Fund F{p} closed at NAV {10 + p}.25"
                                        f" on 2026-10-0{1 + p % 9}."}
                          for p in range(pairs)]}) + "\n")
    return path


def counts(conn: Conn) -> tuple[int, int, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM compaction_source.conversations),"
        " (SELECT count(*) FROM compaction_source.runs),"
        " (SELECT count(*) FROM compaction_source.messages)").fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_import_is_idempotent_analyzed_queued_and_the_worker_summarizes_it(
        conn: Conn, dsn: str, tmp_path: Path) -> None:
    path = export(tmp_path / "history.jsonl")
    result = run_cli("import", str(path), "--batch-size", "30", "--json", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar off a terminal
    assert json.loads(result.stdout) == {
        "conversations": 20, "runs_written": 1000, "messages_written": 2000,
        "runs_present": 0, "messages_present": 0, "scope": "default"}
    assert counts(conn) == (20, 1000, 2000)
    assert [len(db.eligible_pairs(conn, f"conv-{c:02d}")) for c in range(20)] == [50] * 20
    analyzed = conn.execute(
        "SELECT relname FROM pg_stat_user_tables WHERE schemaname = 'compaction_source'"
        " AND last_analyze IS NOT NULL ORDER BY 1").fetchall()
    assert analyzed == [("conversations",), ("messages",), ("runs",)]
    queued = conn.execute("SELECT count(*) FROM compaction.audit_queue").fetchone()
    assert queued is not None
    assert queued[0] >= 1

    again = run_cli("import", str(path), "--dsn", dsn)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("imported 20 conversations: 0 runs and 0 messages written,"
                                   " 1000 runs and 2000 messages already there")
    assert counts(conn) == (20, 1000, 2000)

    worker = run_cli("worker", "--once", "--model", EXTRACTIVE2_MODEL, "--dsn", dsn,
                     timeout=600)
    assert worker.returncode == 0, worker.stderr
    summarized = conn.execute(
        "SELECT conversation_id, array_agg(from_pair ORDER BY from_pair)"
        " FROM compaction.summaries GROUP BY 1 ORDER BY 1").fetchall()
    assert summarized == [(f"conv-{c:02d}", [0, 10, 20]) for c in range(20)]


def test_a_malformed_line_is_named_and_nothing_is_written(conn: Conn, dsn: str,
                                                          tmp_path: Path) -> None:
    path = export(tmp_path / "history.jsonl", conversations=3, pairs=5)
    lines = path.read_text(encoding="utf-8").splitlines()
    bad = json.loads(lines[1])
    bad["pairs"][3] = {"user": "q", "assistant": 42}
    lines[1] = json.dumps(bad)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = run_cli("import", str(path), "--dsn", dsn)
    assert result.returncode == 1
    assert f"{path}:2: pairs[3].assistant must be a string, got int" in result.stderr
    assert counts(conn) == (0, 0, 0)

    path.write_text(lines[0] + "\n{\"conversation_id\": \"x\", \"pairs\": [\n", encoding="utf-8")
    result = run_cli("import", str(path), "--dsn", dsn)
    assert result.returncode == 1
    assert f"{path}:2: " in result.stderr
    assert counts(conn) == (0, 0, 0)


def test_a_conversation_the_database_refuses_is_not_half_written(
        conn: Conn, dsn: str, tmp_path: Path) -> None:
    """One transaction per conversation: a row the database refuses midway (here a host's
    own check, as a trigger) leaves that conversation absent, the ones before it whole."""
    conn.execute("""
        CREATE FUNCTION public.refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.content = 'BOOM' THEN RAISE EXCEPTION 'host check: BOOM refused'; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_boom BEFORE INSERT ON compaction_source.messages
            FOR EACH ROW EXECUTE FUNCTION public.refuse_boom();
    """)
    path = export(tmp_path / "history.jsonl", conversations=2, pairs=40)
    lines = path.read_text(encoding="utf-8").splitlines()
    second = json.loads(lines[1])
    second["pairs"][39]["assistant"] = "BOOM"
    path.write_text(lines[0] + "\n" + json.dumps(second) + "\n", encoding="utf-8")
    result = run_cli("import", str(path), "--batch-size", "7", "--dsn", dsn)
    assert result.returncode == 1
    assert "BOOM refused" in result.stderr
    assert conn.execute("SELECT conversation_id, count(*) FROM compaction_source.messages"
                        " GROUP BY 1").fetchall() == [("conv-00", 80)]
    assert conn.execute("SELECT count(*) FROM compaction_source.runs"
                        " WHERE conversation_id = 'conv-01'").fetchone() == (0,)


def test_agents_sdk_items(conn: Conn, dsn: str, tmp_path: Path) -> None:
    items: list[dict[str, Any]] = []
    for turn in range(31):
        items.append({"role": "user", "content": f"question {turn}"})
        if turn % 2:
            items.append({"type": "function_call", "call_id": f"c{turn}", "name": "nav",
                          "arguments": "{}", "id": f"fc_{turn}"})
            items.append({"type": "function_call_output", "call_id": f"c{turn}",
                          "output": "10.25"})
        items.append({"type": "message", "role": "assistant", "id": f"msg_{turn}",
                      "status": "completed",
                      "content": [{"type": "output_text", "text": f"answer {turn}"}]})
    # The last turn is cut short: its answer was followed by more work, never finished.
    items.append({"type": "function_call", "call_id": "late", "name": "nav", "arguments": "{}"})
    path = tmp_path / "sessions.jsonl"
    path.write_text(json.dumps({"session_id": "s-1", "items": items}) + "\n", encoding="utf-8")
    result = run_cli("import", str(path), "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    pairs = db.eligible_pairs(conn, "s-1")
    assert [(p.user_content, p.assistant_content, p.assistant_message_id) for p in pairs] == [
        (f"question {t}", f"answer {t}", f"msg_{t}") for t in range(30)]
    assert [t.from_pair for t in db.plan_targets(conn, "s-1")] == [0]


def test_a_progress_bar_on_a_terminal(dsn: str, tmp_path: Path) -> None:
    path = export(tmp_path / "history.jsonl", conversations=3, pairs=2)
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "pycompactor", "import", str(path),
                               "--dsn", dsn], stdout=subprocess.PIPE, stderr=follower,
                              check=False, timeout=120)
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    assert b"importing [##############################] 3/3 conversations" in shown
