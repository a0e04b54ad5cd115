"""The source contract check behind `pycompactor check-source`.

Verifies that compaction.source_runs / compaction.source_messages exist with the
contract's columns and types, and samples conversations to show which runs are excluded
from pairing and why.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from psycopg import sql

from pycompactor import db
from pycompactor.errors import wrap_exceptions

#: The source contract (DESIGN §2): view -> column -> type.
CONTRACT: dict[str, dict[str, str]] = {
    "source_runs": {"run_id": "text", "conversation_id": "text", "status": "text"},
    "source_messages": {
        "message_id": "text",
        "conversation_id": "text",
        "run_id": "text",
        "role": "text",
        "status": "text",
        "content": "text",
        "seq": "bigint",
    },
}


@dataclass(frozen=True, slots=True)
class ConversationSample:
    conversation_id: str
    runs: int
    pairs: int
    excluded: dict[str, int]


#: What `compaction.derived_state_status()` answers, as check-source explains it.
DERIVED_STATE_NOTES: dict[str, str] = {
    "in_use": "in use (the tables behind the views are tracked)",
    "not_rebuilt": "not in use: the views or their tracking triggers changed since the last"
                   " rebuild; run `pycompactor migrate` or CALL compaction.rebuild_derived_state()",
    "untracked": "not in use: some table behind the source views has no tracking triggers,"
                 " so every call judges from the views (exact, slower); attach them"
                 " (docs/integrating.md)",
}


@dataclass(frozen=True, slots=True)
class SourceReport:
    problems: list[str] = field(default_factory=list)
    samples: list[ConversationSample] = field(default_factory=list)
    derived_state: str | None = None

    @property
    def derived_state_note(self) -> str | None:
        if self.derived_state is None:
            return None
        return DERIVED_STATE_NOTES.get(self.derived_state, self.derived_state)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "problems": list(self.problems),
            "derived_state": self.derived_state,
            "samples": [
                {
                    "conversation_id": s.conversation_id,
                    "runs": s.runs,
                    "pairs": s.pairs,
                    "excluded": dict(s.excluded),
                }
                for s in self.samples
            ],
        }


def contract_problems(conn: db.Connection) -> list[str]:
    """One sentence per missing view, missing column or mistyped column."""
    problems: list[str] = []
    with wrap_exceptions(), conn.cursor() as cur:
        for view, columns in CONTRACT.items():
            cur.execute(
                "SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)"
                " FROM pg_catalog.pg_attribute AS a"
                " WHERE a.attrelid = pg_catalog.to_regclass(%s) AND a.attnum > 0"
                " AND NOT a.attisdropped",
                (f"compaction.{view}",),
            )
            found = dict(cur.fetchall())
            if not found:
                problems.append(f"view compaction.{view} is missing")
                continue
            for column, expected in columns.items():
                actual = found.get(column)
                if actual is None:
                    problems.append(f"compaction.{view}.{column} is missing (expected {expected})")
                elif actual != expected:
                    problems.append(
                        f"compaction.{view}.{column} is {actual}, expected {expected}"
                        f" (cast it in the view: {column}::{expected})"
                    )
    return problems


def sample_conversations(conn: db.Connection, limit: int) -> list[str]:
    with wrap_exceptions(), conn.cursor() as cur:
        cur.execute(
            sql.SQL(
                "SELECT DISTINCT conversation_id FROM compaction.source_runs"
                " WHERE conversation_id IS NOT NULL ORDER BY conversation_id LIMIT {}"
            ).format(sql.Literal(limit))
        )
        return [row[0] for row in cur.fetchall()]


def check_source(
    conn: db.Connection, conversation_ids: list[str] | None = None, sample: int = 5
) -> SourceReport:
    problems = contract_problems(conn)
    if problems:
        return SourceReport(problems=problems)
    ids = conversation_ids if conversation_ids else sample_conversations(conn, sample)
    samples = []
    for conversation_id in ids:
        verdicts = db.explain_runs(conn, conversation_id)
        excluded = Counter(v.reason for v in verdicts if v.reason is not None)
        samples.append(
            ConversationSample(
                conversation_id=conversation_id,
                runs=len(verdicts),
                pairs=sum(1 for v in verdicts if v.eligible),
                excluded=dict(sorted(excluded.items())),
            )
        )
    return SourceReport(samples=samples, derived_state=derived_state(conn))


def derived_state(conn: db.Connection) -> str:
    """in_use, not_rebuilt or untracked (compaction.derived_state_status())."""
    with wrap_exceptions(), conn.cursor() as cur:
        cur.execute("SELECT compaction.derived_state_status()")
        row = cur.fetchone()
    assert row is not None
    return str(row[0])
