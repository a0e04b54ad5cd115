"""Upgrading a populated 0017 database to 0018_worker_boundary (issue 30).

At 0017 a worker login runs an attempt on `a` and the superuser one on `b` whose lease
will have run out. After the upgrade every conversation with jobs has its lock row (so
reap reaches `b`), the attempt nobody can say who claimed belongs to the owner and
superusers only (the worker's heartbeat is refused; the lease runs out as usual), and
downgrading and upgrading again keeps all of it readable.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import db, schema
from tests.conftest import make_dsn
from tests.history import History
from tests.sql.engine import LEASE, claim

Conn = psycopg.Connection[Any]


@pytest.fixture
def worker_login(postgresql_proc: PostgreSQLExecutor, admin_dsn: str) -> Iterator[str]:
    """A LOGIN member of compaction_worker (its database is chosen by the test)."""
    name = f"login_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        # the role is created by the first migration; make sure it exists before
        admin.execute("DO $$ BEGIN CREATE ROLE compaction_worker NOLOGIN;"
                      " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        admin.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE compaction_worker")
                      .format(psycopg.sql.Identifier(name)))
    yield name
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(name)))


def test_upgrade_from_0017_binds_nothing_it_cannot_know(
        new_database: Callable[..., str], postgresql_proc: PostgreSQLExecutor,
        worker_login: str) -> None:
    dsn = new_database()
    schema.upgrade(dsn, "0017_lean_cycle")
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    worker_dsn = make_dsn(postgresql_proc, dbname, user=worker_login)
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(worker_dsn, autocommit=True) as worker:
        history = History(conn)
        history.pairs("a", 30)
        history.pairs("b", 30)
        [ta] = db.plan_targets(conn, "a")
        [tb] = db.plan_targets(conn, "b")
        running = claim(worker, "a", ta, now=None)
        # a lease that ran out a second ago (a superuser may set the clock)
        past = conn.execute("SELECT now() - %s - interval '1 second'", (LEASE,)).fetchone()
        assert past is not None
        expiring = claim(conn, "b", tb, now=past[0])
        assert running.job_id is not None
        assert expiring.claimed

        schema.upgrade(dsn)
        assert conn.execute("SELECT conversation_id FROM compaction.conversation_locks"
                            " ORDER BY 1").fetchall() == [("a",), ("b",)]
        assert conn.execute("SELECT count(*) FROM compaction.attempts"
                            " WHERE claimed_by IS NOT NULL").fetchone() == (0,)
        # nobody can tell which login claimed it: the owner's and superusers' alone
        assert db.heartbeat(worker, running.job_id, 1, conversation_id="a").ok is False
        assert db.heartbeat(conn, running.job_id, 1, conversation_id="a").ok
        # reap reaches the expired attempt (its conversation's lock row exists)
        assert db.reap(conn) == 1
        # a new claim is bound to its login
        again = claim(worker, "b", tb, now=None)
        assert (again.claimed, again.attempt) == (True, 2)
        assert conn.execute("SELECT claimed_by FROM compaction.audit_jobs"
                            " WHERE conversation_id = 'b' AND attempt = 2").fetchone() == (
            worker_login,)

    schema.downgrade(dsn, "0017_lean_cycle")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM compaction.audit_jobs").fetchone() == (3,)
        assert conn.execute("SELECT to_regclass('compaction.conversation_locks')").fetchone() \
            == (None,)
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM compaction.audit_jobs").fetchone() == (3,)
