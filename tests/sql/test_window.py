"""contract §4: the fixed window (30 / 10 / 20) through compaction.plan_targets."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pycompactor import db, source_hash
from tests.history import History

Conn = psycopg.Connection[Any]


@pytest.mark.parametrize(
    ("n_pairs", "expected"),
    [
        (0, []),
        (9, []),
        (29, []),
        (30, [(0, 9)]),
        (31, [(0, 9)]),
        (39, [(0, 9)]),
        (40, [(0, 9), (10, 19)]),
        (49, [(0, 9), (10, 19)]),
        (50, [(0, 9), (10, 19), (20, 29)]),
    ],
)
def test_window_edges(conn: Conn, n_pairs: int, expected: list[tuple[int, int]]) -> None:
    History(conn).pairs("c", n_pairs)
    assert [(t.from_pair, t.to_pair) for t in db.plan_targets(conn, "c")] == expected


def test_source_ids_come_user_then_assistant_per_pair(conn: Conn) -> None:
    seeded = History(conn).pairs("c", 40)
    targets = db.plan_targets(conn, "c")
    for target in targets:
        block = seeded[target.from_pair : target.to_pair + 1]
        expected = [i for p in block for i in (p.user_message_id, p.assistant_message_id)]
        assert target.source_message_ids == expected
        assert len(set(target.source_message_ids)) == 20
        assert target.source_hash == source_hash(db.eligible_pairs(conn, "c")[
            target.from_pair : target.to_pair + 1])


def test_excluded_runs_do_not_count_towards_the_window(conn: Conn) -> None:
    h = History(conn)
    h.pairs("c", 29)
    h.pair("c", run_status="failed")
    h.pair("c", assistant_status="streaming")
    assert db.plan_targets(conn, "c") == []
    h.pair("c")
    assert [(t.from_pair, t.to_pair) for t in db.plan_targets(conn, "c")] == [(0, 9)]


def test_sql_source_hash_needs_a_full_aligned_range(conn: Conn) -> None:
    History(conn).pairs("c", 25)
    pairs = db.eligible_pairs(conn, "c")
    assert db.source_hash(conn, "c", 0) == source_hash(pairs[0:10])
    # a range that is not a target still has a hash: the function binds, it does not plan
    assert db.source_hash(conn, "c", 10) == source_hash(pairs[10:20])
    assert db.source_hash(conn, "c", 20) is None  # only 5 pairs there
    assert db.source_hash(conn, "c", 5) is None
    assert db.source_hash(conn, "c", -10) is None
    assert db.source_hash(conn, "nope", 0) is None
