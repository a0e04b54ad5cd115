"""aproject_history (psycopg.AsyncConnection) against project_history: the same projection.

Both drivers run the same driver-free reads (pycompactor.projection._projection_steps);
these tests hold them to it on states that exercise every placement and reason: used,
stale, superseded and not-projectable summaries, omitted history, several budgets, and a
transaction the caller already holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from pycompactor import aproject_history, project_history
from pycompactor.errors import UsageError
from tests.history import History, raw_cost
from tests.sql.test_projection import V1, V2, complete_summary, import_summary

Conn = psycopg.Connection[Any]
BUDGETS = (0, 600, 3_000, 9_000, 40_000, 10_000_000)


async def _async_projections(dsn: str, conversation_id: str,
                             budgets: tuple[int, ...] = BUDGETS) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        return [(await aproject_history(aconn, conversation_id, budget_bytes=b)).to_dict()
                for b in budgets]


def test_async_projection_equals_sync_on_every_placement_and_reason(
        conn: Conn, dsn: str) -> None:
    pairs = History(conn).pairs("a", 55)
    import_summary(conn, "a", pairs, 0, version=V1)
    import_summary(conn, "a", pairs, 10, version=V2)
    complete_summary(conn, "a", 10, "Newer summary of pairs 10-19.")
    complete_summary(conn, "a", 20, "Summary of pairs 20-29, soon stale.")
    conn.execute("UPDATE compaction_source.messages SET content = content || ' (edited)'"
                 " WHERE message_id = %s", (pairs[23].assistant_message_id,))

    # And one budget that reaches range 10 (pairs 20-54 raw, one reply edited) but not
    # its block: the walk tries it and drops it (did_not_fit).
    reach_10 = raw_cost(pairs[20:]) + len(" (edited)") + 1
    budgets = (*BUDGETS, reach_10)
    expected = [project_history(conn, "a", budget_bytes=b).to_dict() for b in budgets]
    got = asyncio.run(_async_projections(dsn, "a", budgets))
    assert got == expected
    reasons = {r["reason"] for p in expected for r in p["rejected_summaries"]}
    assert reasons == {"version_not_projectable", "superseded", "stale_source", "did_not_fit"}
    placements = {p["placement"] for proj in expected for p in proj["pairs"]}
    assert placements == {"raw", "summarized", "omitted"}
    # Unknown conversation: empty, as the sync form.
    assert asyncio.run(_async_projections(dsn, "nobody")) == [
        project_history(conn, "nobody", budget_bytes=b).to_dict() for b in BUDGETS]


def test_async_projection_joins_a_caller_transaction(dsn: str, conn: Conn) -> None:
    History(conn).pairs("t", 12)

    async def scenario() -> tuple[bool, int, str]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            # Inside the caller's transaction: its snapshot and isolation level apply.
            async with aconn.transaction():
                await aconn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
                inside = await aproject_history(aconn, "t", budget_bytes=10_000)
                row = await (await aconn.execute("SHOW transaction_isolation")).fetchone()
            assert row is not None
            # On its own, in its own read-only snapshot (tests/e2e/test_read_replica.py
            # runs it on a hot standby).
            alone = await aproject_history(aconn, "t", budget_bytes=10_000)
            return inside == alone, len(alone.pairs), str(row[0])

    same, n_pairs, isolation = asyncio.run(scenario())
    assert same
    assert n_pairs == 12
    assert isolation == "serializable"


def test_async_negative_budget_is_a_bad_argument(dsn: str) -> None:
    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await aproject_history(aconn, "x", budget_bytes=-1)

    with pytest.raises(UsageError):
        asyncio.run(scenario())
