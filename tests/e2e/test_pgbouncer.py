"""PgBouncer in transaction pooling mode in front of the test cluster (contract §11).

Through the pooler a client's consecutive transactions may run on different server
connections, so nothing may depend on session state: no session advisory lock, no SET
without LOCAL, no named prepared statement. The claim storm, a worker pass and the
projection go through it here with exact outcomes; the history is written directly.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import db
from pycompactor.errors import PycompactorError
from pycompactor.projection import project_history
from pycompactor.summarizers.extractive import OFFLINE_MODEL
from pycompactor.summarizers.openai_compatible import PROMPT_VERSION
from tests.e2e.cli import run_cli
from tests.history import History
from tests.pgbouncer import PgBouncer
from tests.workerkit import attempts, events_named, run_worker_cli, summaries, worker_env

Conn = psycopg.Connection[Any]

_CTX = mp.get_context("fork")


@pytest.fixture(scope="module")
def bouncer(postgresql_proc: PostgreSQLExecutor) -> Iterator[PgBouncer]:
    with PgBouncer(postgresql_proc.host, postgresql_proc.port) as running:
        yield running


def through(bouncer: PgBouncer, dsn: str) -> str:
    return bouncer.dsn(str(conninfo_to_dict(dsn)["dbname"]))


def _interleaved_calls(conn: Conn, other: Conn, conversation_id: str) -> None:
    """Repeat one call on `conn` while `other` keeps taking the server connection that
    `conn` used last (the pooler hands out the most recent one first)."""
    for _ in range(12):
        # A bound call (its values sent apart from the statement, which psycopg would
        # prepare) and an inline one (one simple query, never prepared).
        db.eligible_pairs(conn, conversation_id)
        db.plan_targets(conn, conversation_id)
        with other.transaction():
            other.execute("SELECT 1")
            db.eligible_pairs(conn, conversation_id)
            db.plan_targets(conn, conversation_id)


def test_driver_connections_prepare_nothing(postgresql_proc: PostgreSQLExecutor, conn: Conn,
                                            dsn: str) -> None:
    """psycopg's automatic preparation breaks under transaction pooling (shown with a
    plain connection); db.connect turns it off, so the same calls succeed."""
    History(conn).pairs("c1", 30)
    # A pooler of its own: the failing half leaves named statements on its servers.
    with PgBouncer(postgresql_proc.host, postgresql_proc.port) as own:
        pooled = through(own, dsn)
        with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as other, \
                psycopg.connect(pooled, autocommit=True) as plain, \
                pytest.raises(PycompactorError, match=r"prepared statement \"_pg3_\d+\""):
            _interleaved_calls(plain, other, "c1")
        with PgBouncer(postgresql_proc.host, postgresql_proc.port) as fresh:
            pooled = through(fresh, dsn)
            with psycopg.connect(pooled, autocommit=True, prepare_threshold=None) as other, \
                    db.connect(pooled) as driver:
                _interleaved_calls(driver, other, "c1")
                assert len(db.plan_targets(driver, "c1")) == 1
                # The timeouts were transaction-local: nothing stays on the session.
                assert driver.execute("SHOW lock_timeout").fetchone() == ("0",)


def _claim_once(dsn: str, barrier: Any, target: Any, results: Any, name: str) -> None:
    with db.connect(dsn) as conn:
        barrier.wait(timeout=60)
        r = db.claim(conn, "storm", "default", target.from_pair, target.source_message_ids,
                     target.source_hash, "storm-model", PROMPT_VERSION, name)
        results.put((name, r.reason))


def test_claim_storm_through_pgbouncer(bouncer: PgBouncer, conn: Conn, dsn: str) -> None:
    """16 processes released by one barrier claim one identity through the pooler:
    exactly one claims, the other 15 get already_running, one attempt exists."""
    History(conn).pairs("storm", 30)
    [target] = db.plan_targets(conn, "storm")
    pooled = through(bouncer, dsn)
    n = 16
    barrier = _CTX.Barrier(n)
    results: Any = _CTX.Queue()
    procs = [_CTX.Process(target=_claim_once, args=(pooled, barrier, target, results, f"w{i}"),
                          daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(n)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert Counter(reason for _, reason in outcomes) == Counter(
        {"claimed": 1, "already_running": n - 1})
    [row] = attempts(conn, "storm")
    assert (row.attempt, row.state) == (1, "running")
    assert conn.execute("SELECT count(*) FROM compaction.admission"
                        " WHERE holder_conversation_id IS NOT NULL").fetchone() == (1,)


def test_worker_pass_and_projection_through_pgbouncer(bouncer: PgBouncer, conn: Conn,
                                                      dsn: str) -> None:
    """`worker --once` and `project` through the pooler: every target completed exactly
    once, nothing else claimed, and the projection equals the direct one."""
    h = History(conn)
    for c in range(8):
        h.pairs(f"conv-{c}", 40)  # 2 targets each
    pooled = through(bouncer, dsn)
    env = worker_env(pooled)
    code, events, stderr = run_worker_cli("--once", "--concurrency", "4", "--model",
                                          OFFLINE_MODEL, env=env)
    assert code == 0, stderr
    assert not list(events_named(events, "db_error")), stderr
    assert not list(events_named(events, "job_error")), stderr
    assert len(list(events_named(events, "completed"))) == 16, stderr
    got = summaries(conn)
    assert [(c, f) for c, f, _ in got] == [(f"conv-{c}", f) for c in range(8) for f in (0, 10)]
    assert {(a.attempt, a.state) for a in attempts(conn)} == {(1, "completed")}
    assert len(attempts(conn)) == 16

    # A sweep through the pooler finds every target already completed and claims nothing
    # (it does not even try: the targets' identities hold completed summaries).
    code, events, stderr = run_worker_cli("--once", "--sweep", "--model", OFFLINE_MODEL,
                                          env=env)
    assert code == 0, stderr
    assert not list(events_named(events, "claimed"))
    assert not list(events_named(events, "claim_refused"))
    assert Counter(e["reason"] for e in events_named(events, "target_skipped")) == Counter(
        {"already_completed": 16})

    with db.connect(pooled) as via_pooler:
        for c in range(8):
            budget = 4000
            pooled_projection = project_history(via_pooler, f"conv-{c}", budget_bytes=budget)
            direct = project_history(conn, f"conv-{c}", budget_bytes=budget)
            assert pooled_projection.to_dict() == direct.to_dict()
            placements = Counter(p.placement for p in pooled_projection.pairs)
            assert placements["summarized"] == 20
    result = run_cli("project", "conv-3", "--budget-bytes", "4000", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == run_cli(
        "project", "conv-3", "--budget-bytes", "4000", "--json",
        env=worker_env(dsn)).stdout.strip()
    # The clients really went through the pooler.
    assert f"db={conninfo_to_dict(dsn)['dbname']}" in bouncer.log
