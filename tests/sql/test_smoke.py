from typing import Any

import psycopg

from pycompactor import db
from tests.history import History


def test_thirty_pairs_make_range_zero(conn: psycopg.Connection[Any]) -> None:
    History(conn).pairs("c1", 30)
    targets = db.plan_targets(conn, "c1")
    assert [(t.from_pair, t.to_pair) for t in targets] == [(0, 9)]
