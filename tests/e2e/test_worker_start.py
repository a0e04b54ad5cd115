"""contract §12: the worker logs `started` only once it has connected, found the schema at
this package's revision and its grants; a worker that cannot start prints exactly one
line on stderr (why) and exits non-zero."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from tests.conftest import make_dsn
from tests.e2e.cli import run_cli

MODEL = "pycompactor/extractive-1"


def worker_once(dsn: str) -> Any:
    return run_cli("worker", "--once", "--model", MODEL, "--dsn", dsn)


def assert_one_line_and_no_start(result: Any, expected: str) -> None:
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr
    assert "started" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_database() -> None:
    result = worker_once("host=127.0.0.1 port=1 user=nobody dbname=nowhere connect_timeout=3")
    assert_one_line_and_no_start(result, "cannot reach the database")


def test_unmigrated_database(new_database: Any) -> None:
    assert_one_line_and_no_start(worker_once(new_database()), "pycompactor migrate")


def test_older_schema_says_to_migrate(dsn: str) -> None:
    """A schema that lacks a function this package's worker calls, as one from an older
    release would."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP FUNCTION compaction.reply_problem(text, text, int)")
    assert_one_line_and_no_start(worker_once(dsn), "pycompactor migrate")


@pytest.fixture
def stranger(postgresql_proc: PostgreSQLExecutor, admin_dsn: str, dsn: str) -> Iterator[str]:
    """A LOGIN role of the test database that holds no engine role."""
    name = f"stranger_{uuid.uuid4().hex[:8]}"
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield make_dsn(postgresql_proc, dbname, user=name)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_role_without_the_worker_grants(stranger: str) -> None:
    result = worker_once(stranger)
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1, result.stderr
    assert "compaction_worker" in result.stderr
    assert "started" not in result.stdout + result.stderr


def test_a_worker_that_can_start_says_so(dsn: str) -> None:
    result = worker_once(dsn)
    assert result.returncode == 0, result.stderr
    assert "started" in result.stdout + result.stderr
