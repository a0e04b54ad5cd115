"""A real Citus cluster for `make test-citus`: a coordinator and two workers on loopback.

The Citus installation is the one whose pg_config PYCOMPACTOR_CITUS_PG_CONFIG names
(`make test-citus PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config`); `make test` never
collects this directory. Each node is started by pytest-postgresql like the main suite's
cluster. The cluster is built by running the documented steps themselves
(docs/operations.md, "Scaling out with Citus"): the nodes start with the documented
settings, take the documented `pg_hba.conf` lines (so the nodes authenticate the owner by
its password, as in production), and every test's database, created on all three nodes,
is set up by the section's SQL and console blocks in their order, with this cluster's
addresses, ports and password in place of the documented ones.

The fixtures `dsn`, `conn` and `admin_dsn` override the main suite's, so tests written
for one PostgreSQL run here unchanged (tests/citus/test_on_citus.py imports them).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import textwrap
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pytest_postgresql.executors import PostgreSQLExecutor

from pycompactor import cli, schema
from pycompactor.cli.cluster import free_port, runnable_bindir, server_user
from tests.conftest import _pg_ctl, make_dsn, wait_until_accepting
from tests.history import History
from tests.sql.conftest import login_roles

NODES = ("coordinator", "worker1", "worker2")
#: The documented addresses, in the order of NODES.
DOC_HOSTS = ("10.0.0.10", "10.0.0.11", "10.0.0.12")
DOC_PASSWORD = "choose-a-password"
#: This session's owner password, in place of the documented one.
OWNER_PASSWORD = secrets.token_hex(12)
OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def runbook() -> list[tuple[str, str]]:
    """The fenced blocks of docs/operations.md's Citus section: (language, text), in order."""
    text = OPERATIONS.read_text(encoding="utf-8")
    start = text.index("### Scaling out with Citus")
    section = text[start:text.index("\n## ", start)]
    blocks = re.findall(r"^( *)```(\w+)\n(.*?)^\1```", section, flags=re.DOTALL | re.MULTILINE)
    return [(lang, textwrap.dedent(body)) for _, lang, body in blocks]


def runbook_block(lang: str, first_line: str) -> list[str]:
    found = [body for kind, body in runbook() if kind == lang and body.startswith(first_line)]
    assert found, f"docs/operations.md lost its {lang} block starting {first_line!r}"
    return found


def documented_settings() -> str:
    """The documented postgresql.conf lines as server options."""
    (ini,) = [body for kind, body in runbook() if kind == "ini"]
    settings = [line.split("=", 1) for line in ini.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert settings, "docs/operations.md lost its Citus settings"
    return " ".join(f"-c {key.strip()}={value.strip()}" for key, value in settings)


def localise(text: str, nodes: dict[str, PostgreSQLExecutor]) -> str:
    """The documented addresses, ports and password made this cluster's."""
    for doc_host, name in zip(DOC_HOSTS, NODES, strict=True):
        node = nodes[name]
        text = text.replace(f"'{doc_host}', 5432", f"'{node.host}', {node.port}")
        text = text.replace(f"{doc_host}:5432", f"{node.host}:{node.port}")
    return (text.replace("10.0.0.0/24", "127.0.0.1/32")
                .replace(DOC_PASSWORD, OWNER_PASSWORD))


def allow_the_owner(nodes: dict[str, PostgreSQLExecutor]) -> None:
    """The documented pg_hba.conf lines, above the cluster's own, then a reload."""
    (hba,) = runbook_block("text", "host  all  compaction_owner")
    for executor in nodes.values():
        path = Path(executor.datadir) / "pg_hba.conf"
        path.write_text(localise(hba, nodes) + path.read_text(encoding="utf-8"),
                        encoding="utf-8")
        with psycopg.connect(make_dsn(executor, "postgres"), autocommit=True) as c:
            c.execute("SELECT pg_reload_conf()")
            errors = c.execute("SELECT count(*) FROM pg_hba_file_rules WHERE error IS NOT NULL"
                               ).fetchone()
            assert errors == (0,), "the documented pg_hba.conf lines do not parse"


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


@contextmanager
def started_nodes(root: Path, prefix: str = "") -> Iterator[dict[str, PostgreSQLExecutor]]:
    """A coordinator and two workers on loopback with the documented settings (each
    node's own pg_hba.conf as initdb wrote it), stopped at the end."""
    bindir, staged = runnable_bindir(_bindir(), server_user())
    nodes: dict[str, PostgreSQLExecutor] = {}
    try:
        for name in NODES:
            workdir = root / f"{prefix}{name}"
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
                postgres_options=documented_settings() + " -c max_connections=300"
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
def citus_nodes(pg_workdir: Path) -> Iterator[dict[str, PostgreSQLExecutor]]:
    with started_nodes(pg_workdir) as nodes:
        allow_the_owner(nodes)
        yield nodes


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


def create_distributed_database(
        nodes: dict[str, PostgreSQLExecutor], name: str, revision: str = "head",
        before_distributing: Callable[[str], None] | None = None) -> str:
    """The application's database on every node, then the documented steps, in order
    (the engine migrated to `revision`: an earlier one for the upgrade tests);
    `before_distributing` runs with the coordinator's DSN just before the step that
    distributes the engine (what a host did while it ran on one node)."""
    for executor in nodes.values():
        with psycopg.connect(make_dsn(executor, "postgres"), autocommit=True) as c:
            c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                sql.Identifier(name)))
    coordinator = nodes["coordinator"]
    dsn = make_dsn(coordinator, name)
    ran = 0
    for lang, body in runbook():
        where = body.splitlines()[0] if body else ""
        if lang == "sql" and where.startswith("-- on every node"):
            targets = list(nodes.values())
        elif lang == "sql" and where.startswith("-- on the coordinator"):
            targets = [coordinator]
        elif lang == "console" and body.startswith("$ pycompactor migrate --dsn "):
            (doc_dsn,) = re.findall(r"--dsn (\S+)", body)
            assert localise(doc_dsn, nodes).startswith(f"postgresql://admin@{coordinator.host}:")
            if revision == "head":
                assert cli.main(["migrate", "--dsn", dsn]) == 0
            else:
                schema.upgrade(dsn, revision)
            ran += 1
            continue
        else:
            continue
        if before_distributing is not None and "distribute_on_citus()" in body:
            before_distributing(dsn)
        for executor in targets:
            with psycopg.connect(make_dsn(executor, name), autocommit=True) as c:
                c.execute(localise(body, nodes))
        ran += 1
    # extension, nodes, migrate, the owner's password and its authinfo, distribution
    assert ran == 6, "docs/operations.md changed the steps of its Citus runbook"
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


@pytest.fixture
def login_role(citus_nodes: dict[str, PostgreSQLExecutor],
               dsn: str) -> Iterator[Callable[[str | None], str]]:
    """The main suite's login_role on the coordinator, created and dropped through the
    test's database, where the workers are nodes, so that Citus creates and drops the
    role on every node."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(dbname, str)
    with login_roles(dsn, lambda name: make_dsn(citus_nodes["coordinator"], dbname,
                                                user=name)) as factory:
        yield factory
