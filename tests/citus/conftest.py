"""A real Citus cluster for `make test-citus`: a coordinator and two workers on loopback.

The Citus installation is the one whose pg_config PYCOMPACTOR_CITUS_PG_CONFIG names
(`make test-citus PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config`); `make test` never
collects this directory. Each node is started by pytest-postgresql like the main suite's
cluster. Every test gets a database of its own on all three nodes, migrated with
`pycompactor migrate` and distributed with the documented steps (docs/operations.md,
"Scaling out with Citus"): the owner role may log in (the cluster's nodes connect as it),
then `CALL compaction.distribute_on_citus()`.

The fixtures `dsn`, `conn` and `admin_dsn` override the main suite's, so tests written
for one PostgreSQL run here unchanged (tests/citus/test_on_citus.py imports them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import schema
from pycompactor.cluster import free_port, runnable_bindir, server_user
from tests.conftest import _pg_ctl, make_dsn, wait_until_accepting
from tests.history import History

NODES = ("coordinator", "worker1", "worker2")


def _bindir() -> Path:
    pg_config = os.environ.get("PYCOMPACTOR_CITUS_PG_CONFIG")
    if not pg_config:
        raise pytest.UsageError(
            "tests/citus needs a Citus installation: make test-citus PG_CONFIG=/path/to/pg_config")
    out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True)
    libdir = subprocess.run([pg_config, "--pkglibdir"], capture_output=True, text=True,
                            check=True).stdout.strip()
    if not (Path(libdir) / "citus.so").exists():
        raise pytest.UsageError(f"no citus.so in {libdir}: that PostgreSQL has no Citus installed")
    return Path(out.stdout.strip())


@pytest.fixture(scope="session")
def citus_nodes(pg_workdir: Path) -> Iterator[dict[str, PostgreSQLExecutor]]:
    bindir, staged = runnable_bindir(_bindir(), server_user())
    nodes: dict[str, PostgreSQLExecutor] = {}
    try:
        for name in NODES:
            workdir = pg_workdir / name
            workdir.mkdir()
            user = server_user()
            if user is not None:
                shutil.chown(workdir, user, user)
            executor = PostgreSQLExecutor(
                executable=_pg_ctl(bindir, workdir),
                host="127.0.0.1",
                port=free_port(),
                datadir=str(workdir / "data"),
                unixsocketdir=str(workdir),
                logfile=str(workdir / "server.log"),
                startparams="-w",
                dbname="postgres",
                user="postgres",
                postgres_options="-c shared_preload_libraries=citus"
                " -c citus.enable_unsafe_triggers=on -c max_connections=300"
                " -c synchronous_commit=off -c full_page_writes=off"
                " -c listen_addresses=127.0.0.1",
            )
            executor.start()
            nodes[name] = executor
            wait_until_accepting(make_dsn(executor, "postgres"))
        yield nodes
    finally:
        for executor in nodes.values():
            executor.stop()
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)


@pytest.fixture(scope="session")
def citus_version(citus_nodes: dict[str, PostgreSQLExecutor]) -> str:
    coordinator = citus_nodes["coordinator"]
    with psycopg.connect(make_dsn(coordinator, "postgres"), autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS citus")
        row = c.execute("SELECT citus_version(), version()").fetchone()
    assert row is not None
    return f"{row[0]} | {row[1]}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    version = os.environ.get("_PYCOMPACTOR_CITUS_VERSION")
    if version:
        terminalreporter.write_line(f"ran on: {version}")


@pytest.fixture(scope="session", autouse=True)
def _report_version(citus_version: str) -> None:
    # Read by pytest_terminal_summary: the run states the Citus it ran on.
    os.environ["_PYCOMPACTOR_CITUS_VERSION"] = citus_version


@pytest.fixture(scope="session", autouse=True)
def _writers_enqueue() -> Iterator[None]:
    # The reference tables' queue triggers are detached on Citus (distribute_on_citus):
    # writers call compaction.enqueue themselves, as docs/operations.md tells hosts to.
    History.enqueue_writes = True
    yield
    History.enqueue_writes = False


@pytest.fixture(scope="session")
def admin_dsn(citus_nodes: dict[str, PostgreSQLExecutor]) -> str:
    return make_dsn(citus_nodes["coordinator"], "postgres")


def create_distributed_database(nodes: dict[str, PostgreSQLExecutor], name: str) -> str:
    for executor in nodes.values():
        with psycopg.connect(make_dsn(executor, "postgres"), autocommit=True) as c:
            c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)))
        with psycopg.connect(make_dsn(executor, name), autocommit=True) as c:
            c.execute("CREATE EXTENSION citus")
    coordinator = nodes["coordinator"]
    dsn = make_dsn(coordinator, name)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT citus_set_coordinator_host(%s, %s)",
                  (coordinator.host, coordinator.port))
        for worker in ("worker1", "worker2"):
            c.execute("SELECT citus_add_node(%s, %s)", (nodes[worker].host, nodes[worker].port))
    # The documented steps: migrate, let the owner log in (from the cluster's nodes only,
    # by pg_hba.conf in production; trust on this loopback cluster), distribute.
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("ALTER ROLE compaction_owner LOGIN")
        c.execute("CALL compaction.distribute_on_citus()")
    return dsn


def drop_distributed_database(nodes: dict[str, PostgreSQLExecutor], name: str) -> None:
    for executor in nodes.values():
        with psycopg.connect(make_dsn(executor, "postgres"), autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@pytest.fixture
def dsn(citus_nodes: dict[str, PostgreSQLExecutor]) -> Iterator[str]:
    """A fresh migrated, distributed database on every node for this test."""
    name = f"c_{uuid.uuid4().hex[:12]}"
    try:
        yield create_distributed_database(citus_nodes, name)
    finally:
        drop_distributed_database(citus_nodes, name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection
