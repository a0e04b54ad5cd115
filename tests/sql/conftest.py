"""Fixtures of the database-core tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from tests.conftest import make_dsn

#: Pass None for a login that is a member of no role at all (an outsider).
LoginRole = Callable[[str | None], str]


@contextmanager
def login_roles(admin_dsn: str, dsn_for: Callable[[str], str]) -> Iterator[LoginRole]:
    """Factory: a LOGIN role that is a member of one engine role (None: of no role),
    created through `admin_dsn`; returns `dsn_for(role)`.

    Roles are cluster-wide, so names are unique and every role is dropped at the end.
    """
    created: list[str] = []

    def factory(member_of: str | None) -> str:
        name = f"login_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            if member_of is None:
                admin.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN").format(
                    psycopg.sql.Identifier(name)))
            else:
                admin.execute(psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    psycopg.sql.Identifier(name), psycopg.sql.Identifier(member_of)))
        created.append(name)
        return dsn_for(name)

    yield factory
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        for name in created:
            admin.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(name)))


@pytest.fixture
def login_role(postgresql_proc: PostgreSQLExecutor, admin_dsn: str,
               dsn: str) -> Iterator[LoginRole]:
    """A LOGIN role that is a member of one engine role (None: of no role), in the test's
    database; returns its DSN."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    with login_roles(admin_dsn, lambda name: make_dsn(postgresql_proc, dbname, user=name)
                     ) as factory:
        yield factory


def connect_as(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True)
