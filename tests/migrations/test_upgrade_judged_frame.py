"""Revision 0041 with the derived state out of use: this package projects from a schema
at 0040 (no frame there: it reads every pair and summary, judged from the views) and from
one at head (judged_frame's one statement), and gives the same projection on both sides of
the upgrade and of the downgrade, so an application upgraded before its database is
migrated keeps projecting."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from pycompactor import project_history, schema, source_hash
from pycompactor.hashing import source_message_ids
from tests.history import History

BEFORE = "0040_claims_with_the_targets"


def test_the_same_projection_across_the_upgrade_judged_from_the_views(
        new_database: Callable[..., str]) -> None:
    dsn = new_database()
    schema.upgrade(dsn, BEFORE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pairs = History(conn).pairs("up", 55)
        for start, version in ((0, "@3"), (0, "@2"), (10, "@3"), (20, "@1")):
            block = pairs[start : start + 10]
            conn.execute("SELECT compaction.import_summary('up', 'default', %s, %s, %s, 'm',"
                         " %s, %s, now())",
                         (start, source_message_ids(block), source_hash(block),
                          f"conversation-compaction{version}", f"summary {start}{version}"))
        conn.execute("UPDATE compaction_source.messages SET content = content || '!'"
                     " WHERE message_id = %s", (pairs[14].assistant_message_id,))
        conn.execute("ALTER TABLE compaction_source.runs DISABLE TRIGGER runs_track_insert")
        assert conn.execute("SELECT compaction.derived_state_current()").fetchone() == (False,)

        def projections() -> dict[int, Any]:
            return {b: project_history(conn, "up", budget_bytes=b).to_dict()
                    for b in (0, 3_000, 8_000, 1_000_000)}

        def frame() -> Any:
            return conn.execute("SELECT derived, pair_count, first_pair FROM"
                                " compaction.projection_frame('up', 'default', 20)").fetchone()

        assert frame() == (False, None, None)  # 0040: no frame
        before = projections()
        reasons = {r["reason"] for r in before[1_000_000]["rejected_summaries"]}
        assert reasons == {"superseded", "stale_source", "version_not_projectable"}
        schema.upgrade(dsn)
        assert frame() == (False, 55, 0)  # every pair, judged from the views
        assert projections() == before
        schema.downgrade(dsn, BEFORE)
        assert frame() == (False, None, None)
        assert projections() == before
